"""FusedOptimizer: the shared base of fusedopt's optimizers over ``torch.optim.Optimizer``.

It owns what every algorithm shares: parameter groups and the validation of fusedopt's options,
``step()``, and the parts it delegates to: each parameter's position and state (``state_store.py``,
state created through the codecs, ``codecs/``), unscaling and clipping of gradients
(``gradients.py``), which path runs an update and what the kernel path keeps between updates
(``dispatch.py``), gradient release (``fused=True``, ``release.py``) and checkpoints
(``checkpoint.py``). Each algorithm is one file (``adamw.py``, ``sgd.py``, ``lion.py``,
``adafactor.py``) with the facts declared below.
"""

from __future__ import annotations

import math
import sys
import warnings

import torch
import torch._dynamo  # noqa: F401  (see below)
from torch.utils.hooks import RemovableHandle

from . import checkpoint, release_notices
from .clipping import DEFAULT_CLIP_METHOD, check_clip_method
from .codecs import SUPPORTED_STATE_BITS, MomentCodec, codec_named, registered_formats, removed_format_error
from .dispatch import CheckedUpdate, UpdateDispatcher
from .gradients import GradientPipeline, check_scaler_step
from .loss_scaling import check_grad_scaler
from .master import check_master_weight_bits
from .reference import UpdateMath
from .release import GradientRelease
from .rng import DEFAULT_SEEDS, valid_seed
from .sharding import check_sharded_param, is_sharded
from .state_store import StateStore, slot_codecs

# torch.optim's add_param_group imports torch._dynamo at its first call, and that import leaves a reference
# cycle through the frames that called it: the first optimizer of a process would live until the cycle
# collector runs, its release hooks still updating the model. Imported above, the cycle holds no optimizer.

# Options that apply to the whole optimizer; a parameter group may not set them.
OPTIMIZER_WIDE_OPTIONS = ("fused", "accumulation_steps", "seed", "max_grad_norm", "release_clipping", "grad_scaler")
SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PROBE_SHAPE = torch.Size([64, 64])  # a compressible shape, to ask a state format about its codecs


def check_refused_options(**options) -> None:
    """torch.optim options fusedopt does not implement: their off values are accepted, others refused."""
    for name, value in options.items():
        if value not in (None, False):
            raise ValueError(f"{name}={value!r} is not supported by fusedopt (leave it at its default)")


def check_refused_group_keys(group: dict) -> None:
    """A group's copy of an option ``check_refused_options`` refuses (a group may set any key), and torch.optim.Adam's
    coupled L2 decay (``decoupled_weight_decay=False``): refused, where they would silently be ignored."""
    for key in ("amsgrad", "foreach", "capturable", "differentiable"):
        if group.get(key) not in (None, False):
            raise ValueError(f"a parameter group sets {key}={group[key]!r}, which fusedopt does not support")
    if group.get("decoupled_weight_decay") is False and group.get("weight_decay", 0) != 0:
        raise ValueError(
            "a parameter group sets decoupled_weight_decay=False (torch.optim.Adam's L2 added to the gradient); "
            "fusedopt decays the weights directly"
        )


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


def check_optimizer_options(fused, accumulation_steps, seed, max_grad_norm, release_clipping) -> None:
    """Validate the optimizer-wide options (``max_grad_norm``: None when not given)."""
    if not isinstance(fused, bool):
        raise ValueError(f"Invalid fused: {fused!r} (expected True or False)")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"Invalid accumulation_steps: {accumulation_steps!r} (expected an integer >= 1)")
    if seed is not None and not valid_seed(seed):
        raise ValueError(f"Invalid seed: {seed!r} (expected a non-negative integer, or None)")
    if max_grad_norm is not None:
        check_number("max_grad_norm", max_grad_norm)
        if max_grad_norm <= 0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (expected a positive number, or None)")
    check_clip_method(release_clipping)


