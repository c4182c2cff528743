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
def on_default_stream(t: torch.Tensor):
    """Run the block on the default stream of ``t``'s device; a current side stream then waits for
    what the block launched. Nothing changes for a CPU tensor or when the default stream is current."""
    if not t.is_cuda or is_default_stream_current(t.get_device()):
        yield
        return
    current, default = torch.cuda.current_stream(t.device), torch.cuda.default_stream(t.device)
    with torch.cuda.stream(default):
        yield
    current.wait_stream(default)


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


# Parameters of at least this many elements get their finite check ahead in step() (CheckStreams).
# The same size from which kernels/bucket.py launches a parameter alone: its update (~70 us and
# up on the H200) is long against the host's few microseconds of stream and event calls.
CHECK_AHEAD_NUMEL = 1 << 24


class CheckStreams:
    """High-priority side streams on which ``step()`` runs large parameters' finite checks ahead.

    A large parameter's update kernel is bound by instruction issue and leaves memory bandwidth
    unused; its finite check (kernels/update.py) only reads the gradient. In one stream every
    check waits for the update before it. On a side stream the host's launches run ahead of the
    GPU, so the next parameters' checks run while an update runs, and each update waits for its
    own check's event only. The side stream waits for the current stream once per step (before
    its first check: the gradients are ready there); the current stream waits for every check,
    so the caller's later work, freeing the gradients included, comes after them.
    """

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._joined: set[int] = set()  # devices whose side stream waited for this step's current stream

    def new_step(self) -> None:
        self._joined.clear()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """``device``'s side stream, after the current stream's work queued before this step's first check."""
        index = device.index
        side = self._streams.get(index)
        if side is None:
            side = self._streams[index] = torch.cuda.Stream(device, priority=-1)  # lower: higher priority
        if index not in self._joined:
            side.wait_stream(torch.cuda.current_stream(device))
            self._joined.add(index)
        return side
