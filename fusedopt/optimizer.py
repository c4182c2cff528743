"""FusedOptimizer: the shared base of fusedopt's optimizers over ``torch.optim.Optimizer``.

It owns what every algorithm shares: validation of the fusedopt options, lazy state
initialisation through the codecs, dispatch of one parameter's update to a backend,
gradient release (``fused=True``, see ``release.py``) and checkpoints (``checkpoint.py``).
Subclasses give the algorithm: its state slots, hyperparameter validation and fp32 math.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict

import torch
from torch.utils.hooks import RemovableHandle

from . import checkpoint
from .backend import check_gradient, gradient_fits_prepared, kernel_allowed, new_scratch, run_update
from .buckets import UpdateBuckets, bucket_budget, can_join
from .codecs import NONNEGATIVE_SLOTS, SUPPORTED_STATE_BITS, MomentCodec, codec_for
from .master import MASTER_CORRECTION, check_master_weight_bits, correction_layout, master_value
from .reference import ParamUpdate, UpdateMath
from .release import GradientRelease
from .rng import valid_seed
from .state_memory import SharedCorrections, pack
from .streams import on_default_stream

# Options that apply to the whole optimizer; a parameter group may not set them.
OPTIMIZER_WIDE_OPTIONS = ("fused", "accumulation_steps", "seed")
SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_RESOLVE = object()  # queue_update: look up the prepared launch itself


def check_refused_options(**options) -> None:
    """torch.optim options fusedopt does not implement: their off values are accepted, others refused."""
    for name, value in options.items():
        if value not in (None, False):
            raise ValueError(f"{name}={value!r} is not supported by fusedopt (leave it at its default)")


def check_number(name: str, value, *, low: float = 0.0, high: float | None = None, message: str | None = None):
    """Raise torch's style of ValueError unless ``value`` is finite, ``low <= value`` (and ``value < high``
    when given). torch takes an infinite learning rate or weight decay; here it is refused."""
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name} as a Tensor is not supported by fusedopt; pass a float")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # numpy scalars included: they would reach the kernels' scalar arguments as they are
        raise ValueError(f"{message or f'Invalid {name}: {value!r}'} (expected a float, got {type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(message or f"Invalid {name}: {value}")  # NaN and inf: every update would be NaN
    if value < low or (high is not None and value >= high):
        raise ValueError(message or f"Invalid {name}: {value}")


def check_betas(betas) -> None:
    """Two coefficients in [0, 1), with torch's error messages."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair of floats)")
    for i, beta in enumerate(betas):
        check_number("beta", beta, high=1.0, message=f"Invalid beta parameter at index {i}: {beta}")


