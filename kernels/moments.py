"""Moment storage inside the update kernel: decode to fp32 in registers, encode back.

Device-side twins of the PyTorch codecs (``fusedopt.codecs``, ``fusedopt.codecs.blockwise``), one
helper per ``KernelFormat.family`` (``fusedopt.codecs.base.Family``); ``load_moment`` and
``store_moment`` pick one by the family with ``==`` and refuse to compile for any other:

* ``NONE``: no moment (SGD without momentum).
* ``FP32``.  ``BF16``: stochastic rounding (the draw's top 16 bits added below the bf16 mantissa,
  then truncation: the same integer arithmetic as the reference, so no fp32->bf16 conversion is
  involved and CPU interpreter and GPU agree bit for bit).
* ``BLOCK``: blocks of ``QBLOCK`` elements, one E8M0 byte scale per block, sign-magnitude codes of
  ``BITS`` = 8 or 4 bits; levels ``q**POWER`` (POWER 1 or 2) or, for ``POWER = -M``, shifted
  minifloat levels with M mantissa bits (``fusedopt.codecs.blockwise.MinifloatLevels``); 4-bit
  codes packed two per byte (element ``2i`` in the low nibble). Scales are computed from the
  block's new values, in the same pass.

The normalised and root-grid families have their own twins (``normalised.py``, ``rootgrid.py``),
called from the update kernel.

A program owns ``NB`` whole quantisation blocks (``NB * QBLOCK`` consecutive elements), held
as a [NB, QBLOCK] tile, so no other program touches its blocks or their scales.
"""

import os

import triton
import triton.language as tl

from fusedopt.codecs.base import Family

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

_NONE = tl.constexpr(Family.NONE)
_FP32 = tl.constexpr(Family.FP32)
_BF16 = tl.constexpr(Family.BF16)
_BLOCK = tl.constexpr(Family.BLOCK)


@triton.jit
def _pow2(e):
    """2**e as fp32 from int32 exponents in [-126, 127] (exact: built from the bit pattern)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


# Conversions (int <-> float, floor) issue at a fraction of the fp32 rate on recent GPUs, as
# MUFU does; with four per element and moment they bounded the kernel. Exact bit tricks on
# the fp32 pipe replace them: 1.5 * 2**23 + x rounds x to an integer kept in the low
# mantissa bits (|x| < 2**22), and an integer below 2**23 or-ed into 2**23's pattern is
# 2**23 + i.
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23
_ROUNDER_BITS = tl.constexpr(0x4B400000)


@triton.jit
def small_int_to_f32(i):
    """int32 in [0, 2**23) -> fp32, exactly."""
    return (i | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def approximate_div(x, y):
    """fp32 ``x / y`` by ``div.approx.ftz.f32``: ``x * (1 / y)`` within 2 ulp for ``|y|`` in [2**-126, 2**126],
    a subnormal ``x`` or quotient flushed to zero; two instructions where ``x / y`` (``div.full.f32``) takes
    about eight. Exact in the interpreter. (Used under ``update.APPROXIMATE_ROOT_GRID``, ``APPROXIMATE_DIVISION``.)"""
    if INTERPRETED:
        q = x / y
    else:
        q = tl.inline_asm_elementwise(
            "div.approx.ftz.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )
    return q


@triton.jit
def reciprocal_rn(x):
    """fp32 ``1 / x`` correctly rounded (IEEE, subnormals kept): ``tl.div_rn(1.0, x)``'s bits by ``rcp.rn.f32``."""
    if INTERPRETED:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return r


@triton.jit
def saturated_product(x, c):
    """``min(max(x * c, 0), 1)`` of fp32 ``x * c`` rounded to nearest (a NaN product as 0): one ``mul.sat`` on the
    FMA pipe where a multiply and two clamps would take the busier ALU pipe twice."""
    if INTERPRETED:
        s = tl.minimum(tl.maximum(x * c, 0.0), 1.0)  # (np.fmax takes a NaN to 0, as mul.sat does)
    else:
        s = tl.inline_asm_elementwise(
            "mul.rn.sat.f32 $0, $1, $2;", "=r,r,r", [x, c], dtype=tl.float32, is_pure=True, pack=1
        )
    return s


@triton.jit
def floor_small(y):
    """``floor(y)`` as int32 for fp32 ``y`` in [0, 2**22), exactly, without the floor and float -> int
    conversions: the rounder holds round(y) in its low mantissa bits; one less where that rounded up."""
    rounded = y + _ROUNDER
    down = (rounded - _ROUNDER > y).to(tl.int32)
    return (rounded.to(tl.int32, bitcast=True) - _ROUNDER_BITS) - down


