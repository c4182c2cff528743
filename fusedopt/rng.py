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
    return element_bits(h, idx, beyond_32_bits=shape.numel() > 1 << 32)


def _signed32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


_C1_I32, _C2_I32, _GOLDEN_I32 = _signed32(_C1), _signed32(_C2), _signed32(GOLDEN)


def _fmix32_int32(h: torch.Tensor) -> torch.Tensor:
    """fmix32 on int32 tensors holding the uint32 bit patterns.

    int32 multiplication wraps modulo 2**32, which is uint32 multiplication on the same bits;
    shifts are made logical by masking the sign extension. Several times faster than the int64
    emulation; tests/test_rng.py checks both against exact integer arithmetic.
    """
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _C1_I32
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _C2_I32
    return h ^ ((h >> 16) & 0xFFFF)


def element_bits(h, idx: torch.Tensor, beyond_32_bits: bool = True) -> torch.Tensor:
    """Bits of elements ``idx`` (int64 row-major indices) under the per-step hash ``h`` (int64 result).

    ``beyond_32_bits=False`` promises every index is below 2**32 (skips the high part, which is 0).
    """
    h32 = (torch.as_tensor(h, device=idx.device).to(torch.int64) & MASK32).to(torch.int32)  # wraps to the bits
    lo = idx.to(torch.int32)  # the low 32 bits
    x = h32 ^ lo
    if beyond_32_bits:
        x = x + (idx >> 32).to(torch.int32) * _GOLDEN_I32
    return _fmix32_int32(x).to(torch.int64) & MASK32


def step_hash(key: int, step: torch.Tensor) -> torch.Tensor:
    """The per-step part of the hash (a 0-d int64 tensor on the step's device)."""
    return fmix32((step.to(torch.int64).reshape(()) & MASK32) ^ key)
