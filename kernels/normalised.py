"""Normalised first moments inside the update kernel (the codec ``norm2``).

Device twin of ``fusedopt.codecs.normalised`` (its docstring defines the format): ``m`` stored in
units of ``r = sqrt(v)``, ``v`` the frame as decoded (the root-grid second moment, ``rootgrid.py``):
the one before the update for the decode, the one just stored for the encode. The update's tile is
viewed as ``[R, 64]``, one block per row. The same operations in the same order as the reference,
so the interpreter agrees with it bit for bit: correctly rounded divisions and square roots
(``div_rn``, ``sqrt_rn``, ``third``, ``reciprocal_rn``), the block's sum of squares in the reference's
order (``neighbour_sums``), the scale rounded up to bf16 in integer arithmetic, the reference's draws
(zero past the tensor's end, where the padding's codes are still stored).
"""

import triton
import triton.language as tl

from fusedopt.kernels.moments import (
    approximate_div,
    block_rows,
    commit_mask,
    floor_truncating,
    reciprocal_rn,
    saturated_product,
)

BLOCK = tl.constexpr(64)  # elements per block (fusedopt.codecs.normalised.BLOCK)
_BIG = tl.constexpr(2.0**60)  # the reference's saturation of q
_TINY = tl.constexpr(1e-30)  # the reference's divisor of a block of scale 0
_THIRD = tl.constexpr(1.0 / 3.0)  # rounded to fp32 where it is used


@triton.jit
def _byte_offsets(start, BITS: tl.constexpr, R: tl.constexpr):
    """Offsets of the packed code bytes of the program's blocks, ``[R, 64 * BITS / 8]``."""
    PER_ROW: tl.constexpr = BLOCK * BITS // 8
    return start // (8 // BITS) + tl.arange(0, R)[:, None] * PER_ROW + tl.arange(0, PER_ROW)[None, :]


@triton.jit
def block_rms(q, R: tl.constexpr):
    """``fusedopt.codecs.normalised.block_rms`` of the rows of ``q``: a row as six axes of 2, summed from the
    last, adds neighbours first as ``neighbour_sums`` does, each sum in registers or across two lanes, so
    the tile never goes through shared memory."""
    s = tl.reshape(q * q, [R, 2, 2, 2, 2, 2, 2])
    s = tl.sum(s, axis=6)
    s = tl.sum(s, axis=5)
    s = tl.sum(s, axis=4)
    s = tl.sum(s, axis=3)
    s = tl.sum(s, axis=2)
    s = tl.sum(s, axis=1)
    return tl.sqrt_rn(s * (1.0 / 64))


@triton.jit
def third(s):
    """``s / 3`` correctly rounded for bf16 values ``s`` (checked for every finite one): a product and one fma's
    correction, where ``tl.div_rn`` takes a division."""
    q = s * _THIRD
    return tl.fma(tl.fma(-3.0, q, s), _THIRD, q)


@triton.jit
def load_normalised(codes_ptr, scales_ptr, r, start, n_elements, BITS: tl.constexpr, R: tl.constexpr):
    """Decode the program's ``R`` blocks to ``m`` ``[R, 64]``; ``r``: the square root of the decoded
    frame (0 past the tensor's end)."""
    packed, scales = load_normalised_raw(codes_ptr, scales_ptr, start, n_elements, BITS, R)
    return decode_normalised(packed, scales, r, BITS, R)


@triton.jit
def load_normalised_raw(codes_ptr, scales_ptr, start, n_elements, BITS: tl.constexpr, R: tl.constexpr):
    """The program's ``R`` blocks as stored, for ``decode_normalised``: (code bytes, bf16 scales)."""
    tl.static_assert(BITS == 2, "normalised codes are 2 bits")
    blocks, has_block = block_rows(start, n_elements, BLOCK, R)
    scales = tl.load(scales_ptr + blocks, mask=has_block, other=0.0)
    packed = tl.load(codes_ptr + _byte_offsets(start, BITS, R), mask=has_block[:, None], other=0)
    return packed, scales


