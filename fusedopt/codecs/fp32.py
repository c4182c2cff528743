"""Exact fp32 moments (``state_bits=32``, and small or 1-D tensors under any setting)."""

from __future__ import annotations

import torch

from .base import Family, KernelFormat, MomentCodec


class Fp32Codec(MomentCodec):
    name = "fp32"
    state_bits = 32
    kernel_format = KernelFormat(Family.FP32)

    def zeros(self, shape, device):
        return {"": torch.zeros(shape, dtype=torch.float32, device=device)}

    def decode(self, stored):
        return stored[""]

    def encode(self, x, bits):
        return {"": x.float()}


FP32 = Fp32Codec()
