"""Stochastic rounding from fp32 to bf16 / fp16, driven by the counter-based hash.

Rounding to nearest loses every change smaller than half a unit in the last place: a bf16
moment multiplied by 0.999 never moves, and an update of a tenth of an ulp never lands.
Stochastic rounding picks one of the two neighbours with probability proportional to
closeness, so the rounded value equals the fp32 value in expectation.
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def round_stochastic(x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype`` (bf16 or fp16) with uniform 32-bit ``bits`` (int64 tensor).

    bf16: add the top 16 bits of the draw below the bf16 mantissa of the fp32 pattern, then
    truncate (sign-magnitude, so this rounds the magnitude up with the right probability; inf
    stays inf). fp16: take the nearest fp16 value and its neighbour on the other side of ``x``,
    and pick the upper one with probability (x - lo) / (hi - lo), against the top 24 bits.
    """
    x = x.float()
    if dtype == torch.float32:
        return x
    if dtype == torch.bfloat16:
        r = (bits >> 16).to(torch.int32)
        pattern = (x.view(torch.int32) + r) & -0x10000
        return pattern.view(torch.float32).to(torch.bfloat16)
    if dtype == torch.float16:
        near = x.to(torch.float16)
        near32 = near.float()
        toward = torch.where(x > near32, float("inf"), float("-inf")).to(torch.float16)
        other = torch.nextafter(near, toward)
        lo = torch.minimum(near, other).float()
        hi = torch.maximum(near, other).float()
        p_hi = ((x - lo) / (hi - lo)).nan_to_num(0.0)
        u = (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))
        pick = torch.where(u < p_hi, hi, lo)
        # exact values (and non-finite ones) keep their nearest rounding
        return torch.where((near32 == x) | ~torch.isfinite(x), near32, pick).to(torch.float16)
    raise TypeError(f"stochastic rounding to {dtype} is not supported")
