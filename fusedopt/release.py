"""Gradient release (``fused=True``): update each parameter inside backward, then free its gradient.

A post-accumulate-grad hook on every trainable parameter counts the backward passes since
the last ``step()``. Below ``accumulation_steps`` it leaves the gradient to accumulate
(moving bf16/fp16 gradients into a buffer of the optimizer's, added with stochastic
rounding, so contributions below one ulp survive); on the k-th it runs the same update
``step()`` would and sets ``p.grad = None``, so a full set of gradients never exists. Kernel
updates are held, gradient and all, until ``FUSEDOPT_BUCKET_MB`` MiB of gradients wait, and then
run as buckets (``dispatch.py``); the end of backward runs the rest. A further backward before
``step()`` is an error, never a second update.

Streams (``streams.py``): only gradients that autograd made ready on their device's default
stream are held, and held updates always launch on that stream (where the gradient's memory
belongs, so freeing it after the launch is safe); a caller whose current stream is another one
is made to wait for them. A hook running on a side stream (its forward ran under
``torch.cuda.stream(s)``) updates at once, on that stream, as every hook did before holding existed.
An accumulation buffer remembers the stream that last wrote it; the next micro-batch, the update
or ``step()`` waits for that stream if it runs on another one.

A backward pass that stops early (an exception, out of memory) never reaches its end: each
backward pass that runs a hook queues an end-of-pass marker with the autograd engine, which runs
it when the pass completes and drops it, unrun, when the pass fails. A pass whose marker is gone
unrun was interrupted; the next hook of another pass, or the optimizer's next call, closes its
window (``close_interrupted``): what was updated stays, held and accumulated gradients are dropped.
Under reentrant activation checkpointing a segment's backward is a pass nested in the one that
recomputes the segments; that outer pass queues a marker too (``_watch_enclosing_pass``), and so on outwards
where checkpoints nest.

References are arranged so the optimizer can be garbage-collected: hooks hold a weak
reference to this object, which holds a weak reference to the optimizer; a finaliser on
the optimizer removes the hooks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import warnings
import weakref
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .dispatch import check_gradient
from .reference import accumulate_low_precision
from .rounding import LOW_PRECISION
from .sharding import is_sharded, local
from .streams import current_stream_of, is_default_stream_current, on_default_stream, ready_on_current_stream

# param -> weakref to the GradientRelease whose hook it carries (one live owner per parameter)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


ALLOW_DISTRIBUTED = "FUSEDOPT_ALLOW_DISTRIBUTED_RELEASE"


def check_processes(params: Iterable[torch.Tensor]) -> None:
    """Refuse gradient release where a parameter's gradient is reduced across processes after its
    hook ran. FSDP2 (``fully_shard``) and the FSDP2-based ``replicate`` hold sharded parameters
    (DTensors) and call their hooks themselves, after the reduction: those are allowed. A plain
    parameter in a process group of several processes is refused: classic DistributedDataParallel
    all-reduces it only after the hook (each process would train its own model, silently), and it
    keeps its gradient buckets anyway, so releasing gradients would save nothing. FSDP1's flat
    parameters are refused in any group. ``FUSEDOPT_ALLOW_DISTRIBUTED_RELEASE=1`` allows plain
    parameters where no gradient is reduced across processes (e.g. pipeline stages)."""
    params = [p for p in params if p.requires_grad]
    if any(getattr(p, "_is_flat_param", False) for p in params):
        raise RuntimeError(
            "fused=True (gradient release) is not supported with FullyShardedDataParallel (FSDP1): its flat "
            "parameters are reduced after their hooks run. Use FSDP2 (torch.distributed.fsdp.fully_shard), or "
            "fused=False"
        )
    if os.environ.get(ALLOW_DISTRIBUTED, "").strip() == "1":
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    plain = next((p for p in params if not is_sharded(p)), None)
    if plain is not None:
        raise RuntimeError(
            f"fused=True (gradient release) in a process group of {dist.get_world_size()} processes with a plain "
            f"(non-DTensor) parameter of shape {tuple(plain.shape)}: under classic DistributedDataParallel each "
            "parameter would be updated from this process's own gradient inside backward, before DDP averages "
            "it, and DDP keeps its gradient buckets, so release would save no memory. Shard the model with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), whose hooks run after the reduction, or use fused=False with "
            f"DDP; set {ALLOW_DISTRIBUTED}=1 if no gradient is reduced across processes"
        )


def _sharded_later() -> bool:
    """Whether accelerate is set up to shard this process's model with FSDP2 (an ``Accelerator`` with an
    FSDP plugin of version 2 exists). The Trainer builds the optimizer on the unsharded model, then
    ``Accelerator.prepare()`` shards it and puts each sharded parameter in the optimizer in place of
    the unsharded one (``FusedOptimizer.sync_groups`` takes them over). Looked up only where
    accelerate is imported already."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return False
    try:  # AcceleratorState.is_fsdp2, read without making an AcceleratorState (that would change it)
        shared = state.AcceleratorState._shared_state
        plugin = shared.get("fsdp_plugin")
        return shared.get("distributed_type") == state.DistributedType.FSDP and plugin.fsdp_version == 2
    except Exception:  # another accelerate: then plain parameters are checked as without it
        return False


