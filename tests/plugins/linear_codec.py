"""A linear 8-bit state format (test only): blocks of 64 values, an fp32 absmax scale per block,
codes ``round(x / scale * 127)`` with stochastic rounding; a nonnegative moment never rounds a
nonzero value to 0 (Adam would step by m / eps). No kernel branch: the reference runs it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedopt.codecs import MomentCodec, register_codec

BLOCK = 64
NAME = "test-linear8"


class Linear8Codec(MomentCodec):
    name = NAME
    state_bits = 8
    suffixes = (".codes", ".scales")

    def __init__(self, signed: bool, shape: torch.Size):
        self.signed, self.shape = signed, torch.Size(shape)

    def _blocks(self, shape) -> int:
        return -(-torch.Size(shape).numel() // BLOCK)

    def zeros(self, shape, device):
        return {
            ".codes": torch.zeros(shape, dtype=torch.int8, device=device),
            ".scales": torch.zeros(self._blocks(shape), dtype=torch.float32, device=device),
        }

    def decode(self, stored):
        n, nb = self.shape.numel(), self._blocks(self.shape)
        codes = F.pad(stored[".codes"].reshape(-1).float(), (0, nb * BLOCK - n)).view(nb, BLOCK)
        return (codes * (stored[".scales"] / 127).unsqueeze(1)).reshape(-1)[:n].reshape(self.shape)

    def encode(self, x, bits):
        n, nb = self.shape.numel(), self._blocks(self.shape)
        blocks = F.pad(x.reshape(-1).float(), (0, nb * BLOCK - n)).view(nb, BLOCK)
        scales = blocks.abs().amax(dim=1)
        t = (blocks * (127 / torch.where(scales > 0, scales, 1.0)).unsqueeze(1)).reshape(-1)[:n]
        # stochastic rounding to integers: round_stochastic to bf16 would not give integer levels
        u = (bits().reshape(-1).to(torch.float64) / 2**32).to(torch.float32)
        codes = torch.floor(t + u).clamp(-127, 127)
        if not self.signed:
            codes = torch.where((codes == 0) & (t > 0), 1.0, codes)
        return {".codes": codes.to(torch.int8).reshape(self.shape), ".scales": scales}


register_codec(NAME, Linear8Codec)
