"""Root-grid second moments inside the update kernel (the codec ``root4`` of ``norm2-root4``).

Device twin of ``fusedopt.codecs.rootgrid`` (its docstring defines the format). The update's tile is
viewed as ``[R, 128]``, one block per row, so a block's largest root, its fit and its unit never
leave the program. The same operations in the same order as the reference, so the interpreter
agrees with it bit for bit: the minifloat level below a root and the stochastic decision are integer
operations on the bits of ``t + 4`` (``blockwise.MinifloatLevels``), with the reference's draws (the
moment's field of the shared word, mixed with the element index).
"""

import triton
import triton.language as tl

from fusedopt.codecs.rootgrid import FRESH_UNIT
from fusedopt.kernels.moments import (
    INTERPRETED,
    block_rows,
    load_nibble_bytes,
    reciprocal_rn,
    saturated_product,
    store_nibble_codes,
    unpack_nibbles,
)

BLOCK = tl.constexpr(128)  # elements per block (fusedopt.codecs.rootgrid.BLOCK)
_TOP = tl.constexpr(52.0)  # the top level, L(15)
_SHIFT = tl.constexpr(21)  # 23 - the levels' 2 mantissa bits
_BASE = tl.constexpr((127 + 2) << 23)  # the bits of 4.0 = 2**2
_FRESH = tl.constexpr(FRESH_UNIT)  # HEADROOM / TOP, an fp32 value
_TOP_SLACK = tl.constexpr(52.0 * (1.0 + 2.0**-20))  # exact in fp32
_SMALLEST = tl.constexpr(2.0**-63)  # smaller roots decode as 0 (their square would be subnormal)
_LARGEST_SCALE = tl.constexpr(2.0**63)  # 1 / _SMALLEST
_BIG_ROOT = tl.constexpr(2.0**50)  # the root of the reference's saturation of v, 2**100


@triton.jit
def roots(codes, units):
    """``L(c) * w`` of int32 ``codes`` ``[R, 128]`` under the rows' ``units``, roots too small to square
    in fp32's normal range as 0 (``RootGridCodec.roots``)."""
    biased = ((codes << _SHIFT) + _BASE).to(tl.float32, bitcast=True)  # 4 + L(c), exactly
    # (4 + L) w - 4 w in one fma (4 w is exact): L w rounded once, as the reference's product
    r = tl.fma(biased, units[:, None], -4.0 * units[:, None])
    if INTERPRETED:
        r = tl.where(r >= _SMALLEST, r, 0.0)
    else:  # r * 2**-63 toward zero, subnormals flushed: 0 exactly below 2**-126, exact above; two FMA-pipe
        # multiplies for a compare and a select on the busier ALU pipe
        scaled = tl.inline_asm_elementwise(
            "mul.rz.ftz.f32 $0, $1, 0f20000000;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1
        )
        r = scaled * _LARGEST_SCALE
    return r


@triton.jit
def load_root_grid(codes_ptr, units_ptr, start, n_elements, R: tl.constexpr):
    """Decode the program's ``R`` blocks: (codes, units, roots ``[R, 128]``). Padding elements decode
    too (their codes are 0)."""
    packed, units = load_root_grid_raw(codes_ptr, units_ptr, start, n_elements, R)
    return decode_root_grid(packed, units, R)


@triton.jit
def load_root_grid_raw(codes_ptr, units_ptr, start, n_elements, R: tl.constexpr):
    """The program's ``R`` blocks as stored, for ``decode_root_grid``: (code bytes ``[R, 64]``, units)."""
    blocks, has_block = block_rows(start, n_elements, BLOCK, R)
    units = tl.load(units_ptr + blocks, mask=has_block, other=0.0)
    return load_nibble_bytes(codes_ptr, start, has_block, R, BLOCK), units


@triton.jit
def decode_root_grid(packed, units, R: tl.constexpr):
    """(codes, units, roots ``[R, 128]``) of blocks ``load_root_grid_raw`` loaded."""
    codes = unpack_nibbles(packed, R, BLOCK)
    return codes, units, roots(codes, units)