@triton.jit
def decode_normalised(packed, scales, r, BITS: tl.constexpr, R: tl.constexpr):
    """``m`` ``[R, 64]`` of blocks ``load_normalised_raw`` loaded; ``r`` as for ``load_normalised``."""
    packed = packed.to(tl.int32)
    scales = scales.to(tl.float32)
    # element 4i + j at bits 2j
    # twice each code, so that its bits or-ed into 2**22's (where a unit is two ulps) are 2**22 + code: no int ->
    # float conversion (a quarter of the fp32 rate); (code - TOP / 2) * (2 third) is the reference's product
    # (2 code - TOP) * third, and 2**22 + TOP / 2 is exact
    f0 = (packed << 1) & 6
    f1 = (packed >> 1) & 6
    f2 = (packed >> 3) & 6
    f3 = (packed >> 5) & 6
    twice = tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), [R, BLOCK])
    TOP: tl.constexpr = 3  # 2**BITS - 1
    biased = (twice | 0x4A800000).to(tl.float32, bitcast=True)
    q = (biased - (4194304.0 + TOP / 2)) * (2.0 * third(scales))[:, None]
    return q * r


@triton.jit
def store_normalised(
    x,  # fp32 new moment [R, 64]
    r,  # the square root of the frame as just stored [R, 64] (0 past the tensor's end)
    u,  # uniforms [R, 64] (moments.top_uniform of the moment's whole words; 0 past the tensor's end)
    codes_ptr,
    scales_ptr,
    start,
    n_elements,
    status,  # the check kernel's status: non-zero stores nothing
    BITS: tl.constexpr,
    CLIP: tl.constexpr,  # the half-range's cap in block rms (an fp32 value)
    IEEE: tl.constexpr,  # m / r by the IEEE division (else the approximate one: kernels/update.py's denominator)
    R: tl.constexpr,
    FINITE: tl.constexpr = False,  # x is finite wherever anything is stored (the update's: its gradient is finite)
):
    """``NormalisedCodec.encode``: q = m / r, the block's half-range rounded up to bf16, the codes
    rounded stochastically between the two levels around q."""
    tl.static_assert(BITS == 2, "normalised codes are 2 bits")
    tl.static_assert(CLIP > 0, "the half-range's cap must be positive")
    TOP: tl.constexpr = 3  # 2**BITS - 1
    if IEEE:
        q = tl.where(r > 0, tl.div_rn(x, r), 0.0)
    else:
        q = tl.where(r > 0, approximate_div(x, r), 0.0)  # r is 0 or in [2**-63, 2**50]: in its range
    if FINITE:  # a finite x over r > 0: no NaN
        q = tl.minimum(tl.maximum(q, -_BIG), _BIG)  # saturated
    else:
        q = tl.where(q != q, 0.0, tl.minimum(tl.maximum(q, -_BIG), _BIG))  # nan_to_num, saturated
    half = tl.minimum(tl.max(tl.abs(q), axis=1), block_rms(q, R) * CLIP)
    # rounded up to bf16: the smallest bf16 pattern not below half's (half >= 0, finite)
    unit = ((half.to(tl.int32, bitcast=True) + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
    # t = (q / unit + 1) * TOP / 2 saturated to [0, 4] as s = t / 4 saturated to [0, 1] (exact scalings; the
    # reference's cap at TOP: from 4 t + u floors to TOP or more, taken to TOP here), t + u as fma(s, 4, u)
    s = saturated_product(q * reciprocal_rn(tl.maximum(unit, _TINY))[:, None] + 1.0, TOP / 8)
    codes = tl.minimum(floor_truncating(tl.fma(s, 4.0, u)), TOP)
    codes = tl.where(unit[:, None] > 0, codes, 0)  # a zero block: the zero encoding
    blocks, has_block = block_rows(start, n_elements, BLOCK, R)
    block_commit = (tl.zeros([R], tl.int32) + status) == 0
    tl.store(scales_ptr + blocks, unit.to(tl.bfloat16), mask=has_block & block_commit)  # exact: a bf16 value
    f02, f13 = tl.split(tl.reshape(codes, [R, BLOCK // 4, 2, 2]))
    f0, f2 = tl.split(f02)
    f1, f3 = tl.split(f13)
    packed = f0 | (f1 << 2) | (f2 << 4) | (f3 << 6)
    PER_ROW: tl.constexpr = BLOCK * BITS // 8
    commit = has_block[:, None] & commit_mask(status, R, PER_ROW)
    tl.store(codes_ptr + _byte_offsets(start, BITS, R), packed.to(tl.uint8), mask=commit)
