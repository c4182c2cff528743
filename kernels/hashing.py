"""Counter-based hash in Triton, bit-identical to the PyTorch reference ``fusedopt.rng``.

Same key layout as the reference (see its docstring): the host part arrives as one uint32
scalar, the step is loaded from its device tensor by the caller, the element index is the row-major
int64 offset. Native uint32 arithmetic wraps modulo 2**32, which the reference emulates.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def fmix32(h):
    """Murmur3 32-bit finaliser on uint32 values."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def step_hash(key, step):
    """Fold the parameter's step count (the fp32 value loaded from its 0-d tensor) into the host key."""
    return fmix32(step.to(tl.int64).to(tl.uint32) ^ key.to(tl.uint32))


@triton.jit
def element_bits(h, offsets):
    """32 uniform bits for int64 element ``offsets`` under the per-step hash ``h``."""
    if offsets.dtype == tl.int64:
        lo = (offsets & 0xFFFFFFFF).to(tl.uint32)
        hi = (offsets >> 32).to(tl.uint32)
        x = (h ^ lo) + hi * 0x9E3779B9
    else:  # int32 offsets (tensors below 2**31 elements): the high part is 0
        x = h ^ offsets.to(tl.uint32)
    return fmix32(x)


@triton.jit
def second_word(shared):
    """``fusedopt.rng.second_word``: the second moment's whole word from the shared word (uint32)."""
    return (shared ^ (shared >> 16)) * 0x9E3779B9


@triton.jit
def shared_word_fields(shared, PARAM_BITS: tl.constexpr):
    """``rng.UpdateDraws``' split of the shared word between a whole-word first moment and a parameter taking
    ``PARAM_BITS`` (0: none, 8 or 16) low bits: (the moment's word, the parameter's field moved to the top)."""
    tl.static_assert((PARAM_BITS == 0) | (PARAM_BITS == 8) | (PARAM_BITS == 16), "0, 8 or 16 bits")
    if PARAM_BITS == 16:
        moment = (shared >> 16) << 16
    else:
        moment = shared
    return moment, shared << ((32 - PARAM_BITS) % 32)


@triton.jit
def tile_bits(h, start, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """``element_bits`` of the [NB, QBLOCK] tile at ``start`` (``moments.tile_offsets``), the same bits.

    fmix32's first step, x ^ (x >> 16) with x = h ^ offset, is (h ^ (h >> 16)) ^ (row >> 16) ^ offset
    for the tile's offsets row + c: a row starts at a multiple of QBLOCK <= 2**16 and c < QBLOCK,
    so offset >> 16 == row >> 16. Once per row, not per element.
    """
    rows = start + tl.arange(0, NB)[:, None] * QBLOCK
    cols = tl.arange(0, QBLOCK)[None, :]
    offsets = rows + cols
    if offsets.dtype == tl.int64:
        return element_bits(h, offsets)
    row_key = (h ^ (h >> 16)) ^ (rows.to(tl.uint32) >> 16)
    # row + c == row ^ c (a row starts at a multiple of QBLOCK), and c is a thread's 16-aligned
    # base plus a constant: x is one xor per element with an immediate, not an add and an xor
    x = (row_key ^ rows.to(tl.uint32) ^ (cols & -16).to(tl.uint32)) ^ (cols & 15).to(tl.uint32)
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _uniform_bits_kernel(
    out_ptr,  # int64 output, one uint32 value per element
    step_ptr,  # 0-d step tensor
    key,  # host part of the key (uint32)
    first,  # element index of out[0] (int64)
    n_elements,  # number of elements
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    local = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = local < n_elements
    bits = element_bits(step_hash(key, tl.load(step_ptr)), local + first)
    tl.store(out_ptr + local, bits.to(tl.int64), mask=mask)


def launch_uniform_bits(key: int, step: torch.Tensor, numel: int, device, first: int = 0) -> torch.Tensor:
    """The hash of elements ``first .. first + numel - 1`` (tests only: kernels draw bits in registers)."""
    out = torch.empty(numel, dtype=torch.int64, device=device)
    if numel == 0:
        return out
    block = 1024
    _uniform_bits_kernel[(triton.cdiv(numel, block),)](out, step, key, first, numel, BLOCK=block)
    return out