def check_group_options(optimizer, group: dict) -> None:
    """Validate the options every fusedopt group has (``FusedOptimizer.check_group``)."""
    check_refused_group_keys(group)
    bits = group["state_bits"]
    if bits not in SUPPORTED_STATE_BITS or isinstance(bits, bool):
        raise ValueError(f"Invalid state_bits: {bits!r} (expected 32, 16, 8 or 4)")
    numel = group["min_compress_numel"]
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"Invalid min_compress_numel: {numel!r} (expected an integer >= 0)")
    state_format = group.setdefault("state_format", None)  # groups saved before it existed lack it
    if state_format is not None and state_format not in registered_formats():
        removed = removed_format_error(state_format, f"Invalid state_format: {state_format!r}")
        if removed is not None:
            raise removed
        raise ValueError(
            f"Invalid state_format: {state_format!r} (expected None or one of {', '.join(registered_formats())})"
        )
    if state_format is not None:
        slots = optimizer.state_slots(group)
        for slot in slots:
            codec = codec_named(state_format, slot not in optimizer.nonnegative_slots, _PROBE_SHAPE)
            if codec.frame and optimizer.frames.get(slot) not in slots:
                raise ValueError(
                    f"Invalid state_format: {state_format!r} stores {slot!r} in units of a second moment, "
                    f"which fusedopt.{type(optimizer).__name__} does not keep"
                )
    check_master_weight_bits(group["master_weight_bits"])
    if not isinstance(group["maximize"], bool):
        raise ValueError(f"Invalid maximize: {group['maximize']!r} (expected True or False)")


def check_shardable(optimizer, params) -> None:
    """Refuse an algorithm that cannot update a shard on its own (``shardable``)."""
    if not optimizer.shardable and any(is_sharded(p) for p in params):
        raise ValueError(
            f"fusedopt.{type(optimizer).__name__} does not support sharded (FSDP2) parameters yet: its update "
            "needs statistics of the whole tensor (rows, columns, norms), and a rank holds only its shard"
        )