# Framework adapters (fusedopt.integrations) with a check for the first hook of each backward pass: a
# framework's module -> its adapter, loaded by name once the framework is imported (the core imports no
# adapter; an adapter imports the core).
FRAMEWORK_CHECKS = {
    "accelerate.state": "fusedopt.integrations.accelerate",
    "lightning.pytorch": "fusedopt.integrations.lightning",
}
_loaded_checks: dict[str, object] = {}


def _framework_checks():
    """``check_release_window`` of each adapter whose framework is imported."""
    if len(_loaded_checks) < len(FRAMEWORK_CHECKS):
        for module, adapter in FRAMEWORK_CHECKS.items():
            if module in sys.modules and adapter not in _loaded_checks:
                _loaded_checks[adapter] = importlib.import_module(adapter).check_release_window
    return _loaded_checks.values()


def _hook(release_ref: weakref.ref, p: torch.Tensor) -> None:
    release = release_ref()
    if release is not None:
        release.on_gradient(p)


def _checkpoint_returned(release_ref: weakref.ref, grad_inputs, grad_outputs) -> None:
    release = release_ref()
    if release is not None:
        release.enter_outer_pass()


_NO_PASS = -1  # torch._C._current_graph_task_id() outside a backward pass


class _Refused(RuntimeError):
    """A gradient release refuses before it changes anything (a second gradient in one window)."""


class _Pass:
    """A backward pass that ran release hooks; ``finished`` once the engine ran its end-of-pass marker."""

    __slots__ = ("finished", "marker")

    def __init__(self, marker: _EndOfPass):
        self.finished = False
        self.marker = weakref.ref(marker)  # the engine holds the marker until the pass ends

    def interrupted(self, outside_backward: bool) -> bool:
        """The pass stopped early: the engine dropped its marker unrun (or no backward runs any more)."""
        return not self.finished and (outside_backward or self.marker() is None)


class _EndOfPass:
    """Queued with the autograd engine at a pass's first hook: run when the pass completes (it then
    launches the held updates), dropped unrun when the pass fails."""

    __slots__ = ("task", "record", "release", "__weakref__")

    def __init__(self, task: int, release: GradientRelease):
        self.task, self.release = task, weakref.ref(release)
        self.record = _Pass(self)

    def __call__(self) -> None:
        release = self.release()
        if release is not None:
            release.end_of_pass(self.task)  # a launch that fails here fails the pass: not finished
        self.record.finished = True


