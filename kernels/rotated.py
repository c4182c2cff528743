"""Rotated n-bit moments inside the update kernel (the state formats ``rot8``, ``rot4``, ``rot2``).

Device twin of ``fusedopt.codecs.rotated`` (its docstring defines the format): a program's tile is
``[NB, 256]``, one rotation block per row, so a block's rotation, absmax and scale never leave its
program. The same operations in the same order as the reference, so the interpreter agrees with
it bit for bit:

* the rotation is the reference's four radix-4 stages (``butterflies``), with the same adds in the
  same order, not a ``tl.dot``: a dot's summation order is the compiler's (and numpy's in the
  interpreter), and the rotated increment is rounded stochastically right after;
* divisions and the square root are IEEE (``div_rn``, ``sqrt_rn``), fp fusion is off (update.py);
* the draws are the reference's: the moment's field of the shared word of element ``i`` (element
  ``i mod n`` for a padding coordinate, update.py), mixed with the local index ``i`` by fmix32.

The decode keeps the integer codes, the block scales and the values in the storage domain for the
encode, which rounds only the increment against them (``RotatedCodec.encode_decayed``).
"""

import triton
import triton.language as tl

from fusedopt.kernels.hashing import spread_uniform
from fusedopt.kernels.moments import block_rows, commit_mask

BLOCK = tl.constexpr(256)  # elements per rotation block (fusedopt.codecs.rotated.BLOCK)
_TINY = tl.constexpr(1e-30)  # the reference's divisor of a block of scale 0
_BIG = tl.constexpr(2.0**50)  # the reference's saturation of the storage-domain values


@triton.jit
def butterflies(x, NB: tl.constexpr):
    """``16 H y`` for every row ``y`` of the ``[NB, 256]`` tile ``x``: the reference's four stages, each
    ``2 H4`` along one base-4 digit of the index, most significant first.

    Each stage brings the block's leading digit last (a transpose of the ``[4, 64]`` view), splits
    it into its four values and joins the four outputs back as the last digit; after four stages
    the digits are in their original order again."""
    for _ in tl.static_range(4):
        y = tl.reshape(tl.permute(tl.reshape(x, [NB, 4, 64]), (0, 2, 1)), [NB, 64, 2, 2])
        ac, bd = tl.split(y)  # digit 2 * hi + lo: lo = 0 holds digits 0 and 2, lo = 1 digits 1 and 3
        a, c = tl.split(ac)
        b, d = tl.split(bd)
        sab = a + b
        dab = a - b
        scd = c + d
        dcd = c - d
        low = tl.join(sab + dcd, dab + scd)  # outputs 0 and 2
        high = tl.join(sab - dcd, scd - dab)  # outputs 1 and 3
        x = tl.reshape(tl.join(low, high), [NB, 256])
    return x


@triton.jit
def _byte_offsets(start, BITS: tl.constexpr, NB: tl.constexpr):
    """Offsets of the packed code bytes of a program's blocks, ``[NB, 256 * BITS / 8]``."""
    PER_ROW: tl.constexpr = 256 * BITS // 8
    return start // (8 // BITS) + tl.arange(0, NB)[:, None] * PER_ROW + tl.arange(0, PER_ROW)[None, :]


@triton.jit
def load_rotated(codes_ptr, scale_ptr, start, n_elements, SIGNED: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr):
    """Decode a program's blocks: (codes as fp32, scales ``[NB]``, values in the storage domain, the
    moment). Padding coordinates (past ``n``) decode too: the encode needs their codes."""
    blocks, has_block = block_rows(start, n_elements, BLOCK, NB)
    scales = tl.load(scale_ptr + blocks, mask=has_block, other=0.0)
    byte = _byte_offsets(start, BITS, NB)
    packed = tl.load(codes_ptr + byte, mask=has_block[:, None], other=0)
    if BITS == 8:
        codes = packed.to(tl.int8, bitcast=True).to(tl.int32)
    elif BITS == 4:  # element 2i in the low nibble
        packed = packed.to(tl.int32)
        low = packed & 0xF
        high = packed >> 4
        codes = tl.reshape(tl.join(low, high), [NB, 256])
        codes = (codes ^ 8) - 8  # sign extension of 4 bits
    else:  # element 4i + j at bits 2j
        packed = packed.to(tl.int32)
        f0 = packed & 3
        f1 = (packed >> 2) & 3
        f2 = (packed >> 4) & 3
        f3 = packed >> 6
        codes = tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), [NB, 256])
        codes = (codes ^ 2) - 2
    c = codes.to(tl.float32)
    t = butterflies(c, NB) * (scales * 0.0625)[:, None]  # 16 H c is exact in fp32: one rounding
    if not SIGNED:
        t = tl.maximum(t, scales[:, None])  # the floor of sqrt(v)
        x = t * t
    else:
        x = t
    return c, scales, t, x


