"""bf16 moments with stochastic rounding (``state_bits=16``).

Nearest rounding would freeze the EMA: ``v * 0.999`` rounds back to ``v`` in bf16. Stochastic
rounding keeps the decay exact in expectation.
"""

from __future__ import annotations

import torch

from fusedopt.rounding import round_stochastic

from .base import Family, KernelFormat, MomentCodec


class Bf16Codec(MomentCodec):
    name = "bf16"
    state_bits = 16
    kernel_format = KernelFormat(Family.BF16)

    def zeros(self, shape, device):
        return {"": torch.zeros(shape, dtype=torch.bfloat16, device=device)}

    def decode(self, stored):
        return stored[""].float()

    def encode(self, x, bits):
        return {"": round_stochastic(x, bits(), torch.bfloat16)}


BF16 = Bf16Codec()
