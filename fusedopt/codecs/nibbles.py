"""Blocks of 4-bit codes of a nonnegative moment: the storage of the root grid (``rootgrid.py``), which
adds its per-block tensors, its levels and its rounding.

* **Blocks** of ``BLOCK`` = 128 elements of the moment flattened in row-major order; the last one is
  padded with zeros.
* **Codes** (``<slot>.codes``, uint8, shape ``(64 * blocks,)``): a 4-bit index per element, two per
  byte, element ``2i`` in the low nibble.
* **Values to encode**: saturated at ``BIG`` (inf there, NaN as 0), at least 0.
* **Draws**: a whole hash word per element, of which the top 23 bits make a uniform
  (``rng.top_uniform``; ``whole_word``): an increment of an EMA is often a thousandth of the gap between
  two levels, far below what a 12-bit field resolves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedopt import rng

from .base import BitsFn, MomentCodec

BLOCK = 128
BIG = 2.0**100  # values are saturated here (inf: here, NaN: 0)


class NibbleBlockCodec(MomentCodec):
    """A nonnegative moment in blocks of 128 4-bit codes; a subclass names its per-block tensors
    (``block_tensors``) and implements the levels and the rounding."""

    state_bits = 4
    block = BLOCK
    block_tensors: dict[str, torch.dtype] = {}  # suffix -> dtype of one value per block
    whole_word = True

    def __init__(self, shape: torch.Size, name: str):
        self.name = name
        self.shape = torch.Size(shape)
        self.numel = self.shape.numel()
        self.blocks = max(1, -(-self.numel // BLOCK))

    def layout(self, shape):
        blocks = max(1, -(-torch.Size(shape).numel() // BLOCK))
        per_block = {s: (dtype, torch.Size([blocks])) for s, dtype in self.block_tensors.items()}
        return {".codes": (torch.uint8, torch.Size([blocks * BLOCK // 2])), **per_block}

    def zeros(self, shape, device):
        return {s: torch.zeros(size, dtype=dtype, device=device) for s, (dtype, size) in self.layout(shape).items()}

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        pairs = codes.reshape(-1, 2).to(torch.int32)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        c = packed.to(torch.int32)
        return torch.stack((c & 0xF, c >> 4), dim=1).reshape(self.blocks, BLOCK)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` flat, zero-padded to whole blocks, ``(blocks, 128)``."""
        return F.pad(x.reshape(-1), (0, self.blocks * BLOCK - self.numel)).view(self.blocks, BLOCK)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """The moment to encode, saturated (NaN: 0), at least 0, padded to whole blocks."""
        return self.padded(x.float().nan_to_num(0.0, BIG, 0.0).clamp(0.0, BIG))

    def uniforms(self, bits: BitsFn) -> torch.Tensor:
        """One uniform in [0, 1) per element, ``(blocks, 128)`` (padding: 0, never used)."""
        return self.padded(rng.top_uniform(bits().reshape(-1)))

    def decode_blocks(self, stored) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 codes, fp32 values), each ``(blocks, 128)``."""
        raise NotImplementedError

    def decode(self, stored):
        return self.decode_blocks(stored)[1].reshape(-1)[: self.numel].reshape(self.shape)