@triton.jit
def floor_truncating(y):
    """``floor(y)`` as int32 for fp32 ``y`` in [0, 2**22) (or inf: a large positive int), exactly, in two
    instructions: ``y + 2**23`` rounded toward zero holds ``floor(y)`` in its low mantissa bits. The
    interpreter takes ``floor_small``, the same exact floor."""
    if INTERPRETED:
        f = floor_small(y)
    else:
        truncated = tl.inline_asm_elementwise(
            "add.rz.f32 $0, $1, 0f4B000000;", "=r,r", [y], dtype=tl.float32, is_pure=True, pack=1
        )
        f = truncated.to(tl.int32, bitcast=True) - 0x4B000000
    return f


@triton.jit
def top_uniform(rbits):
    """The top 23 bits of a uint32 draw as fp32 in [0, 1): (rbits >> 9) * 2**-23, exactly."""
    return ((rbits >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _level(q, POWER: tl.constexpr):
    if POWER == 1:
        return q
    else:
        return q * q


@triton.jit
def tile_offsets(start, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """Element offsets of a program's tile, shaped [blocks, block size] (rows = quantisation blocks).

    Every tensor of the update is handled in this 2-D shape, so a block's absmax is a reduction
    along the rows' own axis and no value changes layout between load, math and store.
    """
    rows = tl.arange(0, NB)
    cols = tl.arange(0, QBLOCK)
    return start + rows[:, None] * QBLOCK + cols[None, :]  # int64 when start is


@triton.jit
def block_rows(start, n_elements, BLOCK: tl.constexpr, R: tl.constexpr):
    """(the indices of the ``R`` blocks of ``BLOCK`` elements from element ``start``, the mask of
    those the tensor has): the row layout of the block formats' device twins."""
    blocks = start // BLOCK + tl.arange(0, R)
    n_blocks = (n_elements - 1) // BLOCK + 1  # ceil without overflow near 2**31 (n_elements >= 1)
    return blocks, blocks < n_blocks


@triton.jit
def commit_mask(status, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The check kernel's status as a [ROWS, COLS] store mask (True: the update is committed).

    A tile, not a scalar: Triton's interpreter rejects a scalar boolean in a store mask.
    """
    return (tl.zeros([ROWS, COLS], tl.int32) + status) == 0


@triton.jit
def load_nibble_bytes(codes_ptr, start, has_block, R: tl.constexpr, BLOCK: tl.constexpr):
    """The bytes ``[R, BLOCK / 2]`` of the program's blocks of 4-bit codes, two a byte, element ``2i`` in the
    low nibble (the root grid's storage, ``fusedopt.codecs.nibbles``; ``unpack_nibbles`` decodes them); 0
    where a row has no block."""
    byte = start // 2 + tl.arange(0, R)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    return tl.load(codes_ptr + byte, mask=has_block[:, None], other=0)


@triton.jit
def unpack_nibbles(packed, R: tl.constexpr, BLOCK: tl.constexpr):
    """int32 codes ``[R, BLOCK]`` of bytes ``[R, BLOCK / 2]`` of two codes each, element ``2i`` in the low nibble."""
    packed = packed.to(tl.int32)
    return tl.reshape(tl.join(packed & 0xF, packed >> 4), [R, BLOCK])


@triton.jit
def store_nibble_codes(codes_ptr, codes, start, has_block, status, R: tl.constexpr, BLOCK: tl.constexpr):
    """Store int32 ``codes`` ``[R, BLOCK]`` as ``load_nibble_bytes`` reads them (nothing if ``status``)."""
    even, odd = tl.split(tl.reshape(codes, [R, BLOCK // 2, 2]))
    byte = start // 2 + tl.arange(0, R)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    commit = has_block[:, None] & commit_mask(status, R, BLOCK // 2)
    tl.store(codes_ptr + byte, (even | (odd << 4)).to(tl.uint8), mask=commit)


@triton.jit
def _pair_offsets(start, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """Byte offsets of a program's packed 4-bit codes, shaped [blocks, block size / 2]."""
    return start // 2 + tl.arange(0, NB)[:, None] * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :]


@triton.jit
def load_moment(
    ptr,  # fp32 / bf16 values, or uint8 codes
    scale_ptr,  # uint8 E8M0 block scales (BLOCK)
    start,  # first element of this program (int64, multiple of the tile)
    n_elements,
    n_pairs,  # bytes of 4-bit codes: (n_elements + 1) // 2 (an argument, so Triton sees its divisibility)
    FAMILY: tl.constexpr,  # Family.NONE, FP32, BF16 or BLOCK
    BITS: tl.constexpr,  # BLOCK: 8 or 4
    SIGNED: tl.constexpr,
    POWER: tl.constexpr,  # levels q**POWER (1 or 2); -M: shifted minifloat, M mantissa bits
    QMAX: tl.constexpr,  # largest magnitude code
    K: tl.constexpr,  # level exponent: the top level is just below 2**K
    MIN_E: tl.constexpr,  # smallest block exponent
    NB: tl.constexpr,  # quantisation blocks per program
    QBLOCK: tl.constexpr,
):
    stored, scales = load_moment_raw(ptr, scale_ptr, start, n_elements, n_pairs, FAMILY, BITS, NB, QBLOCK)
    return decode_moment(stored, scales, FAMILY, BITS, SIGNED, POWER, QMAX, K, MIN_E, NB, QBLOCK)


@triton.jit
def load_moment_raw(
    ptr, scale_ptr, start, n_elements, n_pairs, FAMILY: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr,
    QBLOCK: tl.constexpr,
):  # fmt: skip
    """The program's tile of a moment as stored, for ``decode_moment``: (values or codes, block scales; 0
    where the family has none). Apart: every load is issued before any decoding (``_load_tile``)."""
    offs = tile_offsets(start, NB, QBLOCK)
    mask = offs < n_elements
    scales = 0
    if (FAMILY == _FP32) or (FAMILY == _BF16):
        stored = tl.load(ptr + offs, mask=mask, other=0.0)
    elif FAMILY == _NONE:
        stored = 0
    elif FAMILY == _BLOCK:
        tl.static_assert((BITS == 8) | (BITS == 4), "block codes are 8 or 4 bits")
        if BITS == 8:
            stored = tl.load(ptr + offs, mask=mask, other=0)
        else:  # two codes a byte, element 2i in the low nibble
            pair = _pair_offsets(start, NB, QBLOCK)
            stored = tl.load(ptr + pair, mask=pair < n_pairs, other=0)
        blocks = start // QBLOCK + tl.arange(0, NB)
        n_blocks = (n_elements - 1) // QBLOCK + 1  # ceil without overflow near 2**31 (n_elements >= 1)
        scales = tl.load(scale_ptr + blocks, mask=blocks < n_blocks, other=127)
    else:
        tl.static_assert(False, "load_moment has no branch for this moment family")
    return stored, scales


@triton.jit
def decode_moment(
    stored, scales, FAMILY: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, POWER: tl.constexpr,
    QMAX: tl.constexpr, K: tl.constexpr, MIN_E: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    """fp32 values ``[NB, QBLOCK]`` of a tile ``load_moment_raw`` loaded."""
    if FAMILY == _FP32:
        x = stored
    elif FAMILY == _BF16:
        x = stored.to(tl.float32)
    elif FAMILY == _NONE:
        x = tl.zeros([NB, QBLOCK], dtype=tl.float32)
    else:
        x = decode_block(stored, scales, BITS, SIGNED, POWER, QMAX, K, MIN_E, NB, QBLOCK)
    return x


@triton.jit
def decode_block(
    stored, scales,
    BITS: tl.constexpr, SIGNED: tl.constexpr, POWER: tl.constexpr, QMAX: tl.constexpr, K: tl.constexpr,
    MIN_E: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    """Decode a tile of a ``BLOCK`` moment (``fusedopt.codecs.blockwise.BlockCodec.decode``)."""
    if BITS == 8:
        codes = stored.to(tl.int32)
    else:  # interleave the nibbles
        packed = stored.to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [NB, QBLOCK])
    e = tl.minimum(tl.maximum(scales.to(tl.int32) - 127, MIN_E), 127)
    if POWER > 0:
        if POWER == 2:  # the square in an integer multiply-add that also makes it a float: 2**23 + c**2's bits
            magnitude = codes & QMAX
            level = (magnitude * magnitude + 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            level = _level(small_int_to_f32(codes & QMAX), POWER)
        x = level * _pow2(e - K)[:, None]
    else:  # minifloat levels: 2**M + L(c) is the float with c in its top mantissa/exponent bits
        M: tl.constexpr = -POWER
        unit = _pow2(e - K)[:, None]
        shifted = ((codes & QMAX) << (23 - M)) + ((127 + M) << 23)
        x = tl.fma(shifted.to(tl.float32, bitcast=True), unit, -(2.0**M) * unit)  # exact: L(c) * unit
    if SIGNED and BITS == 8:
        # the sign from the code as int8: its sign extension feeds the or, and the compiler
        # masks the magnitude before the shift (one fewer instruction per element)
        sign = codes.to(tl.int8).to(tl.int32) & -0x80000000
        x = (x.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    elif SIGNED:
        # the sign or-ed into the (non-negative) value's bits: one instruction instead of a select
        x = (x.to(tl.int32, bitcast=True) | (((codes >> (BITS - 1)) & 1) << 31)).to(tl.float32, bitcast=True)
    return x


@triton.jit
def store_moment(
    x,  # fp32 new values of this program's tile [NB, QBLOCK]
    rbits,  # uint32 uniform bits per element (stochastic rounding)
    ptr,
    scale_ptr,
    start,
    n_elements,
    n_pairs,
    FAMILY: tl.constexpr,  # Family.NONE, FP32, BF16 or BLOCK
    BITS: tl.constexpr,  # BLOCK: 8 or 4
    SIGNED: tl.constexpr,
    POWER: tl.constexpr,  # levels q**POWER (1 or 2); -M: shifted minifloat, M mantissa bits
    QMAX: tl.constexpr,
    K: tl.constexpr,
    MIN_E: tl.constexpr,
    THRESHOLD: tl.constexpr,  # absmax mantissa above which the block exponent goes one up
    TOP: tl.constexpr,  # largest level, QMAX**POWER
    NB: tl.constexpr,
    QBLOCK: tl.constexpr,
    status,  # the check kernel's status: non-zero stores nothing (the update is skipped)
):
    offs = tile_offsets(start, NB, QBLOCK)
    commit = commit_mask(status, NB, QBLOCK)
    mask = offs < n_elements
    if FAMILY == _FP32:
        tl.store(ptr + offs, x, mask=mask & commit)
    elif FAMILY == _BF16:
        pattern = (x.to(tl.int32, bitcast=True) + (rbits >> 16).to(tl.int32)) & -65536
        tl.store(ptr + offs, pattern.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask & commit)
    elif FAMILY == _BLOCK:
        store_block(
            x, rbits, ptr, scale_ptr, start, n_elements, n_pairs, offs, mask, commit, BITS, SIGNED, POWER, QMAX, K,
            MIN_E, THRESHOLD, TOP, NB, QBLOCK, status,
        )  # fmt: skip
    else:
        tl.static_assert(FAMILY == _NONE, "store_moment has no branch for this moment family")


@triton.jit
def store_block(
    x, rbits, ptr, scale_ptr, start, n_elements, n_pairs, offs, mask, commit,
    BITS: tl.constexpr, SIGNED: tl.constexpr, POWER: tl.constexpr, QMAX: tl.constexpr, K: tl.constexpr,
    MIN_E: tl.constexpr, THRESHOLD: tl.constexpr, TOP: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
    status,
):  # fmt: skip
    """Encode the program's tile of a ``BLOCK`` moment (``fusedopt.codecs.blockwise.BlockCodec.encode``):
    the block scales from the new values, then the codes."""
    tl.static_assert((BITS == 8) | (BITS == 4), "block codes are 8 or 4 bits")
    # No tl.where(mask, x, 0.0) for the absmax: beyond n_elements the update's masked loads
    # (gradient 0, codes 0, parameter 0) make every algorithm's new moment exactly +-0 for
    # finite hyperparameters (0 * x + 0, lerp of zeros), and NaN otherwise (0 * inf), which
    # the max skips on the GPU: the reference's zero padding either way.
    mag = tl.abs(x)
    absmax = tl.max(mag, axis=1)
    # E(absmax) - 126 + (mantissa > THRESHOLD): adding 0x7FFFFF - THRESHOLD to the (non-negative)
    # pattern carries into the exponent exactly when the mantissa is above the threshold (the
    # unsigned shift keeps a NaN's carry: 256 - 126, clamped to 127 as 255's is)
    if THRESHOLD < 0x7FFFFF:
        CARRY: tl.constexpr = 0x7FFFFF - THRESHOLD
    else:  # a top level that is a power of two: never above
        CARRY: tl.constexpr = 0
    e = ((absmax.to(tl.uint32, bitcast=True) + CARRY) >> 23).to(tl.int32) - 126
    e = tl.minimum(tl.maximum(e, MIN_E), 127)
    blocks = start // QBLOCK + tl.arange(0, NB)
    n_blocks = (n_elements - 1) // QBLOCK + 1  # ceil without overflow near 2**31 (n_elements >= 1)
    block_commit = (tl.zeros([NB], tl.int32) + status) == 0
    tl.store(scale_ptr + blocks, (e + 127).to(tl.uint8), mask=(blocks < n_blocks) & block_commit)
    if POWER < 0:
        # Minifloat levels: y = t + 2**M (t = mag / unit, exact) holds the level index in its bits
        # above the low 23 - M, and the fraction of the way to the next level below them (linear
        # inside a level interval), so adding the draw there and shifting rounds stochastically,
        # unbiased, in integer arithmetic. t beyond the top (inf, NaN too) saturates.
        M: tl.constexpr = -POWER
        y = tl.fma(mag, _pow2(K - e)[:, None], 2.0**M)
        fraction_draw = (rbits >> (9 + M)).to(tl.int32)  # floor(u * 2**(23 - M))
        if SIGNED and BITS == 8:
            # The same with the code in the top byte, where the value's sign bit joins it in the
            # add: y's bits clamped to the top level's first saturate as the min below would
            # (NaN too), so the code stays below 2**31 before the sign is added.
            y_bits = tl.minimum(y.to(tl.int32, bitcast=True), ((127 + M) << 23) + (QMAX << (23 - M)))
            BASE: tl.constexpr = ((((127 + M) << 23) << (M + 1)) + 2**31) % 2**32 - 2**31  # 2**M's, wrapped
            sign = x.to(tl.int32, bitcast=True) & -0x80000000
            top = (y_bits << (M + 1)) + (rbits >> 8).to(tl.int32) + (sign - BASE)
            q = (top.to(tl.uint32, bitcast=True) >> 24).to(tl.int32)
        else:
            q = tl.minimum((y.to(tl.int32, bitcast=True) - ((127 + M) << 23) + fraction_draw) >> (23 - M), QMAX)
    else:
        q = _quantize_power(mag * _pow2(K - e)[:, None], rbits, POWER, TOP)
    if SIGNED and BITS == 8 and POWER < 0:
        pass  # the sign is in q already
    elif SIGNED:  # the value's own sign bit (a negative value rounded to zero is stored as -0)
        q = q | ((x.to(tl.int32, bitcast=True) >> 31) & (1 << (BITS - 1)))
    else:
        # q = 1 where q = 0 < x, as max(q, min(bits(x), 1)): bits(x) > 0 iff x > 0 as an int32
        # (a negative NaN's bits are negative; a positive NaN or inf has q = QMAX already)
        q = tl.maximum(q, tl.minimum(x.to(tl.int32, bitcast=True), 1))
    if BITS == 8:
        tl.store(ptr + offs, q.to(tl.uint8), mask=mask & commit)
    else:
        low_nibble, high_nibble = tl.split(tl.reshape(q, [NB, QBLOCK // 2, 2]))
        pair = _pair_offsets(start, NB, QBLOCK)
        pair_mask = (pair < n_pairs) & commit_mask(status, NB, QBLOCK // 2)
        tl.store(ptr + pair, (low_nibble | (high_nibble << 4)).to(tl.uint8), mask=pair_mask)


@triton.jit
def _quantize_power(t, rbits, POWER: tl.constexpr, TOP: tl.constexpr):
    """Levels q**POWER: t (in level units) -> q, rounded stochastically, unbiased in the value."""
    t = tl.minimum(t, TOP * 1.0)  # saturate (inf, and NaN: the min of a NaN and a number is the number)
    # The lower level lo: linear levels, floor(t) (round, then one down where it went up);
    # square levels, round(sqrt(t) - 0.5) as the reference, without fix-up (see its quantize).
    if POWER == 1:
        rounded = t + _ROUNDER
        rounded -= tl.where(t < rounded - _ROUNDER, 1.0, 0.0)
        lo = rounded - _ROUNDER
        d = t - lo
        gap = 1.0
    else:
        rounded = (tl.sqrt(t) - 0.5) + _ROUNDER  # the integer in the low mantissa bits
        lo = rounded - _ROUNDER
        d = tl.fma(-lo, lo, t)  # t - lo**2, exact
        gap = tl.fma(2.0, lo, 1.0)  # (lo + 1)**2 - lo**2
    # round up with probability d / gap: u * gap < d, decided exactly by the sign of one fma
    up = tl.fma(top_uniform(rbits), gap, -d) < 0
    return (rounded.to(tl.int32, bitcast=True) - _ROUNDER_BITS) + up.to(tl.int32)
