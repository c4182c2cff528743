"""Memory measurement for ``fusedopt.profile``: where the bytes of a training step go.

:class:`MemoryTracker` watches one training step and splits the memory it holds into
parameters, master-weight corrections (``fusedopt.master.MASTER_CORRECTION``), other
optimizer state, gradients, activations and the rest. It combines:

* **Tensor accounting** (CPU and CUDA): a ``TorchDispatchMode`` sees the outputs of every aten
  op (forward, backward including activation recomputation and gradient-release hooks, and the
  optimizer update) and tracks each distinct storage until it is freed (a weak reference to
  the storage). Storages that exist when tracking starts (parameters, buffers, optimizer state)
  are registered up front. At every sample the live storages are classified: parameters by
  identity, gradients as ``p.grad`` (and the accumulation buffers and held gradients of a fusedopt optimizer),
  optimizer state as the tensors in ``optimizer.state``; of the remainder, storages allocated
  in the forward pass, or inside a module's forward during backward (checkpoint recomputation),
  are activations; everything else (inputs, buffers, autograd and optimizer temporaries) is
  the rest. This counts tensor bytes exactly but cannot see scratch memory that an op
  allocates and frees internally, nor allocator rounding and caching.
* **CUDA allocator** (CUDA): ``torch.cuda.memory_allocated`` and the allocator's peak since the
  previous op, read after every op. The peak is the allocator's figure; the bytes it holds
  beyond the tracked tensors (op-internal workspaces, rounding, memory from before tracking)
  are reported as "untracked" inside the rest.
* **Process RSS** (CPU): resident set size read from ``/proc/self/statm`` (what psutil reads)
  after every op. RSS includes everything in the process (the interpreter, libraries, memory
  the C allocator keeps after a free, pages it has not touched yet), so it is a cross-check,
  not a breakdown.
* **CPU allocator** (CPU, a separate pass): :func:`cpu_allocator_trace` replays a step under
  ``torch.profiler`` with memory profiling and reads the c10 CPU allocator's running total,
  which also counts the scratch buffers ops allocate internally.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fusedopt.profile.competitors import correction_keys

CATEGORIES = ("parameters", "corrections", "optimizer_state", "gradients", "activations", "rest")
CATEGORY_LABELS = {
    "parameters": "params",
    "corrections": "corrections",
    "optimizer_state": "opt state",
    "gradients": "grads",
    "activations": "activations",
    "rest": "rest",
}
# Where the bytes in "rest" come from.
REST_PARTS = ("inputs_buffers", "backward_temporaries", "update_temporaries", "other_temporaries", "untracked")
PHASES = ("forward", "backward", "update")

_ORIGIN_ACTIVATION = "activation"
_ORIGIN_FOR_PHASE = {"backward": "backward_temporaries", "update": "update_temporaries"}


# --- process RSS -------------------------------------------------------------------------------


class RssReader:
    """Resident set size of this process (what psutil reports as ``rss``), cheap enough to read per op.

    The kernel's own high-water mark (``VmHWM``) is not used: on some kernels it is updated
    lazily and misses short peaks, so peaks come from sampling after every op.
    """

    method = "process RSS (/proc/self/statm, as psutil reads it), sampled after every op"

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._fd = None
        self._process = None
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            import psutil

            self._process = psutil.Process()
            self.method = "process RSS (psutil), sampled after every op"

    def current(self) -> int:
        if self._fd is not None:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) * self._page
        return self._process.memory_info().rss

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --- results -----------------------------------------------------------------------------------


@dataclass
class Breakdown:
    """Bytes by category at one moment; ``rest_parts`` splits ``rest``. The categories sum to ``total``."""

    total: int
    categories: dict[str, int]
    rest_parts: dict[str, int]

    def dominant(self) -> str:
        return max(CATEGORIES, key=lambda c: self.categories[c])

    def to_dict(self) -> dict:
        return {"total": self.total, "categories": dict(self.categories), "rest_parts": dict(self.rest_parts)}


@dataclass
class StepMemory:
    """What one tracked training step held. Bytes; relative to ``baseline`` on CUDA."""

    device: str
    method: dict[str, str]  # figure -> how it was measured
    peak: int
    peak_phase: str
    peak_op: str
    peak_breakdown: Breakdown
    persistent: int  # held after the step (between steps)
    persistent_breakdown: Breakdown
    start: int  # held when the step began
    phases: dict[str, dict] = field(default_factory=dict)  # phase -> {peak, end, breakdown, rss_peak}
    rss: dict[str, int | None] = field(default_factory=dict)  # before / peak / after, absolute bytes
    timeline: list[tuple] = field(default_factory=list)  # (ms, phase, total, *CATEGORIES, rss)
    num_ops: int = 0
    seconds: float = 0.0

    @property
    def dominant(self) -> str:
        return self.peak_breakdown.dominant()

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "method": dict(self.method),
            "peak": self.peak,
            "peak_phase": self.peak_phase,
            "peak_op": self.peak_op,
            "dominant": self.dominant,
            "peak_breakdown": self.peak_breakdown.to_dict(),
            "persistent": self.persistent,
            "persistent_breakdown": self.persistent_breakdown.to_dict(),
            "start": self.start,
            "phases": {
                k: {**v, "breakdown": v["breakdown"].to_dict() if v.get("breakdown") else None}
                for k, v in self.phases.items()
            },
            "rss": dict(self.rss),
            "timeline_columns": ["ms", "phase", "total", *CATEGORIES, "rss"],
            "timeline": [list(s) for s in self.timeline],
            "num_ops": self.num_ops,
            "seconds": self.seconds,
        }


# --- optimizer state ---------------------------------------------------------------------------


def _leaves(name: str, value, depth: int = 0):
    """(key, tensor) for every plain tensor in a state value: nested dicts and lists (TurboAdam),
    the inner tensors of tensor subclasses (torchao's quantized states) and the tensor attributes
    of plain holder objects (FlashOptim's quantized moments)."""
    if depth > 8 or isinstance(value, torch.nn.Parameter):  # optimi keeps its param group in the state
        return
    if isinstance(value, torch.Tensor):
        flatten = getattr(type(value), "__tensor_flatten__", None)
        if flatten is not None and type(value) is not torch.Tensor:
            inner, _ = value.__tensor_flatten__()
            for attr in inner:
                yield from _leaves(name, getattr(value, attr), depth + 1)
        else:
            yield name, value
    elif isinstance(value, dict):
        for item in list(value.values()):
            yield from _leaves(name, item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(name, item, depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        for item in list(vars(value).values()):
            yield from _leaves(name, item, depth + 1)


def state_tensors(optimizer):
    """(state key, tensor) for every tensor an optimizer's state holds, nested ones included."""
    for state in list(optimizer.state.values()):
        for name, value in list(state.items()):
            yield from _leaves(str(name), value)


def state_storages(optimizer, device: torch.device):
    """(state key, bytes) per distinct storage of the optimizer state on ``device``."""
    seen = set()
    for name, t in state_tensors(optimizer):
        if t.device != device or t.is_meta:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() in seen and storage.data_ptr() != 0:
            continue
        seen.add(storage.data_ptr())
        yield name, storage.nbytes()


# --- the tracker -------------------------------------------------------------------------------


_ALIASING: dict = {}  # op -> per return, whether it aliases an input (views, in-place and out= ops)


def _fresh_outputs(func, out) -> list:
    """The outputs of an op that may hold new storage: not views of, or in-place into, its inputs.

    Registering an alias would charge a storage that existed before (say, a slice of a dataset
    tensor) to the step at the moment it was viewed.
    """
    flags = _ALIASING.get(func)
    if flags is None:
        try:
            flags = tuple(r.alias_info is not None for r in func._schema.returns)
        except AttributeError:
            flags = ()
        _ALIASING[func] = flags
    if not any(flags):
        return tree_flatten(out)[0]
    if isinstance(out, (tuple, list)) and len(flags) == len(out) and len(flags) > 1:
        return [t for t, aliased in zip(out, flags) if not aliased]
    return []


class _Record:
    __slots__ = ("nbytes", "origin", "ref")

    def __init__(self, nbytes: int, origin: str):
        self.nbytes = nbytes
        self.origin = origin
        self.ref = None


class MemoryTracker(TorchDispatchMode):
    """Track the memory of a training step, by category and phase.

    Usage::

        tracker = MemoryTracker(model, optimizer)
        with tracker:
            with tracker.phase("forward"):
                loss = model(x)
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("update"):
                optimizer.step()
                optimizer.zero_grad()
        print(tracker.result().peak)

    ``model`` and ``optimizer`` are optional: without them every tensor is an activation
    (allocated in "forward") or rest. ``device`` defaults to the device of the first parameter
    (or CPU). On CUDA, ``baseline`` bytes (memory allocated before the model was built) are
    subtracted from the allocator's figures. ``timeline=False`` keeps only the peak and the
    phase figures (cheaper for very long steps).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: torch.device | str | None = None,
        baseline: int = 0,
        timeline: bool = True,
        opaque_update: bool = False,
    ):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        params = list(model.parameters()) if model is not None else []
        if optimizer is not None:
            known = {id(p) for p in params}
            params += [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]
        self.params = params
        if device is None:
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.baseline = baseline
        self.keep_timeline = timeline
        # torch.compile refuses to run under a dispatch mode (torchao's optimizers compile their
        # step): with opaque_update the update phase runs untracked, seen only through the
        # allocator figures at its boundaries (CUDA: the allocator's peak inside it).
        self.opaque_update = opaque_update
        self._live: dict[int, _Record] = {}
        self._origin_bytes: dict[str, int] = {}
        self._total = 0
        self._phase = None
        self._module_depth = 0
        self._hooks = []
        self._special: dict[int, str] = {}  # storage key -> category, for the four identified categories
        self._special_bytes = dict.fromkeys(CATEGORIES, 0)
        self._special_by_origin: dict[str, int] = {}
        self._state_len = 0
        self._dirty = True
        self._in_update = 0
        self._rss = RssReader() if not self.cuda else None
        self._result: StepMemory | None = None
        self._active = False

    # --- storages ------------------------------------------------------------------------------

    def _on_device(self, t: torch.Tensor) -> bool:
        if self.cuda:
            return t.is_cuda and t.get_device() == self.device.index
        return t.is_cpu

    def _register(self, t: torch.Tensor, origin: str | None = None) -> int | None:
        """Start tracking ``t``'s storage (if new and on the tracked device); return its key."""
        if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_meta or not self._on_device(t):
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        key = id(storage)
        if key in self._live:
            return key
        nbytes = storage.nbytes()
        if origin is None:
            origin = self._current_origin()
        record = _Record(nbytes, origin)
        live, origin_bytes = self._live, self._origin_bytes

        tracker_ref = weakref.ref(self)

        def freed(_ref, key=key, record=record):
            tracker = tracker_ref()
            if tracker is not None and live.get(key) is record:
                del live[key]
                origin_bytes[record.origin] -= record.nbytes
                tracker._total -= record.nbytes
                if key in tracker._special:
                    tracker._dirty = True

        record.ref = weakref.ref(storage, freed)
        live[key] = record
        origin_bytes[origin] = origin_bytes.get(origin, 0) + nbytes
        self._total += nbytes
        return key

    def _current_origin(self) -> str:
        phase = self._phase
        if self._in_update:
            return "update_temporaries"
        if phase == "forward" or (phase == "backward" and self._module_depth > 0):
            return _ORIGIN_ACTIVATION
        return _ORIGIN_FOR_PHASE.get(phase, "other_temporaries")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._active:
            for t in _fresh_outputs(func, out):
                if isinstance(t, torch.Tensor):
                    self._register(t)
            self._sample(func)
        return out

    def register_inputs(self, *tensors: torch.Tensor) -> None:
        """Track tensors made before tracking began (e.g. the batch); they count in the rest."""
        for t in tensors:
            self._register(t, origin="inputs_buffers")

    # --- classification ------------------------------------------------------------------------

    def _special_keys(self) -> dict[str, list[int]]:
        """Keys of live storages that are parameters, corrections, optimizer state or gradients."""
        seen: set[int] = set()
        out = {"parameters": [], "corrections": [], "optimizer_state": [], "gradients": []}

        def add(category, t):
            key = self._register(t, origin="inputs_buffers")
            if key is not None and key not in seen:
                seen.add(key)
                out[category].append(key)

        for p in self.params:
            add("parameters", p)
        opt = self.optimizer
        if opt is not None:
            corrections = correction_keys()
            for name, value in state_tensors(opt):
                add("corrections" if name.startswith(corrections) else "optimizer_state", value)
        for p in self.params:
            if p.grad is not None:
                add("gradients", p.grad)
        # accumulation buffers and gradients held for a bucketed update (fusedopt optimizers)
        for grad in opt.held_gradients() if hasattr(opt, "held_gradients") else ():
            add("gradients", grad)
        return out

    def _refresh(self) -> None:
        """Re-classify parameters, corrections, state and gradients (after something changed)."""
        special = self._special_keys()
        self._special = {}
        self._special_bytes = dict.fromkeys(CATEGORIES, 0)
        self._special_by_origin = {}
        for category, keys in special.items():
            for key in keys:
                record = self._live.get(key)
                if record is not None:
                    self._special[key] = category
                    self._special_bytes[category] += record.nbytes
                    self._special_by_origin[record.origin] = (
                        self._special_by_origin.get(record.origin, 0) + record.nbytes
                    )
        self._state_len = len(self.optimizer.state) if self.optimizer is not None else 0
        self._dirty = False

    def _mark_dirty(self, *args) -> None:
        self._dirty = True

    def breakdown(self, total: int | None = None) -> Breakdown:
        """Classify what is live now. ``total`` (CUDA: the allocator's figure) adds untracked bytes."""
        if self._dirty or (self.optimizer is not None and len(self.optimizer.state) != self._state_len):
            self._refresh()
        cats = dict(self._special_bytes)
        by_origin = dict(self._origin_bytes)
        for origin, nbytes in self._special_by_origin.items():
            by_origin[origin] -= nbytes
        cats["activations"] = by_origin.pop(_ORIGIN_ACTIVATION, 0)
        rest_parts = dict.fromkeys(REST_PARTS, 0)
        for origin, nbytes in by_origin.items():
            rest_parts[origin] = rest_parts.get(origin, 0) + nbytes
        tracked = self._total
        if total is None:
            total = tracked
        rest_parts["untracked"] = max(0, total - tracked)
        cats["rest"] = sum(rest_parts.values())
        return Breakdown(total=sum(cats.values()), categories=cats, rest_parts=rest_parts)

    # --- sampling ------------------------------------------------------------------------------

    def _allocator(self) -> tuple[int, int]:
        """(allocated now, peak since the previous call), minus the baseline."""
        current = torch.cuda.memory_allocated(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return current - self.baseline, peak - self.baseline

    def _sample(self, func=None) -> None:
        if self.cuda:
            _, figure = self._allocator()
        else:
            figure = self._total
        self._ops += 1
        phase = self._phase or "outside"
        rss = None
        if self._rss is not None:
            rss = self._rss.current()
            if rss > self._rss_peak:
                self._rss_peak = rss
            if rss > self._phase_rss.get(phase, 0):
                self._phase_rss[phase] = rss
        need_phase = figure > self._phase_peak.get(phase, -1)
        need_peak = figure > self._peak
        # The timeline keeps peaks, phase changes and moves of at least `resolution` bytes
        # (the breakdown costs more than the rest of a sample).
        record = self.keep_timeline and (
            func is None or phase != self._last_phase or abs(figure - self._last_figure) >= self._resolution
        )
        if not (need_peak or need_phase or record):
            return
        bd = self.breakdown(figure if self.cuda else None)
        if need_peak:
            self._peak = figure
            self._peak_info = (phase, str(func) if func is not None else f"(end of {phase})", bd)
        if need_phase:
            self._phase_peak[phase] = figure
            self._phase_breakdown[phase] = bd
        if self.keep_timeline:
            self._last_phase, self._last_figure = phase, figure
            ms = (time.perf_counter() - self._t0) * 1e3
            self._timeline.append((round(ms, 3), phase, bd.total, *(bd.categories[c] for c in CATEGORIES), rss))

    @contextlib.contextmanager
    def phase(self, name: str):
        """Attribute what happens inside to phase ``name`` ("forward", "backward" or "update")."""
        if not self._active:
            raise RuntimeError("MemoryTracker.phase() outside 'with tracker:'")
        previous = self._phase
        self._phase = name
        self._module_depth = 0
        self._dirty = True
        if self.cuda:
            self._allocator()
        self._sample()
        try:
            if name == "update" and self.opaque_update:
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes():
                    yield
            else:
                yield
        finally:
            self._sample()
            current = self._allocator()[0] if self.cuda else self._total
            self._phase_end[name] = current
            self._phase = previous
            self._module_depth = 0

    def _pre_forward(self, module, args):
        self._module_depth += 1

    def _post_forward(self, module, args, output):
        self._module_depth = max(0, self._module_depth - 1)

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._t_start = time.perf_counter()
        self._ops = 0
        self._peak = -1
        self._peak_info = None
        self._phase_peak: dict[str, int] = {}
        self._phase_breakdown: dict[str, Breakdown] = {}
        self._phase_end: dict[str, int] = {}
        self._phase_rss: dict[str, int | None] = {}
        self._timeline: list[tuple] = []
        for p in self.params:
            self._register(p, origin="inputs_buffers")
        if self.model is not None:
            for b in self.model.buffers():
                self._register(b, origin="inputs_buffers")
        self._refresh()  # registers optimizer state and gradients that exist already
        self._rss_before = self._rss.current() if self._rss is not None else None
        self._rss_peak = self._rss_before or 0
        self._hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward),
            # always_call: checkpoint recomputation stops a forward early by raising.
            torch.nn.modules.module.register_module_forward_hook(self._post_forward, always_call=True),
        ]
        if hasattr(self.optimizer, "register_update_hook"):
            # A fusedopt optimizer: mark its updates (also those inside backward, with fused=True).
            self._hooks.append(self.optimizer.register_update_hook(self._update_context))
        # Gradients and optimizer state change without an op of their own (autograd assigns
        # p.grad, optimizers store state): re-classify after each. These hooks run after any
        # registered earlier, e.g. a fusedopt optimizer's gradient release.
        for p in self.params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._mark_dirty))
        if self.optimizer is not None:
            self._hooks.append(self.optimizer.register_step_post_hook(self._mark_dirty))
        if self.cuda:
            self._start_figure = self._allocator()[0]
        else:
            self._start_figure = self._total
        self._start_breakdown = self.breakdown(self._start_figure if self.cuda else None)
        self._last_phase, self._last_figure = None, self._start_figure
        self._resolution = max(4096, self._start_figure // 2000)
        self._t0 = time.perf_counter()
        self._active = True
        return super().__enter__()

    @contextlib.contextmanager
    def _update_context(self):
        """Around one parameter update of the optimizer: what it allocates is the update's (may nest)."""
        self._in_update += 1
        try:
            yield
        finally:
            self._in_update -= 1

    def __exit__(self, exc_type, exc, tb):
        try:
            result = super().__exit__(exc_type, exc, tb)
        finally:
            self._active = False
            for h in self._hooks:
                h.remove()
            self._hooks = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            persistent = self._allocator()[0]
        else:
            persistent = self._total
        rss_after = self._rss.current() if self._rss is not None else None
        if exc_type is None:
            self._result = self._make_result(persistent, rss_after)
        if self._rss is not None:
            self._rss.close()
        return result

    def _make_result(self, persistent: int, rss_after) -> StepMemory:
        if self._peak_info is None:
            self._peak, self._peak_info = self._start_figure, ("outside", "(start)", self._start_breakdown)
        peak_phase, peak_op, peak_bd = self._peak_info
        persistent_bd = self.breakdown(persistent if self.cuda else None)
        if self.cuda:
            method = {
                "peak": "CUDA caching allocator (max_memory_allocated, read after every op)",
                "persistent": "CUDA caching allocator (memory_allocated after the step)",
                "breakdown": "tensor accounting (TorchDispatchMode over live storages); "
                "rest includes allocator bytes not held by any tracked tensor",
            }
        else:
            method = {
                "peak": "tensor accounting (TorchDispatchMode over live storages)",
                "persistent": "tensor accounting (live storages after the step)",
                "breakdown": "tensor accounting (TorchDispatchMode over live storages)",
            }
            method["rss"] = self._rss.method
        if self.opaque_update:
            method["update"] = (
                "not op-tracked (torch.compile runs no dispatch mode): allocator figures at its boundaries"
                + (" and the allocator's peak inside it" if self.cuda else "; its temporaries are not seen on CPU")
            )
        phases = {}
        for name in self._phase_end:
            phases[name] = {
                "peak": self._phase_peak.get(name, 0),
                "end": self._phase_end[name],
                "breakdown": self._phase_breakdown.get(name),
                "rss_peak": self._phase_rss.get(name),
            }
        rss = {}
        if self._rss is not None:
            rss = {
                "before": self._rss_before,
                "peak": max(x for x in (self._rss_peak, self._rss_before, rss_after) if x is not None),
                "after": rss_after,
            }
        return StepMemory(
            device=str(self.device),
            method=method,
            peak=self._peak,
            peak_phase=peak_phase,
            peak_op=peak_op,
            peak_breakdown=peak_bd,
            persistent=persistent,
            persistent_breakdown=persistent_bd,
            start=self._start_figure,
            phases=phases,
            rss=rss,
            timeline=self._timeline,
            num_ops=self._ops,
            seconds=time.perf_counter() - self._t_start,
        )

    def result(self) -> StepMemory:
        if self._result is None:
            raise RuntimeError("no result: run a step inside 'with tracker:' first")
        return self._result


# --- CPU allocator pass ------------------------------------------------------------------------

PHASE_MARK = "fusedopt::phase::"


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (the profiler's native start/stop log lines) for the duration."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_allocator_trace(step_fn) -> dict:
    """Run ``step_fn(phase)`` under ``torch.profiler`` and read the CPU allocator's running total.

    ``phase(name)`` is a context manager that marks a phase. Returns the peak of bytes the
    c10 CPU allocator held beyond what was live when the pass began (allocations made and not
    freed during the step), overall and per phase, and the phase holding the peak. Unlike
    tensor accounting this includes buffers that ops allocate and free internally.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    def phase(name):
        return record_function(PHASE_MARK + name)

    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_fn(phase)
    allocs, ranges = [], []
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        if name == "[memory]":
            if event.device_type() == torch._C._autograd.DeviceType.CPU:
                allocs.append((event.start_ns(), event.nbytes()))
        elif name.startswith(PHASE_MARK):
            start = event.start_ns()
            ranges.append((start, start + event.duration_ns(), name[len(PHASE_MARK) :]))
    allocs.sort(key=lambda a: a[0])  # stable: same-time events keep their order
    live = peak = 0
    peak_phase, phases = None, {}
    for t, nbytes in allocs:
        live += nbytes  # frees are negative; frees of blocks from before the pass count 0
        name = next((n for s, e, n in ranges if s <= t <= e), "outside")
        if live > phases.get(name, 0):
            phases[name] = live
        if live > peak:
            peak, peak_phase = live, name
    return {"peak": peak, "phase": peak_phase, "phases": phases, "events": len(allocs)}