def _reentrant_checkpoint():
    """The autograd node of the reentrant activation checkpoint whose nested backward runs this hook
    (its ``ctx``), or None outside one."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "backward" and code.co_filename.endswith(os.path.join("torch", "utils", "checkpoint.py")):
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None


class GradientRelease:
    """Hooks, backward counts and accumulation buffers of one fused optimizer."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)
        self._handles: dict[int, tuple[weakref.ref, object]] = {}  # id(param) -> (param ref, hook handle)
        self._counts: dict[int, int] = {}  # id(param) -> backward passes since step()
        # param -> (accumulated gradient, the CUDA stream that last wrote it)
        self._buffers: dict[torch.Tensor, tuple[torch.Tensor, torch.cuda.Stream | None]] = {}
        self.attached = True
        self._checked_processes = False  # checked again at the first hook: the group may come later
        self._held: list[tuple] = []  # (param, gradient, its CheckedUpdate) not yet updated
        self._held_bytes = 0
        self._passes: dict[int, _Pass] = {}  # graph task id -> a pass whose end has not run yet
        self._outer_watch: list = []  # handles of the node hooks that wait for a reentrant checkpoint to return
        self._task = _NO_PASS  # the pass the last hook ran in
        self._updated = 0  # updates release launched since step()
        self._left: dict[int, tuple[weakref.ref, int]] = {}  # id(param) -> its gradient left in p.grad, its version
        self._frozen: dict[int, weakref.ref] = {}  # id(param) -> a parameter not hooked: requires_grad was False
        # (not at exit: a process that ends on an uncaught failure has said enough)
        weakref.finalize(optimizer, GradientRelease._dropped, self).atexit = False

    def check(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """What ``attach`` checks before it hooks anything; returns the trainable parameters of ``params``.

        Plain parameters in a process group of several processes are refused (``check_processes``),
        except while accelerate's FSDP2 is to shard them (``_sharded_later``) and no hook has run yet:
        ``Accelerator.prepare()`` then puts the sharded parameters in their place, and the first hook
        checks the parameters hooked by then."""
        params = [p for p in params if p.requires_grad]
        if not self._checked_processes and _sharded_later():
            check_processes([p for p in params if getattr(p, "_is_flat_param", False)])  # FSDP1: refused anyway
        else:
            check_processes(params)
        for p in params:
            owner = _OWNERS.get(p)
            if owner is not None and owner() is not None and owner() is not self and owner().attached:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} already carries the gradient-release hook of another "
                    "live fusedopt optimizer with fused=True; call remove_hooks() on that optimizer first, or drop "
                    "every reference to it (a retry loop: accelerate's accelerator.free_memory() drops the prepared "
                    "ones)"
                )
        return params

    def attach(self, params: Iterable[torch.Tensor]) -> None:
        """Register the release hook on every trainable parameter in ``params`` (checked first: ``check``);
        the frozen ones are hooked once they require gradients (``attach_unfrozen``)."""
        params = list(params)
        for p in self.check(params):
            hook = functools.partial(_hook, weakref.ref(self))
            self._handles[id(p)] = (weakref.ref(p), p.register_post_accumulate_grad_hook(hook))
            _OWNERS[p] = weakref.ref(self)
            self._frozen.pop(id(p), None)
        for p in params:
            if not p.requires_grad and id(p) not in self._handles:
                self._frozen[id(p)] = weakref.ref(p)

    def attach_unfrozen(self) -> None:
        """Hook the parameters frozen when they were attached that require gradients now (a model
        unfrozen in stages): their gradients are released as every other one's."""
        if not self._frozen or not self.attached:
            return
        unfrozen = []
        for key, ref in list(self._frozen.items()):
            p = ref()
            if p is None:
                del self._frozen[key]
            elif p.requires_grad:
                unfrozen.append(p)
        if unfrozen:
            self.attach(unfrozen)

    def remove(self) -> None:
        """Remove every hook; the optimizer then behaves as ``fused=False``."""
        for param_ref, _ in self._handles.values():
            p = param_ref()
            if p is not None:
                self._disown(p)
        GradientRelease._remove_handles(self._handles)
        self._stop_watching()
        self._frozen.clear()
        self.attached = False

    def detach(self, params: Iterable[torch.Tensor], gone: Iterable[int] = ()) -> None:
        """Remove the hooks of parameters the optimizer no longer holds (torch.optim leaves them alone),
        and forget those already freed (``gone``: their ids; their hooks went with them)."""
        for p in params:
            entry = self._handles.pop(id(p), None)
            if entry is not None:
                entry[1].remove()
                self._disown(p)
            self._buffers.pop(p, None)
            self._frozen.pop(id(p), None)
        for key in gone:
            entry = self._handles.get(key)
            if entry is not None and entry[0]() is None:
                del self._handles[key]
                entry[1].remove()
            self._counts.pop(key, None)
            self._left.pop(key, None)
            self._frozen.pop(key, None)

    def _disown(self, p: torch.Tensor) -> None:
        """Another fused optimizer may hook ``p`` from now on."""
        owner = _OWNERS.get(p)
        if owner is not None and owner() is self:
            del _OWNERS[p]

    @staticmethod
    def _dropped(release: GradientRelease) -> None:
        """The optimizer is gone: its hooks go too. If a backward pass of its stopped early and nothing closed
        that window, the updates it applied stay in the parameters unannounced: say so here (a retry that
        builds a new optimizer over the same model starts from them)."""
        GradientRelease._remove_handles(release._handles)
        if release.interrupted() and release._updated:  # (a pass refused at its first hook changed nothing)
            warnings.warn(
                f"fusedopt: an optimizer with fused=True was dropped after a backward pass that stopped early (an "
                f"exception inside it, e.g. out of memory) and before any call closed that step: the "
                f"{release._updated} parameter update(s) the pass had already applied stay in the parameters",
                UserWarning,
                stacklevel=2,
            )

    @staticmethod
    def _remove_handles(handles: dict) -> None:
        for _, handle in handles.values():
            handle.remove()
        handles.clear()

    def on_gradient(self, p: torch.Tensor) -> None:
        """Called by autograd once ``p.grad`` holds this backward's full gradient."""
        if not self._checked_processes:
            # before any update: raising here leaves everything as it was
            check_processes(ref() for ref, _ in self._handles.values() if ref() is not None)
            self._checked_processes = True
        optimizer = self._optimizer()
        grad = p.grad
        if optimizer is None or grad is None:
            return
        task = torch._C._current_graph_task_id()
        first = task != _NO_PASS and task not in self._passes  # this pass's first hook (not a return to it)
        if task != self._task:
            for check in _framework_checks():  # before any update: the framework's accumulation agrees
                check(optimizer, p, self._counts.get(id(p), 0) + 1)
            self._enter_pass(optimizer, task, p)
        try:
            self._take(optimizer, p, grad)
        except BaseException as error:
            if task != _NO_PASS:
                p.grad = None  # this pass fails: its gradient must not reach a later step()
                if first and isinstance(error, _Refused):  # refused at its first hook, the pass changed nothing:
                    self._passes.pop(task, None)  # it leaves no window to close
            raise

    def _take(self, optimizer, p: torch.Tensor, grad: torch.Tensor) -> None:
        k = optimizer.accumulation_steps
        key = id(p)  # the parameter is alive while its hook runs; id hashing is cheaper than a tensor's
        if not self._counts:  # the first gradient since step(): param_groups may have been edited
            optimizer.sync_groups()
            if id(p) not in self._handles:
                return  # p is in no group any more: its hook was just removed, its gradient stays
        n = self._counts.get(key, 0) + 1
        if n > k:
            # p was updated in this window already: this gradient must not reach step() either
            p.grad = None
            raise _Refused(self._second_gradient_error(p, n, k))
        if n == k:  # this backward updates p: everything that could refuse the update is checked first
            checked = optimizer.check_update(p, grad, self.buffer(p))
        else:
            check_gradient(p, grad, None, type(optimizer).__name__)
            checked = None
        # counted once the gradient is used: a refused one leaves the count as it was
        self._consume(optimizer, p, local(grad), n, k, checked)
        self._counts[key] = n
        if n < k and p.grad is not None:  # left to accumulate in p.grad (float32)
            self._left[key] = weakref.ref(p.grad), p.grad._version

    def _second_gradient_error(self, p: torch.Tensor, n: int, k: int) -> str:
        shape = tuple(p.shape)
        if _reentrant_checkpoint() is not None or len(self._passes) > 1:
            return (
                f"fusedopt: a parameter of shape {shape} received a second gradient within one backward pass, after "
                "its update was already applied: autograd delivered its gradient in pieces, which happens under "
                "reentrant activation checkpointing (use_reentrant=True) when a parameter is used in more than one "
                "checkpointed segment (tied or shared weights). Use torch.utils.checkpoint with use_reentrant=False "
                "(in transformers: gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
        return (
            f"fusedopt: a parameter of shape {shape} received a gradient after its update was already applied "
            f"(backward #{n} since the last step(), accumulation_steps={k}): call optimizer.step() once every {k} "
            "backward pass(es). If you accumulate gradients over several backward passes per optimizer step "
            "(a framework's gradient_accumulation_steps / accumulate_grad_batches), pass the same number as "
            "accumulation_steps to the fusedopt optimizer"
        )

    def _consume(self, optimizer, p: torch.Tensor, grad: torch.Tensor, n: int, k: int, checked) -> None:
        """Accumulate (``n < k``), update, or hold the update of ``p``'s gradient (``checked``: what
        ``check_update`` returned for it)."""
        # backward runs hooks with grad mode off unless create_graph=True: enter no_grad only then
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
            if n < k:
                if p.dtype in LOW_PRECISION:
                    _, index = optimizer.position(p)
                    with on_default_stream(local(p)):  # as update_param creates state (streams.py)
                        step = optimizer.ensure_state(p)["step"]
                    buffer = accumulate_low_precision(
                        self.take_buffer(p),
                        grad,
                        seed=optimizer.seed,
                        index=index,
                        micro_batch=n,
                        step=step,
                        first=optimizer.element_offset(p),
                    )
                    self._buffers[p] = buffer, current_stream_of(buffer)
                    p.grad = None
                return
            accum = self.take_buffer(p) if self._buffers else None
            if (
                accum is not None
                or not optimizer.bucket_budget
                or not optimizer.can_hold_update(p)
                or (grad.is_cuda and not is_default_stream_current(grad.get_device()))
            ):
                # the reference, a first step, no bucketing, a parameter launched alone, or a side
                # stream's gradient (updated now, on that stream)
                grads = [grad] if accum is None else [grad, accum]
                (scale,) = optimizer.prepare_released_gradients([(p, grads)])  # unscaled; clipped by `scale`
                optimizer.update_param(p, grad, accum, checked, scale)
                self._updated += 1
                p.grad = None
                return
        # A kernel update: hold the gradient and update later, in buckets (fewer launches; the
        # hook itself stays a few microseconds, its unscaling and clipping run with the bucket's).
        # At most the bucket budget is held.
        self._held.append((p, grad, checked))
        self._held_bytes += grad.numel() * grad.element_size()
        p.grad = None
        if self._held_bytes >= optimizer.bucket_budget or self._task == _NO_PASS:
            self.drain(optimizer)  # (no pass to launch them at its end: the hook was called directly)

    def drain(self, optimizer) -> None:
        """Queue the updates of every held gradient (``optimizer.flush_updates`` launches them)."""
        held, self._held, self._held_bytes = self._held, [], 0
        if not held:
            return
        with (
            torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext(),
            on_default_stream(held[0][1]),
        ):
            scales = optimizer.prepare_released_gradients([(p, [grad]) for p, grad, _ in held])
            for (p, grad, checked), scale in zip(held, scales):
                optimizer.queue_update(p, grad, None, checked, scale)
            optimizer.flush_updates()
        self._updated += len(held)

    def updated_since_step(self) -> int:
        """How many parameters release updated since the last ``step()`` (0 once the optimizer is gone)."""
        optimizer = self._optimizer()
        if optimizer is None:
            return 0
        return sum(n >= optimizer.accumulation_steps for n in self._counts.values())

    def hooks_ran(self) -> bool:
        """Whether a release hook took a gradient since the last ``step()``."""
        return bool(self._counts)

    def holds_updates(self) -> bool:
        return bool(self._held)

    def held_gradients(self) -> list[torch.Tensor]:
        """The gradients held until their bucketed update (the memory profiler counts them)."""
        return [grad for _, grad, _ in self._held]

    # --- backward passes, and the window of one that stopped early ---------------------------

    def _enter_pass(self, optimizer, task: int, p: torch.Tensor) -> None:
        """The first hook of a backward pass (or the first since a nested pass ran): close the window
        of an earlier pass that stopped early, then have the engine tell this one's end."""
        if task != _NO_PASS and task not in self._passes:
            self.close_interrupted(optimizer, current=p)
            if not self._queue_end_of_pass(task):  # no pass to queue it in after all: updates launch at once
                task = _NO_PASS
            else:
                self._watch_enclosing_pass()
        self._task = task

    def _queue_end_of_pass(self, task: int) -> bool:
        """Queue an end-of-pass marker with the running pass ``task``; False where the engine runs none."""
        marker = _EndOfPass(task, self)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(marker)
        except RuntimeError:
            return False
        self._passes[task] = marker.record
        return True

    def _watch_enclosing_pass(self) -> None:
        """Where the only pass watched runs inside a reentrant checkpoint's backward, watch the pass that
        checkpoint's node belongs to. Reentrant checkpointing runs a segment's backward as a pass of its own,
        nested in the pass that recomputes the segments (the outer). The outer queues no marker unless a hook
        runs in it, so its failure after a nested pass ended (out of memory in the next segment's
        recomputation) would go unseen and the retry would meet parameters already updated in this window:
        the outer queues its marker as soon as the checkpoint's backward returns, in a hook the engine runs
        right after it (``enter_outer_pass``), before it passes the gradients on."""
        if len(self._passes) == 1:
            checkpoint = _reentrant_checkpoint()
            if checkpoint is not None:
                hook = functools.partial(_checkpoint_returned, weakref.ref(self))
                self._outer_watch.append(checkpoint.register_hook(hook))

    def enter_outer_pass(self) -> None:
        """The watched checkpoint's backward returned to the outer pass (``_watch_enclosing_pass``): queue that
        pass's end-of-pass marker."""
        self._stop_watching()
        task = torch._C._current_graph_task_id()
        if task != _NO_PASS and task not in self._passes and self._queue_end_of_pass(task):
            self._watch_enclosing_pass()  # checkpoints nested in checkpoints: the outer may be nested too

    def _stop_watching(self) -> None:
        handles, self._outer_watch = self._outer_watch, []
        for handle in handles:
            handle.remove()

    def end_of_pass(self, task: int) -> None:
        """A backward pass completed: launch the updates it holds."""
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer.flush_updates()
        self._passes.pop(task, None)
        if self._task == task:
            self._task = _NO_PASS

    def interrupted(self) -> bool:
        """Whether a backward pass that ran release hooks stopped early and its window is still open."""
        if not self._passes:
            return False
        outside = torch._C._current_graph_task_id() == _NO_PASS
        return any(record.interrupted(outside) for record in self._passes.values())

    def close_interrupted(self, optimizer, current: torch.Tensor | None = None) -> bool:
        """Close the window of a backward pass that stopped early, if there is one: the updates it ran
        stay, every other parameter skips this step (held and accumulated gradients are dropped), one
        warning says so and ``optimizer.num_interrupted_steps`` counts it. ``current``: the parameter
        whose hook noticed it (its gradient, of the new pass, is kept). Returns whether it closed one."""
        if not self.interrupted():
            return False
        updated = self._updated
        stale = current is not None and self._left_gradient(current)
        self.abandon_window(optimizer, keep=current)
        optimizer.num_interrupted_steps += 1
        warnings.warn(
            f"fusedopt: a backward pass with fused=True stopped early (an exception inside it, e.g. out of memory); "
            f"{updated} parameter update(s) it had already applied are kept, the other parameters skip this step, "
            "and the gradients it left are dropped (optimizer.num_interrupted_steps counts such steps)",
            UserWarning,
            stacklevel=4,
        )
        if stale:
            current.grad = None
            raise RuntimeError(
                f"fusedopt: the previous backward pass stopped early and left the partial accumulated gradient of a "
                f"{current.dtype} parameter of shape {tuple(current.shape)} in p.grad, which this backward added to; "
                "call optimizer.zero_grad() (or model.zero_grad()) after a failed backward pass, as with torch.optim, "
                "then run the batch again"
            )
        return True

    def _left_gradient(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is the gradient an earlier window left in it to accumulate, with only this
        backward's gradient added (autograd adds in place: one version more; a zeroing in place,
        ``model.zero_grad(set_to_none=False)``, counts one more)."""
        entry = self._left.get(id(p))
        if entry is None or p.grad is None:
            return False
        ref, version = entry
        return ref() is p.grad and p.grad._version == version + 1

    def abandon_window(self, optimizer, keep: torch.Tensor | None = None) -> None:
        """End this window without updating anything more: held updates, queued launches, accumulated
        gradients (the optimizer's buffers and those left in ``p.grad``, but ``keep``'s) are dropped,
        and clipping and unscaling forget its partial sums."""
        self._held, self._held_bytes = [], 0
        optimizer.drop_queued_updates()
        self._buffers.clear()
        outside = torch._C._current_graph_task_id() == _NO_PASS
        if outside:  # every gradient left is the window's, an unhooked parameter's too: none may reach step()
            dropped = (p for group in optimizer.param_groups for p in group["params"])
        else:  # the next pass's gradients may have arrived: only those of parameters this window counted
            dropped = (entry[0]() for entry in map(self._handles.get, self._counts) if entry is not None)
        for p in dropped:
            if p is not None and p is not keep:
                p.grad = None
        self._counts.clear()
        self._left.clear()
        self._passes = {task: record for task, record in self._passes.items() if not record.interrupted(outside)}
        self._stop_watching()
        self._updated = 0
        optimizer.gradient_pipeline.abandon_window()

    def buffer(self, p: torch.Tensor) -> torch.Tensor | None:
        """The accumulated gradient held for ``p`` (kept; ``take_buffer`` hands it over)."""
        if not self._buffers:  # the usual case (no accumulation): no tensor hashing in the hook
            return None
        entry = self._buffers.get(p)
        return None if entry is None else entry[0]

    def take_buffer(self, p: torch.Tensor) -> torch.Tensor | None:
        """Hand over (and forget) the accumulated gradient the optimizer holds for ``p``, ready to use
        on the current stream."""
        entry = self._buffers.pop(p, None)
        return None if entry is None else ready_on_current_stream(*entry)

    def buffered_gradients(self) -> list[torch.Tensor]:
        """The accumulated gradients held until their update (the memory profiler counts them)."""
        return [buffer for buffer, _ in self._buffers.values()]

    def holds_gradients(self) -> bool:
        return bool(self._buffers)

    def zero_grad(self, optimizer) -> None:
        """``zero_grad()``: the window's accumulated gradients are dropped, and the parameters not yet
        updated in it start counting their backward passes again."""
        self._buffers.clear()
        self._left.clear()
        k = optimizer.accumulation_steps
        self._counts = {key: n for key, n in self._counts.items() if n >= k}

    def new_window(self) -> None:
        """``step()`` was called: the next backward starts a new accumulation window."""
        self._stop_watching()
        self._counts.clear()
        self._left.clear()
        self._updated = 0
