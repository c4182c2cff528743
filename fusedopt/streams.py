"""CUDA streams: gradient release's hooks run on the stream of their parameter's forward.

Autograd runs each backward node, a parameter's post-accumulate-grad hook included, on the
stream its forward ran on. Work that other streams depend on (a parameter's first state, the
shared correction buffer, held updates) goes to the device's default stream, and a side
stream that is current waits for it (``on_default_stream``): no host synchronisation, and memory
allocated there belongs to the stream that initialised it.
"""

from __future__ import annotations

import contextlib

import torch

_DEFAULT_STREAMS: dict[int, int] = {}  # device index -> raw handle of its default stream


def is_default_stream_current(device: int) -> bool:
    """Whether the current stream of CUDA device ``device`` is its default stream (raw handles: cheap)."""
    default = _DEFAULT_STREAMS.get(device)
    if default is None:
        default = _DEFAULT_STREAMS[device] = torch.cuda.default_stream(device).cuda_stream
    return torch._C._cuda_getCurrentRawStream(device) == default


@contextlib.contextmanager
def on_default_stream(t: torch.Tensor, after_current: bool = False):
    """Run the block on the default stream of ``t``'s device; a current side stream then waits for
    what the block launched. ``after_current``: the block also waits for what the current stream
    launched before (it reads tensors made there). Nothing changes for a CPU tensor or when the
    default stream is current."""
    if not t.is_cuda or is_default_stream_current(t.get_device()):
        yield
        return
    current, default = torch.cuda.current_stream(t.device), torch.cuda.default_stream(t.device)
    if after_current:
        default.wait_stream(current)
    with torch.cuda.stream(default):
        yield
    current.wait_stream(default)


def queued_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor just made) on ``device`` without waiting for the GPU: pinned, so the copy
    is queued rather than awaited (the pinned buffer lives until the copy ran); ``t`` itself on the CPU."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def current_stream_of(t: torch.Tensor) -> torch.cuda.Stream | None:
    """The current stream of ``t``'s device (None for a CPU tensor)."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else None


def ready_on_current_stream(t: torch.Tensor, writer: torch.cuda.Stream | None) -> torch.Tensor:
    """``t``, last written on ``writer``, made safe to use on the current stream.

    The current stream waits for the writer (no host synchronisation), and ``t``'s memory is
    recorded as used on it: freed memory goes back to the stream that allocated it, which could
    otherwise reuse it while this stream still reads it."""
    if writer is not None:
        current = torch.cuda.current_stream(t.device)
        if current != writer:
            current.wait_stream(writer)
            t.record_stream(current)
    return t
