"""Dispatch: which path runs an update (the fused Triton kernel or the PyTorch reference), and
everything the kernel path keeps between updates.

One ``UpdateDispatcher`` per optimizer owns the decision and its caches: each group's settings for
the current step, each parameter's prepared kernel launch and scratch words, and the queue of
bucketed updates. The optimizer hands it checked updates and never touches the kernel layer.

``FUSEDOPT_BACKEND`` (read once per step and group, and at every update outside a step):

* ``auto`` (default): CUDA tensors the kernel supports run the kernel; everything else (CPU
  tensors, non-contiguous parameters, an algorithm or state format without a kernel branch) runs
  the reference.
* ``reference``: always the PyTorch reference.
* ``triton``: always the kernel; an unsupported case is an error naming the reason. On CPU tensors
  this needs ``TRITON_INTERPRET=1`` (Triton's interpreter), set before the first update.

Buckets: host time, not GPU time, limits a step over many parameters (two kernel launches per
parameter), and gradient release pays it inside backward. Updates that go through a prepared
launch wait until ``BUCKET_TENSORS`` parameters of one configuration and group are queued, then
launch together (``kernels/bucket.py``); whoever queues updates flushes the rest. Results are
bit-identical to per-parameter launches. ``FUSEDOPT_BUCKET_MB`` is the gradient budget release may
hold for buckets (``0`` turns bucketing and holding off).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from .clipping import scale_
from .master import MASTER_CORRECTION
from .reference import ParamUpdate, reference_update
from .sharding import check_sharded_gradient, is_sharded, local
from .streams import on_default_stream

BACKENDS = ("auto", "triton", "reference")
BUCKET_MB = "FUSEDOPT_BUCKET_MB"
# 128, not 32: in backward a budget of 32 MiB closed a bucket every few parameters of a 1.1B model,
# and the launch pairs cost more than release saved (benchmarks/RESULTS.md)
DEFAULT_BUCKET_MB = 128
_MAX_BUILT = 1024  # bucket compositions kept (about 2 KiB of device memory each); more: it changes every step

_NO_OBSERVER = contextlib.nullcontext()  # reusable: entered once per update when nobody observes
_DEVICES = "parameter, gradient and optimizer state are on different devices"
_LAYOUT = "non-contiguous parameter or gradient"


def backend_choice() -> str:
    """The value of ``FUSEDOPT_BACKEND``, validated."""
    choice = os.environ.get("FUSEDOPT_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"FUSEDOPT_BACKEND={choice!r} is invalid; expected one of {', '.join(BACKENDS)}")
    return choice


def bucket_budget() -> int:
    """Gradient bytes per bucket from ``FUSEDOPT_BUCKET_MB`` (0: no bucketing), validated."""
    text = os.environ.get(BUCKET_MB, "").strip()
    try:
        mb = float(text) if text else DEFAULT_BUCKET_MB
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(f"{BUCKET_MB}={text!r} is invalid; expected a number of MiB >= 0 (0 turns bucketing off)")
    return int(mb * 2**20)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _kernels():
    """``fusedopt.kernels`` (update, bucket), imported at the first kernel update: it imports Triton."""
    from .kernels import bucket, update

    return update, bucket


@functools.cache
def kernel_module(name: str):
    """The kernels module an algorithm names as its ``kernel`` (``fusedopt.kernels.<name>``), imported
    at its first use. It provides ``SCRATCH_WORDS``, ``pack_scalars``, ``unsupported`` (what its
    kernels cannot take, beyond the checks here) and ``launch_job`` (the first launch, returning the
    prepared launch of later steps)."""
    return importlib.import_module(f"fusedopt.kernels.{name}")


def total_norm(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.utils.get_total_norm`` of a step's gradients, and each gradient's norm (a vector in
    the order of ``tensors``: clipping tells the finite ones apart by it). Through the norm kernel
    (``kernels/norms.py``, one read of each gradient) where the update runs kernels, plain tensors
    on one device; otherwise torch's ops in ``get_total_norm``'s order (sharded gradients: DTensors
    whose norms are not yet reduced over the ranks)."""
    choice = backend_choice()
    device = tensors[0].device
    kernel = choice == "triton" or (choice == "auto" and device.type == "cuda")
    if kernel and (device.type == "cuda" or _interpreting()) and not any(is_sharded(t) for t in tensors):
        from .kernels import norms

        if norms.fits(tensors):
            return norms.total_norms(tensors)
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

    each: list = [None] * len(tensors)
    order = []  # get_total_norm's: grouped by device and dtype
    for (on, _), ([group], indices) in _group_tensors_by_device_and_dtype([tensors], with_indices=True).items():
        if _has_foreach_support(group, on):
            found = torch._foreach_norm(group, 2.0)
        else:
            found = [torch.linalg.vector_norm(t, 2.0) for t in group]
        for i, norm in zip(indices, found):
            each[i] = norm.to(device)
        order += indices
    stacked = torch.stack(each)
    in_order = stacked if order == sorted(order) else torch.stack([each[i] for i in order])
    return torch.linalg.vector_norm(in_order, 2.0), stacked


