"""The codec interface: how one optimizer-state tensor (a moment) is stored.

A codec turns the fp32 moment into a dict of storage tensors and back. The keys are suffixes
appended to the slot name in the parameter's state (``""`` for a single tensor, e.g.
``state["exp_avg"]``; block codecs keep ``".codes"`` and ``".scales"``). Every codec has a
pure-PyTorch encode/decode: it is the CPU path and the oracle the Triton kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Lazily drawn uniform bits for the elements of the tensor being encoded (int64, uint32 values).
BitsFn = Callable[[], torch.Tensor]


@dataclass(frozen=True, eq=False)
class KernelFormat:
    """How the fused kernel reads and writes a moment (its compile-time switches).

    Compared and hashed by identity (``eq=False``): each codec holds one, and the launch caches key
    on it, so hashing must not walk the fields on every launch.
    """

    fmt: int  # 0 none, 32 fp32, 16 bf16, 8 / 4 block codes, ROTATED + bits rotated codes
    signed: bool = True
    power: int = 1  # levels q**power; negative: minifloat levels with -power mantissa bits
    qmax: int = 0
    k: int = 0
    min_exponent: int = 0
    threshold: int = 0
    top: int = 0
    block: int = 32
    inverse_rescale: float = 0.0  # rotated codes: RotatedCodec.inverse_rescale


NO_MOMENT = KernelFormat(0)
ROTATED = 100  # KernelFormat.fmt of rotated codes (fusedopt.codecs.rotated): ROTATED + bits


class MomentCodec:
    """Interface of a state format; instances are immutable and shared.

    ``name`` is recorded in checkpoints (one name, one stored meaning: never reuse a name for
    another layout or level map). ``kernel_format`` is None where the fused kernel has no branch
    for the format: ``FUSEDOPT_BACKEND=auto`` then runs the reference, ``triton`` refuses.
    """

    name: str
    state_bits: int
    suffixes: tuple[str, ...] = ("",)  # the storage keys, appended to the slot name
    kernel_format: KernelFormat | None = None

    def zeros(self, shape: torch.Size, device: torch.device) -> dict[str, torch.Tensor]:
        """Storage for an all-zero moment."""
        raise NotImplementedError

    def decode(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Storage -> fp32 moment."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, bits: BitsFn) -> dict[str, torch.Tensor]:
        """fp32 moment -> new storage tensors (same keys, dtypes and shapes as ``zeros``)."""
        raise NotImplementedError

    def encode_decayed(
        self, x: torch.Tensor, bits: BitsFn, previous: dict[str, torch.Tensor], decay: float
    ) -> dict[str, torch.Tensor]:
        """``encode(x)`` in an update where ``x = decay * decode(previous) + increment`` (an EMA;
        ``previous``: the storage before the update, still unchanged). A format may use it to keep
        the decay exact and round only the increment; the default ignores it."""
        return self.encode(x, bits)

    def layout(self, shape: torch.Size) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """Expected dtype and shape of each storage tensor (used to validate checkpoints)."""
        return {k: (t.dtype, t.shape) for k, t in self.zeros(shape, torch.device("meta")).items()}

    def bytes_per_element(self, shape: torch.Size) -> float:
        """Stored bytes per element of a moment of ``shape`` (scales included)."""
        numel = max(1, torch.Size(shape).numel())
        return sum(dtype.itemsize * size.numel() for dtype, size in self.layout(shape).values()) / numel

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