class FusedOptimizer(torch.optim.Optimizer):
    """Base class. Subclasses set ``algorithm`` and ``math`` and implement ``_slots``/``_check_group``."""

    algorithm: str = ""
    math: UpdateMath

    def __init__(self, params, defaults: dict, *, fused: bool, accumulation_steps: int, seed: int):
        if not isinstance(fused, bool):
            raise ValueError(f"Invalid fused: {fused!r} (expected True or False)")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"Invalid accumulation_steps: {accumulation_steps!r} (expected an integer >= 1)")
        if not valid_seed(seed):
            raise ValueError(f"Invalid seed: {seed!r} (expected a non-negative integer)")
        self.fused = fused
        self.accumulation_steps = accumulation_steps
        self.seed = seed
        self._position: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (group index, param index)
        self._next_index = 0  # a new parameter's index (a hash input: it never changes or repeats)
        self._groups_seen: list = []  # param_groups as _position last saw them (sync_groups)
        self._release: GradientRelease | None = None
        self._kernel_scratch: dict[torch.Tensor, torch.Tensor] = {}
        self._prepared: dict[torch.Tensor, tuple] = {}  # param -> (PreparedUpdate, structure, state keys, ids)
        self._window: dict[int, tuple] = {}  # group index -> (hyper, group structure) for this step's updates
        self._corrections = SharedCorrections()
        self._update_hooks: OrderedDict = OrderedDict()  # register_update_hook
        self.bucket_budget = bucket_budget()  # bytes of gradients release may hold (0: none)
        self._buckets = UpdateBuckets() if self.bucket_budget > 0 else None  # see buckets.py
        super().__init__(params, defaults)
        first = next(p for g in self.param_groups for p in g["params"])  # torch refused a list of none
        self.num_skipped_updates = torch.zeros((), dtype=torch.int64, device=first.device)
        if fused:
            self._release = GradientRelease(self)
            self._release.attach(p for g in self.param_groups for p in g["params"])

    # --- parameter groups ------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch), validating fusedopt's per-group options and the parameters."""
        for key in OPTIMIZER_WIDE_OPTIONS:
            if key in param_group:
                raise ValueError(f"'{key}' is an optimizer-wide option; pass it to the constructor, not in a group")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate")
            super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            if len(set(group["params"])) != len(group["params"]):
                raise ValueError("a parameter group contains the same parameter more than once")
            for p in group["params"]:
                check_param(p)
            self.check_group(group)
        except Exception:
            self.param_groups.pop()
            raise
        if self._release is not None and self._release.attached:  # not after remove_hooks()
            try:
                self._release.attach(group["params"])  # checks every parameter before it hooks one
            except Exception:
                self.param_groups.pop()
                raise
        group_index = len(self.param_groups) - 1
        self._new_window()
        for p in group["params"]:
            self._position[p] = (group_index, self._next_index)
            self._next_index += 1

    def sync_groups(self) -> None:
        """Follow edits made to ``param_groups`` directly, as torch.optim does: groups reordered or
        removed, parameters removed from a group. Each parameter's group is found again (its index
        stays); one no longer in any group is forgotten and its release hook removed, so nothing
        updates it. A parameter that never went through the constructor or ``add_param_group`` is
        refused: fusedopt has not validated it and has no index for it."""
        seen = [(id(g), len(g["params"])) for g in self.param_groups]
        if seen == self._groups_seen:
            return
        positions = {}
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p not in self._position or p in positions:
                    raise ValueError(
                        f"param_groups[{group_index}]['params'] holds a parameter of shape {tuple(p.shape)} that "
                        "was not added through the constructor or add_param_group() (or is listed twice); "
                        "add parameters with add_param_group()"
                    )
                positions[p] = (group_index, self._position[p][1])
        dropped = [p for p in self._position if p not in positions]
        if dropped and self._release is not None:
            self._release.detach(dropped)
        self._position, self._groups_seen = positions, seen
        self._new_window()

    def check_group(self, group: dict) -> None:
        """Validate every option of a (complete) group: the shared fusedopt ones, then the algorithm's."""
        bits = group["state_bits"]
        if bits not in SUPPORTED_STATE_BITS or isinstance(bits, bool):
            raise ValueError(f"Invalid state_bits: {bits!r} (expected 32, 16, 8 or 4)")
        numel = group["min_compress_numel"]
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"Invalid min_compress_numel: {numel!r} (expected an integer >= 0)")
        check_master_weight_bits(group["master_weight_bits"])
        if not isinstance(group["maximize"], bool):
            raise ValueError(f"Invalid maximize: {group['maximize']!r} (expected True or False)")
        self._check_hyperparameters(group)

    def _check_hyperparameters(self, group: dict) -> None:
        raise NotImplementedError

    def _slots(self, group: dict) -> tuple[str, ...]:
        """Names of the moment tensors this algorithm keeps under ``group``'s settings."""
        raise NotImplementedError

    def _hyper(self, group: dict) -> dict:
        """The keyword arguments of ``math`` (plus ``maximize``) from a group."""
        raise NotImplementedError

    # --- state -----------------------------------------------------------------------------

    def codecs(self, p: torch.Tensor, group: dict) -> dict[str, MomentCodec]:
        """Slot name -> codec for parameter ``p`` under ``group``."""
        bits, numel = group["state_bits"], group["min_compress_numel"]
        return {
            slot: codec_for(bits, p.shape, numel, signed=slot not in NONNEGATIVE_SLOTS) for slot in self._slots(group)
        }

    def position(self, p: torch.Tensor) -> tuple[dict, int]:
        """The group holding ``p`` and ``p``'s index in the optimizer (a hash input)."""
        group_index, index = self._position[p]
        return self.param_groups[group_index], index

    def ensure_state(self, p: torch.Tensor) -> dict:
        """The state of ``p``, created (step 0, zero moments) on first use."""
        state = self.state[p]
        if not state:
            group, _ = self.position(p)
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            entries = {}  # tensors of one dtype share an allocation (state_memory.py says why)
            for slot, codec in self.codecs(p, group).items():
                unit = codec.zeros(torch.Size([1]), p.device)  # a zero state is one value repeated
                for suffix, (dtype, shape) in codec.layout(p.shape).items():
                    entries[slot + suffix] = (dtype, shape, unit[suffix].reshape(()))
            shared = {}
            for key, (dtype, shape) in correction_layout(p, group["master_weight_bits"]).items():
                view = self._corrections.view(p, dtype, shape, self._correction_members)
                if view is not None:
                    shared[key] = view.zero_()
                else:
                    entries[key] = (dtype, shape, None)  # zeros
            state.update(pack(entries, p.device))
            state.update(shared)
        return state

    def _correction_members(self, groups: list[dict] | None = None):
        """(parameter, dtype, shape) of every parameter whose group keeps a master-weight correction."""
        for group in self.param_groups if groups is None else groups:
            for q in group["params"]:
                for dtype, shape in correction_layout(q, group["master_weight_bits"]).values():
                    yield q, dtype, shape

    def share_correction(self, p: torch.Tensor, state: dict, groups: list[dict]) -> None:
        """Move a loaded state's correction into ``p``'s shared view (checkpoint loading, at commit,
        under the loaded ``groups``: their master_weight_bits decide the dtypes)."""
        value = state.get(MASTER_CORRECTION)
        if value is not None:
            view = self._corrections.view(p, value.dtype, value.shape, lambda: self._correction_members(groups))
            if view is not None and view is not value:
                state[MASTER_CORRECTION] = view.copy_(value)

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The full-precision master of parameter ``p`` as a new fp32 tensor.

        bf16/fp16 parameters with ``master_weight_bits`` 24/32: the parameter plus its correction
        (exactly the fp32 master for 32 on bf16); otherwise the parameter's value in fp32.
        """
        self.flush_updates()
        self.sync_groups()
        if not isinstance(p, torch.Tensor) or p not in self._position:
            raise ValueError("master_weight(p): p is not a parameter of this optimizer")
        group, _ = self.position(p)
        return master_value(p, self.state.get(p), group["master_weight_bits"])

    # --- observing updates (the memory profiler attributes allocations with this) ----------

    def register_update_hook(self, hook) -> RemovableHandle:
        """Call ``hook()`` around every parameter update this optimizer runs (also those inside
        backward with ``fused=True``, and bucketed launches): it returns a context manager that is
        entered before the update's work and exited after it. Returns a handle whose ``remove()``
        unregisters the hook."""
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    def _observed(self):
        if not self._update_hooks:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for hook in list(self._update_hooks.values()):
            stack.enter_context(hook())
        return stack

    def held_gradients(self) -> list[torch.Tensor]:
        """Gradients the optimizer holds between backward and their update: accumulation buffers
        (``accumulation_steps > 1``) and gradients waiting for a bucketed update (``fused=True``)."""
        if self._release is None:
            return []
        return self._release.buffered_gradients() + self._release.held_gradients()

    def queue_update(self, p, grad, accum=None, launch=_RESOLVE):
        """``update_param``, or a place in a bucket of updates launched together (``buckets.py``):
        the update has run once ``flush_updates()`` returns. ``grad`` must stay unchanged until then."""
        if not self._update_hooks:
            return self._queue_update_unobserved(p, grad, accum, launch)
        with self._observed():
            return self._queue_update_unobserved(p, grad, accum, launch)

    def flush_updates(self) -> None:
        """Run every queued update (``queue_update``) and every update gradient release holds."""
        if not self._update_hooks:
            return self._flush_updates_unobserved()
        with self._observed():
            return self._flush_updates_unobserved()

    def update_param(self, p, grad, accum=None, launch=_RESOLVE):
        """Apply one optimizer update to ``p`` from ``grad`` (+ an accumulated buffer)."""
        if not self._update_hooks:
            return self._update_param_unobserved(p, grad, accum, launch)
        with self._observed():
            return self._update_param_unobserved(p, grad, accum, launch)

    # --- the update ------------------------------------------------------------------------

    def _queue_update_unobserved(
        self, p: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None = None, launch=_RESOLVE
    ):
        """``update_param``, or a place in a bucket of updates launched together (``buckets.py``):
        the update has run once ``flush_updates()`` returns. ``grad`` must stay unchanged until then.
        ``launch``: what ``check_update`` found for this gradient, if it was called."""
        if self._buckets is None or accum is not None or grad.is_sparse:
            self.update_param(p, grad, accum, launch)
            return
        group_index, _ = self._position[p]
        hyper, group_structure, allowed = self._settings(group_index)
        if launch is _RESOLVE:
            launch = self._prepared_launch(p, grad, accum, group_structure) if allowed else None
        if launch is None:
            self.update_param(p, grad, accum)  # through the backend
        elif not self._buckets.add(launch, grad, hyper, group_index):
            # prepared but not bucketable (size, alignment): alone, without update_param's lookups again
            if self._buckets.is_pending(launch):  # a queued update of p runs first
                self.flush_updates()
            launch.launch(grad, accum, hyper)

    def can_hold_update(self, p: torch.Tensor) -> bool:
        """Whether gradient release should hold ``p``'s update for a bucket: its last update went
        through the kernel and its prepared launch can join a bucket. One launched alone anyway
        (size, alignment) gains nothing from waiting, and its held gradient would cost memory."""
        prepared = self._prepared.get(p)
        return prepared is not None and self._buckets is not None and can_join(prepared[0])

    def _settings(self, group_index: int) -> tuple:
        """(hyperparameters, group structure, kernel allowed) of a group for this step's updates.

        Computed once per group and step: neither the group nor the backend changes during one. The
        hyperparameters are validated then, before the group's first update: a scheduler or the user
        may have set them since the last step (a NaN learning rate would make every update NaN)."""
        settings = self._window.get(group_index)
        if settings is None:
            group = self.param_groups[group_index]
            self._check_hyperparameters(group)
            hyper = self._hyper(group)
            settings = self._window[group_index] = hyper, self._group_structure(group, hyper), kernel_allowed()
        return settings

    def check_update(self, p: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None = None):
        """Refuse, before anything is written, an update of ``p`` that cannot be applied as asked:
        invalid group values (``_settings``), a sparse gradient or one of another shape, or state
        that no longer fits the parameter or its group. ``step()`` checks every parameter this way
        before its first update, gradient release each one before it counts the gradient. Beyond the
        gradient's shape, nothing is looked at while ``p``'s prepared launch still holds (it was
        built for this state, parameter and group structure). Returns that launch (None: there is
        none), for ``queue_update``: nothing else changes ``p``'s state before p's own update."""
        check_gradient(p, grad, accum, type(self).__name__)
        group_index, _ = self._position[p]
        _, group_structure, allowed = self._settings(group_index)
        launch = self._prepared_launch(p, grad, accum, group_structure) if allowed else None
        if launch is None:
            self._check_state(p, self.param_groups[group_index])
        return launch

    def _check_state(self, p: torch.Tensor, group: dict) -> None:
        """Refuse state that does not fit ``p`` and its group as they are now: every tensor their
        settings need, of its dtype and shape, and no master correction they do not keep. The
        state was made for them as they were: ``p.data`` of another shape or dtype, or a group's
        ``state_bits``, ``min_compress_numel``, ``master_weight_bits`` (or SGD's momentum) set
        since, would read it wrongly."""
        state = self.state.get(p)
        if not state:
            return  # created from the group's settings at the first update
        needed = {
            slot + suffix: layout
            for slot, codec in self.codecs(p, group).items()
            for suffix, layout in codec.layout(p.shape).items()
        }
        needed.update(correction_layout(p, group["master_weight_bits"]))
        problems = [_state_problem(key, state.get(key), *layout) for key, layout in needed.items()]
        if MASTER_CORRECTION in state and MASTER_CORRECTION not in needed:
            bits = group["master_weight_bits"]
            problems.append(f"holds a master_correction that master_weight_bits={bits} does not keep")
        problem = next((problem for problem in problems if problem is not None), None)
        if problem is not None:
            raise ValueError(
                f"the optimizer state of a {p.dtype} parameter of shape {tuple(p.shape)} {problem}: it was made for "
                "the parameter and its group as they were. The parameter's shape or dtype, or its group's "
                "state_bits, min_compress_numel, master_weight_bits or momentum, changed since. Change the group's "
                "settings through state_dict() / load_state_dict(), which converts the state (edit the saved "
                "group); for a parameter of another shape or dtype, build a new optimizer"
            )

    def _new_window(self) -> None:
        """Group settings may change from here on (a step ended, groups or state were replaced)."""
        self._window.clear()

    def _flush_updates_unobserved(self) -> None:
        """Run every queued update (``queue_update``) and every update gradient release holds."""
        if self._release is not None and self._release.holds_updates():
            self._release.drain(self)  # queues them, then flushes
        if self._buckets is not None and self._buckets.has_pending():
            with torch.no_grad():
                self._buckets.flush()

    def _update_param_unobserved(
        self, p: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None = None, launch=_RESOLVE
    ):
        """Apply one optimizer update to ``p`` from ``grad`` (+ an accumulated buffer); ``launch`` as
        ``queue_update``'s (given: ``check_update`` has checked this update already)."""
        checked = launch is not _RESOLVE
        if not checked:
            check_gradient(p, grad, accum, type(self).__name__)
        prepared = self._prepared.get(p)
        if prepared is not None and self._buckets is not None and self._buckets.is_pending(prepared[0]):
            self.flush_updates()  # p's queued update runs first
        group, index = self.position(p)
        hyper = self._hyper(group)  # as the group is now: step() and release validated it (_settings)
        if not checked:
            allowed = kernel_allowed()
            launch = self._prepared_launch(p, grad, accum, self._group_structure(group, hyper)) if allowed else None
        if launch is not None:
            launch.launch(grad, accum, hyper)
            return
        if not checked:
            self._check_state(p, group)  # before anything is written
        # A first update may run in a hook on a side stream: state (and the correction buffer that
        # all parameters share) is initialised on the default stream, which that stream then waits for
        with on_default_stream(p):
            state = self.ensure_state(p)
            self._scratch(p)
        codecs = self.codecs(p, group)
        job = ParamUpdate(
            param=p,
            grad=grad,
            accum=accum,
            state=state,
            codecs=codecs,
            hyper=hyper,
            master_weight_bits=group["master_weight_bits"],
            seed=self.seed,
            index=index,
            skipped=self.num_skipped_updates,
        )
        launch = run_update(self.algorithm, type(self).math, job, self._scratch)
        if launch is not None:
            replaced = self._prepared.get(p)
            structure = p.dtype, p.shape, p.device, p.data_ptr(), self._group_structure(group, hyper)
            self._prepared[p] = launch, structure, tuple(state), tuple(map(id, state.values()))
        else:
            replaced = self._prepared.pop(p, None)
        if replaced is not None and self._buckets is not None:
            self._buckets.forget()  # built buckets hold the replaced launch

    def _prepared_launch(self, p, grad, accum, group_structure: tuple):
        """``p``'s prepared kernel launch from an earlier step, while nothing it depends on changed:
        the same state tensors (same keys, same objects), the parameter's dtype, shape, device and
        storage (a bucket's table points into it: ``p.data = ...`` moves it), and its group's
        ``group_structure``. The host work per update is then the scalars and two launches (it runs
        in backward hooks). None when the update must go through the backend."""
        prepared = self._prepared.get(p)
        if prepared is None or not gradient_fits_prepared(p, grad, accum):
            return None
        launch, structure, keys, ids = prepared
        state = self.state.get(p)
        if (
            state is not None
            and tuple(map(id, state.values())) == ids
            and tuple(state) == keys
            and structure == (p.dtype, p.shape, p.device, p.data_ptr(), group_structure)
        ):
            return launch
        return None

    def _group_structure(self, group: dict, hyper: dict) -> tuple:
        """What a prepared launch was built for from its group and the optimizer: formats, flags, seed."""
        flags = tuple(v for v in hyper.values() if isinstance(v, bool))
        formats = (group["state_bits"], group["min_compress_numel"], group["master_weight_bits"], self._slots(group))
        return formats, flags, self.seed

    def _scratch(self, p: torch.Tensor) -> torch.Tensor:
        """The kernel's per-parameter scratch words (flags and per-step scalars), kept between updates."""
        scratch = self._kernel_scratch.get(p)
        if scratch is None:
            scratch = self._kernel_scratch[p] = new_scratch(p.device)
        return scratch

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that still holds a gradient; run ``closure`` first if given.

        With ``fused=True`` most parameters were already updated during backward; this updates
        the rest (the unfused fallback) and starts a new accumulation window.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        releasing = self._release is not None and self._release.attached
        self.flush_updates()  # left by a backward that did not finish
        self.sync_groups()
        self._new_window()
        checked = []  # every update is checked before the first one runs
        for group in self.param_groups:
            for p in group["params"]:
                grad, accum = p.grad, self._release.buffer(p) if self._release is not None else None
                if grad is None and accum is None:
                    continue
                checked.append((p, self.check_update(p, accum) if grad is None else self.check_update(p, grad, accum)))
        for p, launch in checked:
            accum = self._release.take_buffer(p) if self._release is not None else None
            grad = p.grad
            if grad is None:
                grad, accum = accum, None
            self.queue_update(p, grad, accum, launch)
            if releasing:
                p.grad = None
        self.flush_updates()
        self._new_window()
        if self._release is not None:
            self._release.new_window()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch; also drops gradients the optimizer holds for accumulation."""
        super().zero_grad(set_to_none=set_to_none)
        self._new_window()
        if self._release is not None:
            self._release.drop_buffers()

    def remove_hooks(self) -> None:
        """Detach gradient release from the parameters; ``step()`` then updates every parameter."""
        self.flush_updates()
        if self._release is not None:
            self._release.remove()

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """As torch, plus a ``"fusedopt"`` entry (format, algorithm, seed, skipped-update counter)."""
        self.flush_updates()
        if self._release is not None and self._release.holds_gradients():
            raise RuntimeError(
                "state_dict() during an unfinished gradient accumulation would lose the accumulated "
                "gradients; call step() first"
            )
        return checkpoint.state_dict(self, super().state_dict())

    def torch_state_dict(self) -> dict:
        """This state as the matching ``torch.optim`` optimizer saves it (moments decoded to fp32)."""
        self.flush_updates()
        self.sync_groups()
        return checkpoint.torch_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a fusedopt or torch.optim checkpoint; state keeps its saved dtypes (see checkpoint.py)."""
        self.flush_updates()
        self.sync_groups()
        checkpoint.load_state_dict(self, state_dict)
        self._prepared.clear()  # they hold the replaced state tensors
        self._new_window()
        if self._buckets is not None:
            self._buckets.forget()


def _state_problem(key: str, value: torch.Tensor | None, dtype: torch.dtype, shape: torch.Size) -> str | None:
    """What is wrong with the state entry ``key`` against the (dtype, shape) needed (None: nothing)."""
    if value is None:
        return f"has no '{key}'"
    if value.dtype != dtype or value.shape != shape:
        return f"holds '{key}' as {value.dtype} {tuple(value.shape)}, not {dtype} {tuple(shape)}"
    return None


def check_param(p: torch.Tensor) -> None:
    """Refuse parameters fusedopt cannot update, naming the problem."""
    if p.is_complex():
        raise ValueError(f"complex parameters are not supported (got a {p.dtype} parameter of shape {tuple(p.shape)})")
    if p.dtype not in SUPPORTED_PARAM_DTYPES:
        raise ValueError(
            f"parameters of dtype {p.dtype} are not supported (shape {tuple(p.shape)}); "
            "fusedopt optimizes float32, bfloat16 and float16 parameters"
        )
    if p.is_sparse:
        raise ValueError("sparse parameters are not supported")