def release_clip_kernel(device: torch.device):
    """The kernel of clipping's bookkeeping under release (``kernels/clipping.py``) where updates
    on ``device`` run kernels; None: ``ReleaseClipping``'s reference, the same arithmetic as torch ops."""
    choice = backend_choice()
    if (choice == "triton" or (choice == "auto" and device.type == "cuda")) and (
        device.type == "cuda" or _interpreting()
    ):
        from .kernels import clipping

        return clipping.ReleaseClipKernel()
    return None


def check_gradient(p: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None, optimizer_name: str) -> None:
    """Refuse a gradient (or accumulated buffer) the update cannot take, naming the problem. The
    kernel reads as many gradient elements as the parameter has: one of another shape (``p.grad.data
    = ...`` can set one) would be read out of bounds."""
    if grad.is_sparse:
        raise RuntimeError(f"fusedopt.{optimizer_name} does not support sparse gradients")
    for name, g in (("gradient", grad), ("accumulated gradient", accum)):
        if g is not None and g.shape != p.shape:
            raise ValueError(f"a {name} of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")
        if g is not None and not g.is_floating_point():  # a complex one would lose its imaginary part
            raise ValueError(f"a {name} of dtype {g.dtype} for a {p.dtype} parameter of shape {tuple(p.shape)}")


def _gradient_problem(param: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None) -> str | None:
    """Why this step's gradient (and accumulated buffer) cannot go to the kernel (None: it can)."""
    # plain conditions, no generators: this runs for every parameter in every step
    if grad.device != param.device or (accum is not None and accum.device != param.device):
        return _DEVICES
    if not grad.is_contiguous() or (accum is not None and not accum.is_contiguous()):
        return _LAYOUT
    return None


def unsupported_reason(algorithm, job: ParamUpdate) -> str | None:
    """Why the kernel cannot run this update of ``algorithm`` (an optimizer class; None: it can)."""
    if algorithm.kernel_id is None:
        return f"the fused kernel has no branch for fusedopt.{algorithm.__name__}"
    reason = kernel_module(algorithm.kernel).unsupported(algorithm, job)
    if reason is not None:
        return reason
    p = job.param
    if job.state["step"].device != p.device or job.skipped.device != p.device:
        return _DEVICES
    problem = _gradient_problem(p, job.grad, job.accum)
    if problem is not None:
        return problem
    if not p.is_contiguous():
        return _LAYOUT
    if p.dtype != torch.float32 and job.master_weight_bits is not None and job.state.get(MASTER_CORRECTION) is None:
        return "a split parameter without its correction tensor"
    return None


@dataclass(slots=True)
class GroupSettings:
    """A group's settings for this step's updates (computed once per group and step)."""

    hyper: dict  # the algorithm's keyword arguments (plus maximize)
    structure: tuple  # what a prepared launch is built for: formats, flags, seed
    kernel_allowed: bool  # FUSEDOPT_BACKEND is not "reference"
    scalars: tuple | None  # the kernel's packed runtime scalars (None: no kernel branch, or not allowed)


@dataclass(frozen=True, slots=True)
class CheckedUpdate:
    """An update ``check_update`` has checked (nothing is checked again before it runs); ``launch`` is
    the parameter's prepared kernel launch that still holds (None: the update goes through
    ``run_update``, which decides the path)."""

    launch: object | None


NOT_PREPARED = CheckedUpdate(None)


@dataclass(slots=True)
class PreparedEntry:
    """A parameter's prepared kernel launch and what it was built for."""

    launch: object  # kernels.update.PreparedUpdate
    structure: tuple  # (dtype, shape, device, data_ptr, group structure)
    state_keys: tuple
    state_ids: tuple
    checked: CheckedUpdate  # CheckedUpdate(launch), made once: check_update returns it every step


