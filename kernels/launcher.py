"""Launch a Triton kernel's compiled binary directly once Triton has compiled it.

``kernel[grid](...)`` binds and specialises every argument on every call: for our kernels'
~45 arguments that is most of the host time of a parameter's update, which is two launches
(benchmarks/launch_overhead.py at commit 7d4d420, figures in benchmarks/RESULTS.md). A
:class:`DirectLauncher` sends the first launch of each specialisation through Triton (which
compiles or finds the binary) and later ones straight to the compiled kernel's launcher.

Its cache key holds everything Triton specialises on: each tensor's dtype and 16-byte
alignment; each integer's width and whether it is 1 or a multiple of 16; the constexprs and
compile options; the device (floats are always fp32). So a binary is reused only where Triton
would reuse it.

Plain ``kernel[grid](...)`` is used instead under the interpreter, when Triton's launch hooks
are set (profilers such as proton want to see every launch), on a device that is not the
current one, when ``FUSEDOPT_DIRECT_LAUNCH=0``, and on a Triton whose compiled kernels lack
the interface used here (checked once, at the first launch).

Building the key is itself ~7 us of Python per launch. Callers that launch the same tensors
again and again (a parameter's prepared update, a bucket) keep the resolved launch instead
(``launch_remembered``) and build the key only for what can change between their launches.
"""

from __future__ import annotations

import os

import torch

DIRECT_LAUNCH = os.environ.get("FUSEDOPT_DIRECT_LAUNCH", "1").strip() != "0"


def _runtime_knobs():
    try:
        from triton import knobs

        return knobs.runtime
    except ImportError:  # older Triton: no launch hooks to respect through knobs
        return None


