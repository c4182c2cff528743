"""Log-grid second moments inside the update kernel (the codec ``log4`` of the paired formats).

Device twin of ``fusedopt.codecs.loggrid`` (its docstring defines the format). The update's tile is
viewed as ``[R, 128]``, one log-grid block per row (the tile's row may be a multiple of 128: 256
beside a rotated first moment), so a block's largest and smallest values, its refit and its new top
and spacing never leave the program. The same operations in the same order as the reference, so
the interpreter agrees with it bit for bit:

* a level is ``top * 2**(-frac / 32)`` rounded once, times an exact power of two; the 32 fp32
  fractions are the reference's table (``fractions_ptr``, loaded by index: a computed power would
  round differently);
* the level below a value is found by the reference's binary search over the level values; the
  stochastic decision compares fp64 products, exact for these fp32 values;
* the draws are the reference's: the moment's field of the shared word, mixed with the local index.
"""

import triton
import triton.language as tl

from fusedopt.kernels.moments import _pow2, block_rows, load_nibble_codes, store_nibble_codes

BLOCK = tl.constexpr(128)  # elements per block (fusedopt.codecs.loggrid.BLOCK)
LEVELS = tl.constexpr(15)  # nonzero levels; code 0 is zero
MAX_STEP = tl.constexpr(18)  # the encoder's widest spacing, in 32nds of a binade
_BIG = tl.constexpr(2.0**100)  # the reference's saturation
_ABOVE = tl.constexpr(1.0 + 2.0**-20)  # 1 +- the reference's slack (exact in fp32)
_BELOW = tl.constexpr(1.0 - 2.0**-20)


@triton.jit
def _level_at(j, tops, fractions_ptr):
    """``top * 2**(-j / 32)`` for ``j`` 32nds of a binade below the top (``LogGridCodec.levels``)."""
    whole = j >> 5  # floor division: j = -s (code 16) is a level above the top
    value = tops * tl.load(fractions_ptr + (j & 31))
    return value * _pow2(-whole)  # -8 <= whole <= 15 * 255 / 32: in fp32's exponent range, no clamp


@triton.jit
def levels(codes, tops, steps, fractions_ptr):
    """The values of int32 ``codes`` ``[R, 128]`` (0 and 16 allowed) under the rows' ``tops`` and int32
    ``steps`` ``[R]``."""
    j = tl.maximum(LEVELS - codes, -1) * steps[:, None]
    return tl.where(codes > 0, _level_at(j, tops[:, None], fractions_ptr), 0.0)


@triton.jit
def load_log_grid(codes_ptr, tops_ptr, steps_ptr, fractions_ptr, start, n_elements, R: tl.constexpr):
    """Decode the program's ``R`` blocks: (codes, tops, steps, values ``[R, 128]``). Padding elements
    decode too (their codes are 0)."""
    blocks, has_block = block_rows(start, n_elements, BLOCK, R)
    tops = tl.load(tops_ptr + blocks, mask=has_block, other=0.0)
    steps = tl.load(steps_ptr + blocks, mask=has_block, other=0).to(tl.int32)
    codes = load_nibble_codes(codes_ptr, start, has_block, R, BLOCK)
    return codes, tops, steps, levels(codes, tops, steps, fractions_ptr)


@triton.jit
def _bottom(tops, steps, fractions_ptr):
    """Level 1 of each row: the grid's lowest nonzero level."""
    return _level_at((LEVELS - 1) * steps, tops, fractions_ptr)


@triton.jit
def _on_grid(y, tops, steps, fractions_ptr):
    """``LogGridCodec.on_grid``: 0, or between the bottom level and the top, give or take fp32 rounding
    (at the widest spacing, any value up to the top)."""
    bottom = _bottom(tops, steps, fractions_ptr)
    widest = steps >= MAX_STEP  # a refit would not reach lower: level 1 it is
    return (y == 0) | ((y <= (tops * _ABOVE)[:, None]) & ((y >= (bottom * _BELOW)[:, None]) | widest[:, None]))