class FusedOptimizer(torch.optim.Optimizer):
    """Base class. An algorithm subclasses it in one file, declaring the facts below and implementing
    ``check_hyperparameters`` and ``hyper`` (and ``kernel_scalars`` where it has a kernel branch)."""

    algorithm: str = ""  # its name in checkpoints
    math: UpdateMath  # the fp32 math of one update: the CPU path and the kernel's oracle
    slots: tuple[str, ...] = ()  # the moments it may keep (``state_slots`` says which a group keeps)
    nonnegative_slots: tuple[str, ...] = ()  # moments never negative (stored unsigned)
    # slot -> the second moment whose square root a framed state format stores it in units of
    # (``MomentCodec.frame``); formats with a framed codec are refused for slots not listed
    frames: dict[str, str] = {}
    kernel: str = "update"  # the kernels module that runs it (fusedopt.kernels.<kernel>)
    kernel_id: int | None = None  # its branch in that module's kernel (None: the reference runs it)
    bias_corrections: bool = False  # the kernel's check pass computes Adam's bias corrections
    torch_group_keys: dict | None = None  # the torch.optim counterpart's extra group keys (None: none)
    torch_saves_step: bool = True  # whether the torch.optim counterpart's state has a step count
    torch_lacks: tuple[str, ...] = ()  # options the counterpart lacks: no torch_state_dict() while one is set
    shardable: bool = True  # whether it can update a shard of a parameter (FSDP2) on its own
    # torch.amp.GradScaler.step(opt) hands step() its scale as ``opt.grad_scale`` (loss_scaling.py)
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        fused: bool,
        accumulation_steps: int,
        seed: int | None,
        max_grad_norm=release_notices.NOT_GIVEN,
        release_clipping: str = DEFAULT_CLIP_METHOD,
        grad_scaler=None,
    ):
        unsaid = max_grad_norm is release_notices.NOT_GIVEN  # no clipping; under release, warned once below
        if unsaid:
            max_grad_norm = None
        check_optimizer_options(fused, accumulation_steps, seed, max_grad_norm, release_clipping)
        self.fused = fused
        self.accumulation_steps = accumulation_steps
        self._seed, self._seed_group = seed, None  # None: chosen below, from the parameters (``seed``)
        self._grad_multiplier: torch.Tensor | None = None
        if fused:
            check_release_normalisation(type(self).__name__)
        self._max_grad_norm = max_grad_norm
        self.release_clipping = release_clipping
        self._grad_scaler = None
        self._store = StateStore(self)
        self.gradient_pipeline = GradientPipeline(self, self._store)
        self._corrections = self._store.corrections  # (the tests replace its view to compare unshared ones)
        self._release: GradientRelease | None = None
        self._dispatch = UpdateDispatcher(self, self._store)
        self.bucket_budget = self._dispatch.bucket_budget  # bytes of gradients release may hold (0: none)
        params = _materialise(params)
        super().__init__(params, defaults)
        if seed is None:
            single = sum(len(g["params"]) for g in self.param_groups) == 1
            self._seed, self._seed_group = DEFAULT_SEEDS.assign(self) if single else (0, None)
        first = next(p for g in self.param_groups for p in g["params"])  # torch refused a list of none
        self.num_skipped_updates = torch.zeros((), dtype=torch.int64, device=first.device)
        self.num_interrupted_steps = 0  # fused=True: steps whose backward pass stopped early (saved)
        self.grad_scaler = grad_scaler
        if fused:
            self._release = GradientRelease(self)
            self._release.attach(p for g in self.param_groups for p in g["params"])
            if unsaid:
                release_notices.warn_release_without_clipping()

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
            if self._release is not None and self._release.attached:  # not after remove_hooks()
                self._release.attach(group["params"])  # checks every parameter before it hooks one
            check_shardable(self, group["params"])
        except Exception:
            self.param_groups.pop()
            raise
        self._dispatch.new_window()
        self._store.add(len(self.param_groups) - 1, group["params"])

    def sync_groups(self) -> None:
        """Follow edits made to ``param_groups`` directly, as torch.optim does: groups reordered or
        removed, parameters removed from a group. Each parameter's group is found again (its index
        stays); one no longer in any group is forgotten and its release hook removed, so nothing
        updates it. A parameter put in place of another one (the same group and position, the same
        global shape, the other one in no group any more) takes it over: its index (the stream of
        stochastic rounding), its state if any, its release hook. That is how accelerate's
        ``prepare()`` hands an optimizer built on the unsharded model the FSDP2-sharded parameters.
        It is checked as the constructor checks a parameter; state moves only to a parameter laid out
        as the old one (same dtype, device, local shard), else the replacement is refused. Any other
        parameter that never went through the constructor or ``add_param_group`` is refused: fusedopt
        has not validated it and has no index for it. A refusal changes nothing. Parameters frozen
        when they were hooked and trainable now get their release hooks."""
        if self._release is not None:
            self._release.attach_unfrozen()
        plan = self._store.plan(self.param_groups)
        if plan is None:
            return
        new = [r.new for r in plan.replacements]
        if new:
            self._check_replacements(new)
        moved = any(r.old is not None and self.state.get(r.old) for r in plan.replacements)
        dropped, gone = self._store.commit(plan)
        if self._release is not None:
            if dropped or gone:
                self._release.detach(dropped, gone)  # first: a freed parameter's id may be a new one's
            if new and self._release.attached:
                self._release.attach(new)
        if moved:
            self._dispatch.forget()  # prepared launches of the old parameters hold their storage
        if new:
            self._follow_first_device()
        self._dispatch.new_window()

    def _follow_first_device(self) -> None:
        """Keep the skipped-update counter on the first parameter's device, as the constructor put it (the
        kernels add to it there) after replacements moved the parameters: accelerate's FSDP2 puts the
        shards of a model built on the CPU on the GPU."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is not None and first.device != self.num_skipped_updates.device:
            self.num_skipped_updates = self.num_skipped_updates.to(first.device)
            self._dispatch.forget()  # prepared launches add to the counter where it was

    def _check_replacements(self, params: list[torch.Tensor]) -> None:
        """Check parameters put in place of others as the constructor checks parameters (``sync_groups``)."""
        for p in params:
            check_param(p)
        check_shardable(self, params)
        if self._release is not None and self._release.attached:
            self._release.check(params)

    def check_step_group(self, group: dict) -> None:
        """What a step checks of a group before its first update: the user or a scheduler may have edited it."""
        check_refused_group_keys(group)
        self.check_hyperparameters(group)

    def check_group(self, group: dict) -> None:
        """Validate every option of a (complete) group: the shared fusedopt ones, then the algorithm's."""
        check_group_options(self, group)
        self.check_hyperparameters(group)

    def check_hyperparameters(self, group: dict) -> None:
        """Validate the algorithm's hyperparameters in ``group`` (torch's error messages)."""
        raise NotImplementedError

    def state_slots(self, group: dict) -> tuple[str, ...]:
        """Names of the moment tensors this algorithm keeps under ``group``'s settings."""
        return self.slots

    def hyper(self, group: dict) -> dict:
        """The keyword arguments of ``math`` (plus ``maximize``) from a group."""
        raise NotImplementedError

    @staticmethod
    def ema_decays(hyper: dict) -> dict[str, float]:
        """Slot -> the factor ``math`` multiplies the old moment by (``m = decay * m + increment``),
        for state formats that keep the decay exact (``MomentCodec.encode_decayed``). Default: none."""
        return {}

    @staticmethod
    def kernel_scalars(hyper: dict) -> dict:
        """The fused kernel's runtime scalars from ``hyper`` (``kernels/update.py`` ``UPDATE_SCALARS``)."""
        raise NotImplementedError

    # --- state -----------------------------------------------------------------------------

    def codecs(self, p: torch.Tensor, group: dict) -> dict[str, MomentCodec]:
        """Slot name -> codec for parameter ``p`` under ``group``."""
        return slot_codecs(p, group, self.state_slots(group), self.nonnegative_slots)

    def position(self, p: torch.Tensor) -> tuple[dict, int]:
        """The group holding ``p`` and ``p``'s index in the optimizer (a hash input)."""
        return self._store.position(p)

    def param_index(self, p: torch.Tensor) -> int:
        """``p``'s index in the optimizer: a hash input, it never changes or repeats."""
        return self._store.param_index(p)

    def element_offset(self, p: torch.Tensor) -> int:
        """The global index of the first element of ``p``'s local shard (0 unless ``p`` is sharded)."""
        return self._store.element_offset(p)

    def ensure_state(self, p: torch.Tensor) -> dict:
        """The state of ``p``, created (step 0, zero moments) on first use (of its local shard's
        shape for a sharded parameter)."""
        return self._store.ensure(p)

    def share_correction(self, p: torch.Tensor, state: dict, groups: list[dict]) -> None:
        """Move a loaded state's correction into ``p``'s shared view (checkpoint loading, at commit)."""
        self._store.share_correction(p, state, groups)

    def restore_indices(self, indices: dict[int, int]) -> None:
        """Give parameters (by id) the indices a checkpoint saved (checkpoint loading, at commit)."""
        self._store.restore_indices(indices)

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The full-precision master of parameter ``p`` as a new fp32 tensor.

        bf16/fp16 parameters with ``master_weight_bits`` 24/32: the parameter plus its correction
        (exactly the fp32 master for 32 on bf16); otherwise the parameter's value in fp32. A DTensor
        for a sharded parameter, laid out as it.
        """
        self.close_failed_backward()
        self.flush_updates()
        self.sync_groups()
        return self._store.master_weight(p)

    # --- observing updates (the memory profiler attributes allocations with this) ----------

    def register_update_hook(self, hook) -> RemovableHandle:
        """Call ``hook()`` around every piece of update work this optimizer runs (also inside backward
        with ``fused=True``, and bucketed launches): it returns a context manager entered before the
        work and exited after it (contexts may nest). Returns a handle whose ``remove()`` unregisters
        the hook."""
        return self._dispatch.register_observer(hook)

    def held_gradients(self) -> list[torch.Tensor]:
        """Gradients the optimizer holds between backward and their update: accumulation buffers
        (``accumulation_steps > 1``) and gradients waiting for a bucketed update (``fused=True``)."""
        if self._release is None:
            return []
        return self._release.buffered_gradients() + self._release.held_gradients()

    def accumulated_gradient(self, p: torch.Tensor) -> torch.Tensor | None:
        """With ``fused=True``: the gradient of ``p`` the optimizer accumulates for this window (bf16/fp16
        micro-batches), which ``step()`` or the window's last backward updates from; None if none."""
        return None if self._release is None else self._release.buffer(p)

    def released_since_step(self) -> bool:
        """With ``fused=True``: whether a release hook took a gradient since the last ``step()``."""
        return self._release is not None and self._release.hooks_ran()

    # --- clipping and loss scaling ----------------------------------------------------------

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global L2 norm of the gradients of the last update, before clipping (a device tensor;
        None without ``max_grad_norm``). With ``fused=True`` it is the norm of the gradients released
        so far in this backward, exact once backward has finished (and kept after ``step()``)."""
        return self.gradient_pipeline.norm(self._releasing())

    @property
    def grad_multiplier(self) -> torch.Tensor | None:
        """A factor every gradient is multiplied by before unscaling, clipping and its update, in
        place (None: none; settable with a number or a 0-d tensor, kept as an fp32 tensor, not saved).
        It is for losses normalised after backward: torchtune backpropagates ``loss * num_tokens`` and
        multiplies the gradients by ``1 / num_tokens`` afterwards, which finds nothing once release
        freed them; ``opt.grad_multiplier = 1 / num_tokens`` set before the backward that updates does
        the same multiplication on every gradient, in both modes (docs/integrations.md, torchtune)."""
        return self._grad_multiplier

    @grad_multiplier.setter
    def grad_multiplier(self, value) -> None:
        self._grad_multiplier = check_grad_multiplier(value)

    @property
    def seed(self) -> int:
        """The stochastic-rounding seed (saved in checkpoints; settable). Built without one: 0 over
        several parameters; over a single parameter, a default seed distinct from those of the other
        one-parameter optimizers built with it (``fusedopt.rng.DefaultSeeds``)."""
        if self._seed_group is not None:  # its first use: optimizers built from now on form a new group
            DEFAULT_SEEDS.used(self._seed_group)
            self._seed_group = None
        return self._seed

    @seed.setter
    def seed(self, seed: int) -> None:
        self._seed, self._seed_group = seed, None

    @property
    def max_grad_norm(self) -> float | None:
        """The global-norm clipping threshold (None: no clipping). Settable between steps: clipping
        under release then starts (or stops) with its own history."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        if value is not None:
            check_number("max_grad_norm", value)
            if value <= 0:
                raise ValueError(f"Invalid max_grad_norm: {value} (expected a positive number, or None)")
        self._max_grad_norm = value
        self.gradient_pipeline.follow_max_grad_norm()

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """With ``fused=True``: the GradScaler whose scale the released gradients carry (settable)."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler) -> None:
        check_grad_scaler(scaler)
        self._grad_scaler = scaler

    def _releasing(self) -> bool:
        return self._release is not None and self._release.attached

    def prepare_released_gradients(self, batch: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> list:
        """Unscale (``grad_scaler``, in place) and clip (``max_grad_norm``) gradients that gradient
        release is about to update from: ``batch`` holds each parameter with its gradient (and
        accumulated buffer; local tensors: a sharded parameter's shard), in the order released.
        Returns each one's clipping coefficient for its update (``grad_scale``; None: none)."""
        return self.gradient_pipeline.prepare(batch, releasing=True)

    # --- the update ------------------------------------------------------------------------

    def check_update(self, p: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None = None) -> CheckedUpdate:
        """Refuse, before anything is written, an update of ``p`` that cannot be applied as asked:
        invalid group values, a sparse gradient or one of another shape, or state that no longer fits
        the parameter or its group. ``step()`` checks every parameter this way before its first
        update, gradient release each one before it counts the gradient. Beyond the gradient's shape,
        nothing is looked at while ``p``'s prepared launch still holds (it was built for this state,
        parameter and group structure)."""
        return self._dispatch.check(p, grad, accum)

    def update_param(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        accum: torch.Tensor | None = None,
        checked: CheckedUpdate | None = None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """Apply one optimizer update to ``p`` from ``grad`` (+ an accumulated buffer) now; ``checked``:
        what ``check_update`` returned for it (None: it is checked here, outside any step, against the
        group and ``FUSEDOPT_BACKEND`` as they are now); ``grad_scale``: a clipping coefficient (fp32
        0-d) the gradients are multiplied by."""
        if checked is None:
            self._dispatch.new_window()
            checked = self.check_update(p, grad, accum)
        self._dispatch.update(p, grad, accum, checked, grad_scale)

    def queue_update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        accum: torch.Tensor | None,
        checked: CheckedUpdate,
        grad_scale: torch.Tensor | None = None,
    ):
        """``update_param``, or a place in a bucket of updates launched together: the update has run
        once ``flush_updates()`` returns. ``grad`` must stay unchanged until then."""
        self._dispatch.queue(p, grad, accum, checked, grad_scale)

    def flush_updates(self) -> None:
        """Run every queued update and every update gradient release holds."""
        if self._release is not None and self._release.holds_updates():
            self._release.drain(self)  # queues them, then flushes
        self._dispatch.flush()

    def drop_queued_updates(self) -> None:
        """Forget queued updates unlaunched (``GradientRelease.abandon_window``)."""
        self._dispatch.drop_queued()

    def close_failed_backward(self) -> bool:
        """With ``fused=True``: close the window of a backward pass that stopped early, if one did (its
        applied updates stay, the rest of the step is skipped, its gradients dropped; see
        ``GradientRelease.close_interrupted``). Every public method calls it first; returns whether
        it closed one."""
        return self._release is not None and self._release.close_interrupted(self)

    def can_hold_update(self, p: torch.Tensor) -> bool:
        """Whether gradient release should hold ``p``'s update for a bucket (``dispatch.py``). Not a sharded
        parameter's where clipping or unscaling sums over the ranks: buckets fill by the local shard's
        size, so the ranks would reach those all-reduces at different points of FSDP2's collectives."""
        if (self.max_grad_norm is not None or self.grad_scaler is not None) and is_sharded(p):
            return False
        return self._dispatch.can_hold(p)

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
        releasing = self._releasing()
        self.close_failed_backward()
        self.flush_updates()  # held by a hook called outside backward
        self.sync_groups()
        self._dispatch.new_window()
        checked = []  # every update is checked before the first one runs
        for group in self.param_groups:
            for p in group["params"]:
                grad, accum = p.grad, self._release.buffer(p) if self._release is not None else None
                if grad is None and accum is None:
                    continue
                checked.append((p, self.check_update(p, accum) if grad is None else self.check_update(p, grad, accum)))
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step for this call only
        hooks_ran = releasing and self._release.hooks_ran()
        try:
            check_scaler_step(self.grad_scaler, grad_scale, hasattr(self, "grad_scale"), bool(checked), hooks_ran)
        except RuntimeError:
            self._release.abandon_window(self)  # a refused step must not leave its window open
            self._dispatch.new_window()
            raise
        updates = []
        for p, _ in checked:
            accum = self._release.take_buffer(p) if self._release is not None else None
            grad = p.grad
            if grad is None:
                grad, accum = accum, None
            updates.append((p, grad, accum))
        batch = [(p, [g for g in (grad, accum) if g is not None]) for p, grad, accum in updates]
        scales = self.gradient_pipeline.prepare(
            batch, releasing=releasing, in_step=True, grad_scale=grad_scale, scaler_stepped=hasattr(self, "grad_scale")
        )
        for (p, grad, accum), (_, launch), scale in zip(updates, checked, scales):
            self._dispatch.queue(p, grad, accum, launch, scale)
            if releasing:
                p.grad = None
        self.flush_updates()
        self._dispatch.new_window()
        if self._release is not None:
            self._release.new_window()
        self.gradient_pipeline.new_window()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch; also drops gradients the optimizer holds for accumulation."""
        self.close_failed_backward()
        super().zero_grad(set_to_none=set_to_none)
        self._dispatch.new_window()
        if self._release is not None:
            self._release.zero_grad(self)

    def remove_hooks(self) -> None:
        """Detach gradient release from the parameters; ``step()`` then updates every parameter."""
        self.close_failed_backward()
        self.flush_updates()
        if self._release is not None:
            self._release.remove()

    # --- checkpoints -----------------------------------------------------------------------

    def __reduce_ex__(self, protocol):
        # copy.copy, copy.deepcopy, pickle and torch.save(opt) all come here. torch.optim's
        # pickled state leaves out fusedopt's parts (the copy's step() would fail), and a copy could
        # not be tied to the model: a deep copy updates copies of the parameters, and only one
        # optimizer's release hooks may hold a parameter.
        name = type(self).__name__
        raise TypeError(
            f"a fusedopt.{name} optimizer cannot be copied or pickled (copy.copy, copy.deepcopy, pickle, "
            "torch.save(optimizer)): it is tied to its model's parameters and, with fused=True, their gradient "
            "hooks. Save optimizer.state_dict() (and model.state_dict()) instead, e.g. torch.save("
            "optimizer.state_dict(), path), and load it into a new optimizer built on the model with "
            "load_state_dict()"
        )

    def state_dict(self) -> dict:
        """As torch, plus a ``"fusedopt"`` entry (format, algorithm, seed, skipped-update counter)."""
        self.close_failed_backward()
        self.flush_updates()
        if self._release is not None and self._release.holds_gradients():
            raise RuntimeError(
                "state_dict() during an unfinished gradient accumulation would lose the accumulated "
                "gradients; call step() first"
            )
        for group in self.param_groups:  # each state is saved under its group's formats: it must be theirs
            for p in group["params"]:
                try:
                    self._store.check(p, group)
                except ValueError as e:
                    raise ValueError(f"state_dict(): {e}. Set the group's option back before saving") from e
        return checkpoint.state_dict(self, super().state_dict())

    def torch_state_dict(self) -> dict:
        """This state as the matching ``torch.optim`` optimizer saves it (moments decoded to fp32)."""
        self.close_failed_backward()
        self.flush_updates()
        self.sync_groups()
        return checkpoint.torch_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a fusedopt or torch.optim checkpoint; state keeps its saved dtypes (see checkpoint.py)."""
        self.close_failed_backward()
        self.flush_updates()
        self.sync_groups()
        hooks = (self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks)
        checkpoint.load_state_dict(self, state_dict, *hooks)
        self._dispatch.forget()  # prepared launches hold the replaced state tensors
        self._dispatch.new_window()


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
    check_sharded_param(p)


def check_grad_multiplier(value) -> torch.Tensor | None:
    """``grad_multiplier`` as the optimizer keeps it: None, or a 0-d fp32 tensor (on the value's device:
    a device tensor is not read, so its value is not checked)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"Invalid grad_multiplier: a {value.dtype} tensor of shape {tuple(value.shape)} "
                "(expected one real number)"
            )
        return value.detach().reshape(()).to(torch.float32)
    check_number("grad_multiplier", value)
    if value <= 0:
        raise ValueError(f"Invalid grad_multiplier: {value} (expected a positive number, or None)")
    return torch.tensor(float(value), dtype=torch.float32)


# A recipe class that tells a releasing optimizer how its loss is normalised sets this attribute (True).
NORMALISES_RELEASED_GRADS = "fusedopt_normalises_released_grads"


def check_release_normalisation(name: str) -> None:
    """Refuse a ``fused=True`` optimizer that torchtune's ``config.instantiate`` builds for a recipe not
    marked ``fusedopt_normalises_released_grads = True``. torchtune's recipes backpropagate the loss
    summed over tokens and normalise the gradients after backward (``training.scale_grads``), which finds
    none under release: every update and the clipping would use gradients ``num_tokens`` times too
    large, without an error. Found from the caller's frames (torchtune is never imported here)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    modules = [f.f_globals.get("__name__") or "" for f in frames]
    if not any(m == "torchtune" or m.startswith("torchtune.") for m in modules):
        return
    for f in frames:
        owner = f.f_locals.get("self") if "self" in f.f_code.co_varnames else None
        if owner is not None and getattr(type(owner), NORMALISES_RELEASED_GRADS, False):
            return
    raise ValueError(
        f"fusedopt.{name}(fused=True) built by torchtune's config for a recipe that normalises gradients "
        "after backward: torchtune's recipes backpropagate loss * num_tokens and multiply the gradients by "
        "1 / num_tokens before optimizer.step() (training.scale_grads), but gradient release has already "
        "updated every parameter inside backward and freed its gradient, so the updates and max_grad_norm "
        "would use gradients num_tokens times too large. Run fusedopt's recipe "
        "(fusedopt.integrations.torchtune.FullFinetuneRecipeSingleDevice: `tune run "
        "fusedopt/integrations/torchtune.py --config ...`), which sets the optimizer's grad_multiplier "
        "before backward, or use fused=False. A recipe of your own that normalises the loss before "
        f"backward, or sets grad_multiplier, says so with the class attribute {NORMALISES_RELEASED_GRADS} = True"
    )


def _materialise(params):
    """``params`` as a list; an exhausted generator (``model.parameters()`` given to an earlier
    optimizer) is named, where torch would only say the list is empty."""
    if isinstance(params, torch.Tensor):
        return params  # torch's own error for a bare tensor
    is_iterator = iter(params) is params
    params = list(params)
    if not params and is_iterator:
        raise ValueError(
            "optimizer got an empty parameter list: the iterator or generator given (e.g. model.parameters()) "
            "yielded nothing; a generator can be iterated only once, so one already used by another optimizer "
            "is empty. Pass list(model.parameters()) to share parameters between optimizers"
        )
    return params
