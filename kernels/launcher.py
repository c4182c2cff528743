"""Launch a Triton kernel's compiled binary directly once Triton has compiled it.

``kernel[grid](...)`` binds and specialises every argument on every call: on the H200 host
that cost ~37 us per launch for our kernels' ~45 arguments, and one parameter's update is
two launches, most of the host time per parameter (benchmarks/launch_overhead.py). A
:class:`DirectLauncher` sends the first launch of each specialisation through Triton (which
compiles or finds the binary) and later ones straight to the compiled kernel's launcher.

Its cache key holds everything Triton specialises on: each tensor's dtype and 16-byte
alignment; each integer's width and whether it is 1 or a multiple of 16; the constexprs and
compile options; the device. So a binary is reused only where Triton would reuse it.

Plain ``kernel[grid](...)`` is used instead under the interpreter, when Triton's launch hooks
are set (profilers such as proton want to see every launch), on a device that is not the
current one, when ``FUSEDOPT_DIRECT_LAUNCH=0``, and on a Triton whose compiled kernels lack
the interface used here (checked once, at the first launch).
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


def _arg_class(value):
    """What Triton specialises a runtime argument on (its type and divisibility classes)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
        return width, value == 1, value % 16 == 0
    if isinstance(value, float):
        return float
    return type(value)


class DirectLauncher:
    """``launcher(grid, runtime_args, config)`` for one ``@triton.jit`` function.

    ``runtime_args``: the non-constexpr arguments in signature order; ``config``: a
    :class:`LaunchConfig` (constexprs and compile options, hashed once).
    """

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)
        self.names = [p.name for p in params] if params else []
        self.runtime_names = [p.name for p in params if not p.is_constexpr] if params else []
        self.constexpr_names = self.names[len(self.runtime_names) :]
        self.compiled: dict = {}  # key -> (compiled kernel, constexpr values in signature order)
        # the compiled launcher takes every argument in signature order: runtime ones, then
        # constexprs (the layout of fusedopt's kernels; any other layout launches through Triton)
        runtime_first = self.names[: len(self.runtime_names)] == self.runtime_names
        self.usable = DIRECT_LAUNCH and bool(params) and runtime_first and hasattr(fn, "device_caches")
        self._knobs = _runtime_knobs()

    def __call__(self, grid: int, runtime_args: tuple, config: LaunchConfig) -> None:
        device = self._device(runtime_args[0])
        if device is None or self._hooks_set():
            self._launch_through_triton(grid, runtime_args, config)
            return
        if device != torch.cuda.current_device():
            with torch.cuda.device(device):
                self._launch_through_triton(grid, runtime_args, config)
            return
        key = (config.key, device, tuple(map(_arg_class, runtime_args)))
        entry = self.compiled.get(key)
        if entry is None:
            kernel = self._launch_through_triton(grid, runtime_args, config)
            if not all(hasattr(kernel, name) for name in ("run", "function", "packed_metadata")):
                self.usable = False  # a Triton without this interface: always launch through it
                return
            kernel.run  # noqa: B018  (loads the binary: sets kernel.function)
            self.compiled[key] = kernel, tuple(config.constexprs[name] for name in self.constexpr_names)
            return
        kernel, constexpr_values = entry
        values = runtime_args + constexpr_values
        stream = self._stream(device)
        kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, *self._hooks(), *values)

    def _device(self, first: torch.Tensor) -> int | None:
        """The CUDA device index of a direct launch (None: launch through Triton)."""
        return first.device.index if self.usable and first.is_cuda else None

    @staticmethod
    def _stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def _hooks_set(self) -> bool:
        knobs = self._knobs
        return knobs is not None and (_active(knobs.launch_enter_hook) or _active(knobs.launch_exit_hook))

    def _hooks(self) -> tuple:
        """The hook values Triton itself hands the compiled launcher (None, or an empty chain)."""
        knobs = self._knobs
        return (None, None) if knobs is None else (knobs.launch_enter_hook, knobs.launch_exit_hook)

    def _launch_through_triton(self, grid: int, runtime_args: tuple, config: LaunchConfig):
        return self.fn[(grid,)](*runtime_args, **config.constexprs, **config.options)


class LaunchConfig:
    """The compile-time part of a launch: constexprs by name and compile options such as
    ``num_warps``, with their cache key computed once."""

    __slots__ = ("constexprs", "options", "key")

    def __init__(self, constexprs: dict, options: dict):
        self.constexprs = constexprs
        self.options = options
        self.key = (tuple(sorted(constexprs.items())), tuple(sorted(options.items())))
