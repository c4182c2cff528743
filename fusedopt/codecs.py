"""Moment codecs: how one optimizer-state tensor (a moment) is stored.

A codec turns the fp32 moment into a dict of storage tensors and back. The keys are
suffixes appended to the slot name in the parameter's state (``""`` for a single tensor,
e.g. ``state["exp_avg"]``; the block-quantized codecs of ``codec_blockwise`` keep
``".codes"`` and ``".scales"``).
Every codec has a pure-PyTorch encode/decode: it is the CPU path and the reference the
Triton kernels are tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .rounding import round_stochastic

# Lazily drawn uniform bits for the elements of the tensor being encoded (int64, uint32 values).
BitsFn = Callable[[], torch.Tensor]


class MomentCodec:
    """Interface; subclasses are stateless and shared."""

    state_bits: int
    suffixes: tuple[str, ...] = ("",)  # the storage keys, appended to the slot name

    def zeros(self, shape: torch.Size, device: torch.device) -> dict[str, torch.Tensor]:
        """Storage for an all-zero moment."""
        raise NotImplementedError

    def decode(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Storage -> fp32 moment."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, bits: BitsFn) -> dict[str, torch.Tensor]:
        """fp32 moment -> new storage tensors (same keys, dtypes and shapes as ``zeros``)."""
        raise NotImplementedError

    def layout(self, shape: torch.Size) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """Expected dtype and shape of each storage tensor (used to validate checkpoints)."""
        return {k: (t.dtype, t.shape) for k, t in self.zeros(shape, torch.device("meta")).items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Fp32Codec(MomentCodec):
    """Exact fp32 moments (``state_bits=32``, and small or 1-D tensors under any setting)."""

    state_bits = 32

    def zeros(self, shape, device):
        return {"": torch.zeros(shape, dtype=torch.float32, device=device)}

    def decode(self, stored):
        return stored[""]

    def encode(self, x, bits):
        return {"": x.float()}


class Bf16Codec(MomentCodec):
    """bf16 moments with stochastic rounding (``state_bits=16``).

    Nearest rounding would freeze the EMA: ``v * 0.999`` rounds back to ``v`` in bf16.
    Stochastic rounding keeps the decay exact in expectation.
    """

    state_bits = 16

    def zeros(self, shape, device):
        return {"": torch.zeros(shape, dtype=torch.bfloat16, device=device)}

    def decode(self, stored):
        return stored[""].float()

    def encode(self, x, bits):
        return {"": round_stochastic(x, bits(), torch.bfloat16)}


FP32 = Fp32Codec()
BF16 = Bf16Codec()

# Moments that are never negative (an unsigned code spends its sign bit on precision).
NONNEGATIVE_SLOTS = ("exp_avg_sq",)

SUPPORTED_STATE_BITS = (32, 16, 8, 4)


@functools.lru_cache(maxsize=4096)
def codec_for(state_bits: int, shape: torch.Size, min_compress_numel: int, *, signed: bool = True) -> MomentCodec:
    """The codec of a moment of a parameter with ``shape`` under a group's settings.

    Small tensors and 1-D tensors (norms, biases) keep exact fp32 moments: they are a
    negligible share of memory and the most sensitive to quantisation. 8 and 4 bits are the
    block-quantized codecs of ``codec_blockwise`` (one instance per shape: 4-bit codes are
    packed, so decode needs the element count). ``signed=False`` marks a moment that is
    never negative (AdamW's second moment).
    """
    if state_bits == 32 or len(shape) < 2 or shape.numel() < min_compress_numel:
        return FP32
    if state_bits == 16:
        return BF16
    if state_bits in (8, 4):
        from .codec_blockwise import block_codec  # imports this module (MomentCodec)

        return block_codec(state_bits, signed, torch.Size(shape))
    raise ValueError(f"Invalid state_bits: {state_bits!r} (expected 32, 16, 8 or 4)")
