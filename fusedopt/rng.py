"""Counter-based randomness: (seed, stream, parameter index, step, element index) -> 32 uniform bits.

All randomness in fusedopt (stochastic rounding of state, of parameters written without a
correction term, and of accumulated low-precision gradients) comes from this hash. There are
no random buffers and the global RNG is never touched, so a run is a pure function of its
seed and resuming from a checkpoint continues the same trajectory.

The hash is built from murmur3's 32-bit finaliser (``fmix32``) only: xor, logical shifts
and multiplication modulo 2**32. ``fusedopt.kernels.hashing`` writes the same function in
Triton with native uint32 arithmetic, and the two agree bit for bit (tests/test_rng.py).
Here, in plain PyTorch, values live in int64 tensors (torch has no general uint32
arithmetic) and every product is split into 16-bit halves so no intermediate overflows.

Layout of the key:
  host  = fmix32(fmix32(fmix32(seed ^ GOLDEN) ^ param_index) ^ stream)   (Python ints)
  h     = fmix32(host ^ step)                                             (step: device tensor)
  bits  = fmix32((h ^ idx_lo) + idx_hi * GOLDEN)                          (per element)
One finaliser per element and stream keeps the kernel's integer work small (it is memory-bound
only while the arithmetic stays cheap); fmix32 is a bijection with full avalanche, so
consecutive indices give independent-looking bits.
``step`` stays a device tensor (a skipped update leaves it unchanged without a host sync).
"""

from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
_C1 = 0x85EBCA6B
_C2 = 0xC2B2AE35

# Streams keep the draws of different roundings in one step independent.
STREAM_PARAM = 1  # parameter written with stochastic rounding (no correction term)
STREAM_STATE = 16  # + slot index: moment tensors (exp_avg, exp_avg_sq, momentum_buffer, ...)
STREAM_GRAD_ACCUM = 1 << 20  # + micro-batch index: low-precision gradient accumulation


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), without leaving int64 (works on ints and tensors)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def fmix32(h):
    """Murmur3 32-bit finaliser on a Python int or an int64 tensor holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=65536)
def host_key(seed: int, param_index: int, stream: int) -> int:
    """The part of the key known on the host; passed to kernels as one uint32 scalar."""
    h = fmix32((seed & MASK32) ^ GOLDEN)
    h = fmix32(h ^ (param_index & MASK32))
    return fmix32(h ^ (stream & MASK32))


def uniform_bits(key: int, step: torch.Tensor, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """32 uniform bits per element of a tensor of ``shape`` (row-major element index), as int64.

    ``step`` is a 0-d tensor (any real dtype) holding the parameter's step count.
    """
    h = step_hash(key, step.to(device))
    idx = torch.arange(shape.numel(), dtype=torch.int64, device=device).reshape(shape)
    return element_bits(h, idx)


def element_bits(h, idx: torch.Tensor) -> torch.Tensor:
    """Bits of elements ``idx`` (int64 row-major indices) under the per-step hash ``h``."""
    return fmix32(((h ^ (idx & MASK32)) + _mul32(idx >> 32, GOLDEN)) & MASK32)


def step_hash(key: int, step: torch.Tensor) -> torch.Tensor:
    """The per-step part of the hash (a 0-d int64 tensor on the step's device)."""
    return fmix32((step.to(torch.int64).reshape(()) & MASK32) ^ key)