@triton.jit
def store_rotated(
    x,  # fp32 new moment [NB, 256]
    codes,  # fp32 codes before the update (load_rotated)
    scales,  # their block scales [NB]
    t_old,  # the values before the update in the storage domain (load_rotated)
    decay,  # the EMA's decay in the storage domain (its square root for a nonnegative moment)
    word,  # uint32: the moment's field of element i's shared word (i mod n's past n), top bits
    local,  # int32 / int64 element offsets of the tile (the mixing index)
    codes_ptr,
    scale_ptr,
    start,
    n_elements,
    status,  # the check kernel's status: non-zero stores nothing
    SIGNED: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,  # 2**(BITS - 1) - 1
    INVERSE_RESCALE: tl.constexpr,  # RotatedCodec.inverse_rescale (rounded to fp32 where it is used)
    NB: tl.constexpr,
):
    """``RotatedCodec.encode_decayed``: the decay on the scale, the rotated increment rounded into the
    codes, a block whose codes leave the grid re-rounded on a new scale."""
    if SIGNED:
        y = x
    else:
        # sqrt(max(x, 0)) as the reference, but for x < 0 (NaN here, 0 below) and the sign of a zero,
        # which does not reach the codes or scales; AdamW's denominator computes the same sqrt_rn
        y = tl.sqrt_rn(x)
    y = tl.where(y != y, 0.0, tl.minimum(tl.maximum(y, -_BIG), _BIG))  # nan_to_num, saturated
    increment = tl.where(local < n_elements, y - decay * t_old, 0.0)  # padding: no increment
    u = spread_uniform(word, local)
    r = butterflies(increment, NB) * 0.0625
    kept = scales * decay
    one = tl.full([NB], 1.0, tl.float32)
    q = codes + tl.floor(r * tl.div_rn(one, tl.maximum(kept, _TINY))[:, None] + u)
    over = tl.max(tl.abs(q), axis=1) > QMAX
    values = codes * kept[:, None] + r
    rescaled = tl.max(tl.abs(values), axis=1) * INVERSE_RESCALE
    new_scales = tl.where(over, rescaled, kept)
    fresh = tl.floor(values * tl.div_rn(one, tl.maximum(new_scales, _TINY))[:, None] + u)
    q = tl.where(over[:, None], fresh, q)
    q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0).to(tl.int32)
    blocks, has_block = block_rows(start, n_elements, BLOCK, NB)
    block_commit = (tl.zeros([NB], tl.int32) + status) == 0
    tl.store(scale_ptr + blocks, new_scales, mask=has_block & block_commit)
    if BITS == 8:
        packed = q & 0xFF
    elif BITS == 4:
        even, odd = tl.split(tl.reshape(q & 0xF, [NB, 128, 2]))
        packed = even | (odd << 4)
    else:
        f02, f13 = tl.split(tl.reshape(q & 3, [NB, 64, 2, 2]))
        f0, f2 = tl.split(f02)
        f1, f3 = tl.split(f13)
        packed = f0 | (f1 << 2) | (f2 << 4) | (f3 << 6)
    PER_ROW: tl.constexpr = 256 * BITS // 8
    byte = _byte_offsets(start, BITS, NB)
    tl.store(codes_ptr + byte, packed.to(tl.uint8), mask=has_block[:, None] & commit_mask(status, NB, PER_ROW))