@triton.jit
def _round_to_grid(y, tops, steps, u, fractions_ptr):
    """The codes of ``LogGridCodec.round_to_grid``."""
    # the level below y: the reference's binary search over the level values, from level 1 (a guess
    # from the exponent bits verified by three level values measured slower: benchmarks/RESULTS.md)
    lo = tl.full(y.shape, 1, tl.int32)
    low = tl.zeros_like(y) + _bottom(tops, steps, fractions_ptr)[:, None]
    for i in tl.static_range(4):
        candidate = lo + (8 >> i)
        value = levels(candidate, tops, steps, fractions_ptr)
        take = (candidate <= LEVELS) & (value <= y)
        lo = tl.where(take, candidate, lo)
        low = tl.where(take, value, low)
    gap = levels(lo + 1, tops, steps, fractions_ptr) - low
    # u * gap < y - low, decided in fp64 (exact for these fp32 products)
    up = (lo < LEVELS) & (gap > 0) & (u.to(tl.float64) * gap.to(tl.float64) < (y - low).to(tl.float64))
    return tl.where(y > 0, lo + up.to(tl.int32), 0)


@triton.jit
def _fresh_grid(y):
    """``LogGridCodec.fresh_grid``: (tops, int32 steps) of the rows of ``y`` encoded afresh."""
    largest = tl.max(y, axis=1)
    smallest = tl.min(tl.where(y > 0, y, float("inf")), axis=1)
    tops = largest * 2.0
    binades = tl.log2(tops.to(tl.float64) / smallest.to(tl.float64))  # -inf for a zero block
    steps = tl.minimum(tl.maximum(tl.ceil(binades * 32.0 / 14.0), 0.0), MAX_STEP * 1.0)
    return tops, tl.where(largest > 0, steps, 0.0).to(tl.int32)


@triton.jit
def store_log_grid(
    x,  # fp32 new moment [R, 128]
    codes,  # the codes, tops, steps and values before the update (load_log_grid)
    tops,
    steps,
    values,
    decay,  # the EMA's decay (fp32)
    u,  # uniforms [R, 128] (hashing.spread_uniform of the moment's field)
    local,  # element offsets [R, 128]
    codes_ptr,
    tops_ptr,
    steps_ptr,
    fractions_ptr,
    start,
    n_elements,
    status,  # the check kernel's status: non-zero stores nothing
    R: tl.constexpr,
):
    """``LogGridCodec.encode_decayed``: the decay on the tops, elements without an increment keep their
    codes, the others rounded on the decayed grid, a block that does not fit it refitted. Returns the
    new (codes, tops, steps)."""
    y = tl.where(x != x, 0.0, tl.minimum(tl.maximum(x, 0.0), _BIG))  # nan_to_num, saturated, >= 0
    y = tl.where(local < n_elements, y, 0.0)  # the reference's zero padding
    kept_tops = tops * decay
    same = y == values * decay  # no increment: the code stays
    fits = tl.min((same | _on_grid(y, kept_tops, steps, fractions_ptr)).to(tl.int32), axis=1) > 0
    # each row is rounded once, on its grid: the decayed one where it fits, a fresh one where it does not
    new_tops, new_steps = kept_tops, steps
    if tl.min(fits.to(tl.int32), axis=0) == 0:  # only a program with a row to refit finds the rows' extremes
        fresh_tops, fresh_steps = _fresh_grid(y)
        new_tops = tl.where(fits, kept_tops, fresh_tops)
        new_steps = tl.where(fits, steps, fresh_steps)
    rounded = _round_to_grid(y, new_tops, new_steps, u, fractions_ptr)
    new_codes = tl.where(fits[:, None] & same, codes, rounded)
    blocks, has_block = block_rows(start, n_elements, BLOCK, R)
    block_commit = (tl.zeros([R], tl.int32) + status) == 0
    tl.store(tops_ptr + blocks, new_tops, mask=has_block & block_commit)
    tl.store(steps_ptr + blocks, new_steps.to(tl.uint8), mask=has_block & block_commit)
    store_nibble_codes(codes_ptr, new_codes, start, has_block, status, R, BLOCK)
    return new_codes, new_tops, new_steps