def _active(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6 holds None or a function, 3.9 a chain of them."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _int_class(value: int):
    """What Triton specialises an integer argument on: its width, == 1, divisible by 16."""
    width = "i32" if -(2**31) <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
    return width, value == 1, not value & 15


def _layout_matches(runtime_args: tuple, tensors: int, ints: int) -> bool:
    """Whether the arguments are ``tensors`` tensors, then ``ints`` ints, then Python floats."""
    head, middle, tail = runtime_args[:tensors], runtime_args[tensors : tensors + ints], runtime_args[tensors + ints :]
    return (
        all(isinstance(t, torch.Tensor) for t in head)
        and all(type(v) is int for v in middle)
        and all(type(v) is float for v in tail)
    )


def _raw_stream_getter():
    """The current CUDA stream as an integer handle, as Triton's own launch reads it."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter
    return lambda device: torch.cuda.current_stream(device).cuda_stream


class DirectLauncher:
    """``launcher(grid, runtime_args, config)`` for one ``@triton.jit`` function.

    ``runtime_args``: the non-constexpr arguments in signature order, laid out as ``tensors``
    tensors, then ``ints`` Python ints, then Python floats (so the key is built by position,
    with no type dispatch per argument; another layout launches through Triton); ``config``: a
    :class:`LaunchConfig` (constexprs and compile options, hashed once). The last
    ``unkeyed_ints`` ints stay out of the key: the caller guarantees they are ``do_not_specialize``
    arguments whose values are always in int64 range, so Triton types them alike.
    """

    def __init__(self, fn, tensors: int, ints: int, unkeyed_ints: int = 0):
        self.fn = fn
        self.tensors, self.ints = tensors, ints
        self.keyed_ints = ints - unkeyed_ints
        params = getattr(fn, "params", None) or []
        names = [p.name for p in params]
        runtime_names = [p.name for p in params if not p.is_constexpr]
        self.constexpr_names = names[len(runtime_names) :]
        self.compiled: dict = {}  # key -> (compiled kernel, constexpr values in signature order)
        # the compiled launcher takes every argument in signature order: runtime ones, then
        # constexprs (the layout of fusedopt's kernels; any other layout launches through Triton)
        runtime_first = names[: len(runtime_names)] == runtime_names
        self.usable = DIRECT_LAUNCH and bool(params) and runtime_first and hasattr(fn, "device_caches")
        self._knobs = _runtime_knobs()

    def __call__(self, grid: int, runtime_args: tuple, config: LaunchConfig) -> None:
        device = self._device(runtime_args[0])
        hooks = self._hooks()
        if device is None or _active(hooks[0]) or _active(hooks[1]):
            self._launch_through_triton(grid, runtime_args, config)
            return
        if device != torch.cuda.current_device():
            with torch.cuda.device(device):
                self._launch_through_triton(grid, runtime_args, config)
            return
        key = self._key(device, runtime_args, config)
        entry = self.compiled.get(key)
        if entry is None:
            kernel = self._launch_through_triton(grid, runtime_args, config)
            interface = all(hasattr(kernel, name) for name in ("run", "function", "packed_metadata"))
            unkeyed = runtime_args[self.tensors + self.keyed_ints : self.tensors + self.ints]
            if not (
                interface
                and _layout_matches(runtime_args, self.tensors, self.ints)
                and all(2**31 <= v < 2**63 for v in unkeyed)
            ):
                self.usable = False  # always launch through Triton from now on
                return
            kernel.run  # noqa: B018  (loads the binary: sets kernel.function)
            self.compiled[key] = kernel, tuple(config.constexprs[name] for name in self.constexpr_names)
            return
        kernel, constexpr_values = entry
        values = runtime_args + constexpr_values
        stream = self._stream(device)
        kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, *hooks, *values)

    def resolve(self, runtime_args: tuple, config: LaunchConfig) -> tuple | None:
        """The direct launch that these arguments select, once compiled, for :meth:`launch_resolved`.

        For a caller whose later launches keep every keyed property of these (each tensor's
        dtype and 16-byte alignment, each keyed int's class, the configuration, the device):
        they then skip building the key, ~7 us of Python per launch. None: no direct launch (yet).
        """
        device = self._device(runtime_args[0])
        entry = None if device is None else self.compiled.get(self._key(device, runtime_args, config))
        return None if entry is None else (self, device, *entry)

    def launch_resolved(self, resolved: tuple, grid: int, runtime_args: tuple) -> bool:
        """Launch ``resolved`` (from :meth:`resolve`) with these values. False, launching nothing:
        this launch must go through ``__call__`` (direct launches turned off, launch hooks set,
        another current device, or an entry of another launcher)."""
        owner, device, kernel, constexpr_values = resolved
        hooks = self._hooks()
        if owner is not self or not self.usable or _active(hooks[0]) or _active(hooks[1]):
            return False
        if device != torch.cuda.current_device():
            return False
        values = runtime_args + constexpr_values
        kernel.run(grid, 1, 1, self._stream(device), kernel.function, kernel.packed_metadata, None, *hooks, *values)
        return True

    def _key(self, device: int, runtime_args: tuple, config: LaunchConfig) -> tuple:
        """What Triton specialises these arguments on (see the module's docstring)."""
        tensors, ints = runtime_args[: self.tensors], runtime_args[self.tensors : self.tensors + self.keyed_ints]
        return (
            config.key,
            device,
            tuple([t.dtype for t in tensors]),
            tuple([not t.data_ptr() & 15 for t in tensors]),  # Triton's 16-byte alignment hint
            tuple([_int_class(i) for i in ints]),
        )

    def _device(self, first: torch.Tensor) -> int | None:
        """The CUDA device index of a direct launch (None: launch through Triton)."""
        return first.device.index if self.usable and first.is_cuda else None

    _stream = staticmethod(_raw_stream_getter())

    def _hooks(self) -> tuple:
        """The hook values Triton itself hands the compiled launcher (None, or an empty chain)."""
        knobs = self._knobs
        return (None, None) if knobs is None else (knobs.launch_enter_hook, knobs.launch_exit_hook)

    def _launch_through_triton(self, grid: int, runtime_args: tuple, config: LaunchConfig):
        return self.fn[(grid,)](*runtime_args, **config.constexprs, **config.options)


def launch_remembered(launcher, remembered: dict, variant, grid: int, runtime_args: tuple, config: LaunchConfig):
    """``launcher(grid, runtime_args, config)`` for a caller that keeps its launches' resolved
    direct launch in ``remembered``, one per ``variant``: the caller's summary of everything in
    the key that can differ between its launches (the rest must stay fixed)."""
    resolved = remembered.get(variant)
    if resolved is not None and launcher.launch_resolved(resolved, grid, runtime_args):
        return
    launcher(grid, runtime_args, config)
    remembered[variant] = launcher.resolve(runtime_args, config)


class LaunchConfig:
    """The compile-time part of a launch: constexprs by name and compile options such as
    ``num_warps``, with their cache key computed once."""

    __slots__ = ("constexprs", "options", "key")
    _ids: dict = {}  # (constexprs, options) -> a small int: hashing that is free at launch time

    def __init__(self, constexprs: dict, options: dict):
        self.constexprs = constexprs
        self.options = options
        full = (tuple(sorted(constexprs.items())), tuple(sorted(options.items())))
        self.key = LaunchConfig._ids.setdefault(full, len(LaunchConfig._ids))