class _Pending:
    __slots__ = ("members", "grads", "scalars", "grad_scales")

    def __init__(self, scalars: tuple, scaled: bool):
        self.members, self.grads, self.scalars = [], [], scalars
        self.grad_scales: list[torch.Tensor] | None = [] if scaled else None  # each member's coefficient


def _takes_grad_scale(launch) -> bool:
    """Whether a prepared launch multiplies the gradients by a coefficient itself (the update kernel
    does; a kernel that does not gets its gradients scaled first)."""
    return getattr(launch, "takes_grad_scale", False)


class UpdateDispatcher:
    """The update path of one optimizer (see the module docstring)."""

    def __init__(self, optimizer, store):
        self._opt = weakref.ref(optimizer)  # the owner, weakly (state_store.py says why)
        self._store = store  # the owner's StateStore, for each parameter's group
        self._algorithm = type(optimizer)
        self._prepared: dict[torch.Tensor, PreparedEntry] = {}
        self._scratch: dict[torch.Tensor, torch.Tensor] = {}
        self._window: dict[int, GroupSettings] = {}  # group index -> settings for this step
        self.bucket_budget = bucket_budget()
        self._buckets_on = self.bucket_budget > 0
        self._pending: dict[tuple, _Pending] = {}  # (launch configuration, group index) -> queued updates
        self._built: dict[tuple, object] = {}  # ids of the members -> kernels.bucket.PreparedBucket
        self._waiting: set[int] = set()  # ids of the queued members' prepared launches
        self._observers: OrderedDict = OrderedDict()

    # --- observers (the memory profiler) ---------------------------------------------------

    def register_observer(self, hook) -> RemovableHandle:
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = hook
        return handle

    def observed(self):
        """A context around one piece of update work: every observer's context, entered in order."""
        if not self._observers:
            return _NO_OBSERVER
        stack = contextlib.ExitStack()
        for hook in list(self._observers.values()):
            stack.enter_context(hook())
        return stack

    # --- per-step settings -----------------------------------------------------------------

    def new_window(self) -> None:
        """Group settings may change from here on (a step ended, groups or state were replaced)."""
        self._window.clear()

    def settings(self, group_index: int) -> GroupSettings:
        """A group's settings for this step's updates. The hyperparameters are validated here, before
        the group's first update: a scheduler or the user may have set them since the last step."""
        settings = self._window.get(group_index)
        if settings is None:
            opt, algorithm = self._opt(), self._algorithm
            group = opt.param_groups[group_index]
            opt.check_step_group(group)
            hyper = opt.hyper(group)
            allowed = backend_choice() != "reference"
            scalars = None
            if allowed and algorithm.kernel_id is not None:
                scalars = kernel_module(algorithm.kernel).pack_scalars(algorithm.kernel_scalars(hyper))
            flags = tuple(v for v in hyper.values() if isinstance(v, bool))
            formats = (
                group["state_bits"],
                group["state_format"],
                group["min_compress_numel"],
                group["master_weight_bits"],
                opt.state_slots(group),
            )
            settings = GroupSettings(hyper, (formats, flags, opt.seed), allowed, scalars)
            self._window[group_index] = settings
        return settings

    # --- checks ----------------------------------------------------------------------------

    def check(self, p: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None) -> CheckedUpdate:
        """``FusedOptimizer.check_update``: the gradient, then the prepared launch if it still holds,
        else the state against the group."""
        name = self._algorithm.__name__
        if is_sharded(p) or is_sharded(grad):
            if is_sharded(grad):  # (a plain one: the optimizer's accumulation buffer of the local shard)
                check_sharded_gradient(p, grad)
            check_gradient(local(p), local(grad), accum, name)
        else:
            check_gradient(p, grad, accum, name)
        group_index = self._store.group_index(p)
        settings = self.settings(group_index)
        checked = self.check_prepared(p, grad, accum, settings)
        if checked.launch is None:
            self._store.check(p, self._opt().param_groups[group_index])
        return checked

    # --- prepared launches -----------------------------------------------------------------

    def check_prepared(self, p: torch.Tensor, grad, accum, settings: GroupSettings) -> CheckedUpdate:
        """``p``'s prepared kernel launch from an earlier step, while nothing it depends on changed:
        the same state tensors (same keys, same objects), the parameter's dtype, shape, device and
        storage (a bucket's table points into it), and its group's structure. The host work per
        update is then the scalars and two launches (it runs in backward hooks: no allocation
        here). ``NOT_PREPARED`` when the update must go through ``run_update``."""
        if not settings.kernel_allowed:
            return NOT_PREPARED
        entry = self._prepared.get(p)
        if entry is None:
            return NOT_PREPARED
        param = local(p)  # a sharded parameter's update runs on its local shard
        if _gradient_problem(param, local(grad), accum) is not None:
            return NOT_PREPARED
        state = self._opt().state.get(p)
        if (
            state is not None
            and tuple(map(id, state.values())) == entry.state_ids
            and tuple(state) == entry.state_keys
            and entry.structure == (param.dtype, param.shape, param.device, param.data_ptr(), settings.structure)
        ):
            return entry.checked
        return NOT_PREPARED

    def can_hold(self, p: torch.Tensor) -> bool:
        """Whether gradient release should hold ``p``'s update for a bucket: its last update went
        through the kernel and its prepared launch can join a bucket (one launched alone anyway gains
        nothing from waiting, and its held gradient would cost memory)."""
        entry = self._prepared.get(p)
        return entry is not None and self._buckets_on and self._can_join(entry.launch)

    def forget(self) -> None:
        """Drop every prepared launch and built bucket (the state tensors were replaced)."""
        self._prepared.clear()
        self._built.clear()

    # --- running updates -------------------------------------------------------------------

    def queue(self, p: torch.Tensor, grad: torch.Tensor, accum, checked: CheckedUpdate, grad_scale=None) -> None:
        """Run a checked update, or queue it in a bucket (it has run once ``flush()`` returns;
        ``grad`` must stay unchanged until then). ``grad_scale``: a clipping coefficient (fp32 0-d
        device tensor) the gradients are multiplied by, or None; NaN skips the update (the gradient
        pipeline's finite check, ``fusedopt.gradients``)."""
        grad = local(grad)
        launch = checked.launch
        if launch is None or not self._buckets_on or accum is not None or not _takes_grad_scale(launch):
            self.update(p, grad, accum, checked, grad_scale)
            return
        group_index = self._store.group_index(p)
        settings = self.settings(group_index)
        if not self._add(launch, grad, settings.scalars, group_index, grad_scale):
            # prepared but not bucketable (size, alignment): alone
            if id(launch) in self._waiting:  # a queued update of p runs first
                self._opt().flush_updates()
            with self.observed():
                launch.launch(grad, accum, settings.scalars, grad_scale)

    def update(self, p: torch.Tensor, grad: torch.Tensor, accum, checked: CheckedUpdate, grad_scale=None) -> None:
        """Apply one checked update of ``p`` now, through its prepared launch or ``run_update``
        (``grad_scale``: as ``queue``)."""
        grad = local(grad)
        entry = self._prepared.get(p)
        if entry is not None and id(entry.launch) in self._waiting:
            self._opt().flush_updates()  # p's queued update runs first
        opt = self._opt()
        group_index = self._store.group_index(p)
        settings = self.settings(group_index)
        launch = checked.launch
        with self.observed():
            if launch is not None and _takes_grad_scale(launch):
                launch.launch(grad, accum, settings.scalars, grad_scale)
                return
            if grad_scale is not None:  # a path that takes the gradients as they are
                scale_([g for g in (grad, accum) if g is not None], grad_scale)
            if launch is not None:
                launch.launch(grad, accum, settings.scalars)
                return
            group = opt.param_groups[group_index]
            # A first update may run in a hook on a side stream: state (and the correction buffer
            # that all parameters share) is initialised on the default stream, which that stream
            # then waits for
            param = local(p)
            with on_default_stream(param):
                state = opt.ensure_state(p)
            job = ParamUpdate(
                param=param,
                grad=grad,
                accum=accum,
                state=state,
                codecs=opt.codecs(p, group),
                hyper=settings.hyper,
                master_weight_bits=group["master_weight_bits"],
                seed=opt.seed,
                index=opt.param_index(p),
                skipped=opt.num_skipped_updates,
                decays=opt.ema_decays(settings.hyper),
                frames=opt.frames,
                first=opt.element_offset(p),
            )
            launch = self._run(job, settings)
        if launch is not None:
            replaced = self._prepared.get(p)
            structure = (param.dtype, param.shape, param.device, param.data_ptr(), settings.structure)
            ids = tuple(map(id, state.values()))
            self._prepared[p] = PreparedEntry(launch, structure, tuple(state), ids, CheckedUpdate(launch))
        else:
            replaced = self._prepared.pop(p, None)
        if replaced is not None:
            self._built.clear()  # built buckets hold the replaced launch

    def _run(self, job: ParamUpdate, settings: GroupSettings):
        """The one decision: kernel or reference. Returns the kernel's prepared launch (None: the
        reference ran)."""
        algorithm = self._algorithm
        choice = backend_choice()
        if choice == "reference" or (choice == "auto" and not job.param.is_cuda):
            reference_update(algorithm.math, job)
            return None
        if choice == "triton" and not job.param.is_cuda and not _interpreting():
            raise RuntimeError(
                "FUSEDOPT_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's CPU interpreter)"
            )
        reason = unsupported_reason(algorithm, job)
        if reason is not None:
            if choice == "triton":
                raise RuntimeError(f"FUSEDOPT_BACKEND=triton: the fused kernel cannot run this update: {reason}")
            reference_update(algorithm.math, job)
            return None
        with on_default_stream(job.param):  # as the state: other streams may use it
            scratch = self._scratch_of(job.param)
        return kernel_module(algorithm.kernel).launch_job(algorithm, job, scratch, settings.scalars)

    def _scratch_of(self, p: torch.Tensor) -> torch.Tensor:
        """The kernel's per-parameter scratch words (flags and per-step scalars), kept between updates."""
        scratch = self._scratch.get(p)
        if scratch is None:
            words = kernel_module(self._algorithm.kernel).SCRATCH_WORDS  # zeroed; the kernels leave them reusable
            scratch = self._scratch[p] = torch.zeros(words, dtype=torch.int32, device=p.device)
        return scratch

    # --- buckets ---------------------------------------------------------------------------

    def _can_join(self, prepared) -> bool:
        """Whether a prepared update can join a bucket: its size and tensors' alignment (decided once per
        prepared update; the gradient is checked at each update)."""
        if prepared.bucketable is None:
            prepared.bucketable = _kernels()[1].bucketable(prepared)
        return prepared.bucketable

    def _add(self, prepared, grad: torch.Tensor, scalars: tuple, group_index: int, grad_scale) -> bool:
        """Queue ``prepared``'s update from ``grad`` (times ``grad_scale``); False when it cannot join a
        bucket (the caller launches it alone). May launch a full bucket."""
        bucket = _kernels()[1]
        joins = prepared.bucketable if prepared.bucketable is not None else self._can_join(prepared)
        if not (joins and bucket.gradient_bucketable(grad, prepared.head[0].dtype)):
            return False
        # clipped and unclipped updates are launched apart (the kernels' SCALE_GRAD variants)
        key = (prepared.configs[0].key, group_index, grad_scale is not None)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(scalars, grad_scale is not None)
        pending.members.append(prepared)
        self._waiting.add(id(prepared))
        pending.grads.append(grad)
        if grad_scale is not None:
            pending.grad_scales.append(grad_scale)
        if len(pending.members) == bucket.BUCKET_TENSORS:
            del self._pending[key]
            self._launch_bucket(pending)
        return True

    def drop_queued(self) -> None:
        """Forget every queued update unlaunched (the backward pass that queued them failed)."""
        self._pending.clear()
        self._waiting.clear()

    def flush(self) -> None:
        """Launch every queued update."""
        if not self._pending:
            return
        with torch.no_grad(), self.observed():
            while self._pending:
                _, pending = self._pending.popitem()
                self._launch_bucket(pending)

    def _launch_bucket(self, pending: _Pending) -> None:
        members = pending.members
        self._waiting.difference_update(map(id, members))
        with self.observed():
            if len(members) == 1:
                scales = pending.grad_scales
                members[0].launch(pending.grads[0], None, pending.scalars, None if scales is None else scales[0])
                return
            key = tuple(map(id, members))
            built = self._built.get(key)
            if built is None:
                if len(self._built) >= _MAX_BUILT:
                    self._built.clear()
                built = self._built[key] = _kernels()[1].PreparedBucket(members)  # holds the members
            built.launch(pending.grads, pending.scalars, pending.grad_scales)