@triton.jit
def store_root_grid(
    x,  # fp32 new moment [R, 128]
    root,  # sqrt(x), IEEE or approximate (the update's denominator takes it too)
    codes,  # the codes, units and decoded values (roots squared) before the update
    units,
    values,
    decay,  # the EMA's decay (fp32) and its square root (the unit's decay)
    decay_root,
    draws,  # int32 [R, 128]: the top 21 bits of the moment's whole hash words (fusedopt.rng), floor(u * 2**21)
    local,  # element offsets [R, 128]
    codes_ptr,
    units_ptr,
    start,
    n_elements,
    status,  # the check kernel's status: non-zero stores nothing
    EXACT_ROOT: tl.constexpr,  # root is tl.sqrt_rn(x)
    R: tl.constexpr,
    FINITE: tl.constexpr = False,  # x is never NaN wherever anything is stored (the update's: its gradient is finite)
):
    """``RootGridCodec.encode_decayed``: the unit decays by ``sqrt(d)``, elements without an increment
    keep their codes, the others are rounded on the decayed grid, a block above its top level afresh.
    Returns the roots as now stored. A refitted unit is the IEEE root of the block's largest moment (the
    reference's bits whichever ``root`` is: sqrt is monotonic), the largest ``root`` where that is exact;
    an approximate ``root`` moves only codes."""
    # sqrt of the saturated moment (NaN: 0), as the reference
    if FINITE:  # x in [0, inf]: so is its root
        r = tl.minimum(root, _BIG_ROOT)
    else:
        r = tl.where(root != root, 0.0, tl.minimum(tl.maximum(root, 0.0), _BIG_ROOT))
    r = tl.where(local < n_elements, r, 0.0)  # the reference's zero padding
    kept_units = units * decay_root
    same = x == values * decay  # no increment: the code stays
    fits = tl.max(tl.where(same, 0.0, r), axis=1) <= kept_units * _TOP_SLACK  # r >= 0: the largest fits
    fits = fits & (kept_units > 0)
    if EXACT_ROOT:
        largest_root = tl.max(r, axis=1)
    else:  # x >= 0: the largest saturated moment is the largest moment saturated (tl.max passes over a NaN)
        largest_root = tl.sqrt_rn(
            tl.minimum(tl.max(tl.where(local < n_elements, x, 0.0), axis=1), _BIG_ROOT * _BIG_ROOT)
        )
    new_units = tl.where(fits, kept_units, largest_root * _FRESH)
    inverse = tl.where(new_units > 0, reciprocal_rn(new_units), 0.0)
    # t = r * inverse saturated to [0, TOP] (a NaN, r = 0 under an inverse overflowed to inf, as 0 so that r = 0
    # rounds to code 0 below), then t + 4, by exact scalings: s = r * (inverse / 64) saturated to [0, 1] is
    # t / 64 (or 1 for t >= 64), fma(s, 64, 4) is t + 4 rounded once, and its min with 56 the min of t with TOP
    s = saturated_product(r, tl.broadcast_to(inverse[:, None] * (1.0 / 64), r.shape))
    level = tl.minimum(tl.fma(s, 64.0, 4.0), _TOP + 4.0)
    level_bits = level.to(tl.int32, bitcast=True)  # the one rounding, as the reference's
    # at most code 15 without a clamp: t + 4 <= 56, whose pattern less 4's is 15 << 21 with low bits 0 below the draw
    rounded = (level_bits - _BASE + draws) >> _SHIFT
    # code 1 at least where r > 0, as max(rounded, min(bits(r), 1)): r is +0 or positive (a -0 leaves rounded, 0)
    rounded = tl.maximum(rounded, tl.minimum(r.to(tl.int32, bitcast=True), 1))
    new_codes = tl.where(fits[:, None] & same, codes, rounded)
    blocks, has_block = block_rows(start, n_elements, BLOCK, R)
    block_commit = (tl.zeros([R], tl.int32) + status) == 0
    tl.store(units_ptr + blocks, new_units, mask=has_block & block_commit)
    store_nibble_codes(codes_ptr, new_codes, start, has_block, status, R, BLOCK)
    return roots(new_codes, new_units)
