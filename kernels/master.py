"""Parameter (master weight) load and store inside the update kernel.

Device-side twin of ``fusedopt.master`` and ``fusedopt.rounding``:

* ``MASTER = 0``: fp32 parameter, its own master.
* ``MASTER = 1``: bf16/fp16 parameter without correction: the fp32 result is written with
  stochastic rounding. bf16: the draw's top 16 bits added below the bf16 mantissa, then truncated
  (integer arithmetic, identical to the reference). fp16: the nearest value and its
  neighbour on the other side, the upper one taken with probability (x - lo) / (hi - lo).
* ``MASTER = 2``: master-weight splitting, parameter (head) + int8/int16 correction of
  ``K`` = 8/16 extra bits, in sign-magnitude integer arithmetic on bit patterns exactly as
  ``fusedopt.master.split_master`` / ``join_master`` (their docstring has the scheme).
"""

import triton
import triton.language as tl

_F32_MAG_MAX = tl.constexpr(0x7F7FFFFF)
_F16_REBIAS = tl.constexpr(0x38000000)
_F16_MIN_NORMAL = tl.constexpr(0x38800000)
_F16_CLAMP = tl.constexpr(0x47800000)
_BF16_SPLIT_CLAMP = tl.constexpr(float.fromhex("0x1.fefep+127"))  # bit pattern 0x7F7F7F00


@triton.jit
def load_master(param_ptr, corr_ptr, offs, mask, MASTER: tl.constexpr, PARAM_BF16: tl.constexpr, K: tl.constexpr):
    """The fp32 master of this program's elements."""
    head, correction = load_master_raw(param_ptr, corr_ptr, offs, mask, MASTER)
    return decode_master(head, correction, MASTER, PARAM_BF16, K)


@triton.jit
def load_master_raw(param_ptr, corr_ptr, offs, mask, MASTER: tl.constexpr):
    """(the parameter's elements, their corrections; 0 without) as stored, for ``decode_master``."""
    head = tl.load(param_ptr + offs, mask=mask, other=0.0)
    correction = 0
    if MASTER == 2:
        correction = tl.load(corr_ptr + offs, mask=mask, other=0)
    return head, correction


@triton.jit
def decode_master(head, correction, MASTER: tl.constexpr, PARAM_BF16: tl.constexpr, K: tl.constexpr):
    """The fp32 master of elements ``load_master_raw`` loaded."""
    if MASTER != 2:
        master = head.to(tl.float32)
    else:
        master = _join(head, correction.to(tl.int32), PARAM_BF16, K)
    return master


@triton.jit
def _join(head, correction, PARAM_BF16: tl.constexpr, K: tl.constexpr):
    """(head, correction) -> fp32 master: ``join_master`` in registers."""
    if PARAM_BF16:  # the head's fp32 pattern, plus the correction below its 16 bits (sign-magnitude)
        bits = head.to(tl.int16, bitcast=True).to(tl.int32) << 16
        head_magnitude = bits & 0x7FFFFFFF
        magnitude = tl.maximum(head_magnitude + (correction << (16 - K)), 0)
        magnitude = tl.where(head_magnitude < 0x7F800000, magnitude, head_magnitude)  # inf, NaN: the head
        return (magnitude | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    head_bits = head.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    sign = (head_bits & 0x8000) << 16
    code = tl.maximum(((head_bits & 0x7FFF) << K) + correction, 0)
    if PARAM_BF16:
        a = code << (16 - K)
    else:
        if K == 16:
            normal_a = (code >> 3) + _F16_REBIAS
        else:
            normal_a = (code << 5) + _F16_REBIAS
        small_a = (code.to(tl.float32) * (2.0 ** -(24 + K))).to(tl.int32, bitcast=True)
        a = tl.where(code >= (1 << (10 + K)), normal_a, small_a)
    master = (a | sign).to(tl.float32, bitcast=True)
    head32 = head.to(tl.float32)
    return tl.where(tl.abs(head32) < float("inf"), master, head32)


@triton.jit
def _split(x, rbits, PARAM_BF16: tl.constexpr, K: tl.constexpr, STOCHASTIC: tl.constexpr):
    """fp32 master -> (head bits as int16, correction as int32): ``split_master`` in registers."""
    if PARAM_BF16 and K == 8:
        # On the signed pattern, the sign carried along: |x| clamped to the pattern 0x7F7F7F00
        # first saturates exactly as min(code, 0x7F7F7F) after the draw's add would; then neither
        # that add (|x| + 255 < 2**31) nor the half's (code + 0x80 < 2**23) reaches the sign,
        # which the shifts move to bit 15 of the head, and the correction (code minus the head's
        # bits, shifted back) is the same. NaN and inf give junk: store_master writes them apart.
        clamped = tl.maximum(tl.minimum(x, _BF16_SPLIT_CLAMP), -_BF16_SPLIT_CLAMP)
        if STOCHASTIC:
            r = (rbits >> 24).to(tl.int32)
        else:
            r = 0x80
        code = ((clamped.to(tl.int32, bitcast=True) + r).to(tl.uint32) >> 8).to(tl.int32)  # sign at bit 23
        head_bits = (code + 0x80) >> 8  # sign at bit 15
        return head_bits.to(tl.int16), code - (head_bits << 8)
    pattern = x.to(tl.int32, bitcast=True)
    a = pattern & 0x7FFFFFFF  # inf and NaN give junk here: store_master writes them apart
    if PARAM_BF16:
        HEAD_MAX: tl.constexpr = 0x7F7F
        if K == 16:
            code = a
        else:
            if STOCHASTIC:
                code = (a + (rbits >> 24).to(tl.int32)) >> 8
            else:
                code = (a + 0x80) >> 8
    else:
        HEAD_MAX: tl.constexpr = 0x7BFF
        n = tl.maximum(tl.minimum(a, _F16_CLAMP) - _F16_REBIAS, 0)
        if K == 16:
            normal_code = n << 3
        else:
            normal_code = (n + (rbits >> 27).to(tl.int32)) >> 5
        y = tl.minimum(tl.abs(x), 2.0**-14) * (2.0 ** (24 + K))
        whole = tl.floor(y)
        up = (rbits >> 8).to(tl.int32).to(tl.float32) * (1.0 / 16777216.0) < (y - whole)
        small_code = whole.to(tl.int32) + up.to(tl.int32)
        code = tl.where(a >= _F16_MIN_NORMAL, normal_code, small_code)
    HALF: tl.constexpr = 1 << (K - 1)
    code = tl.minimum(code, (HEAD_MAX << K) + HALF - 1)  # saturate instead of rounding to inf
    h = (code + HALF) >> K
    correction = code - (h << K)
    head_bits = h | ((pattern >> 16) & 0x8000)  # the sign bit moved to bit 15
    return head_bits.to(tl.int16), correction


@triton.jit
def _round_stochastic_fp16(x, rbits):
    near = x.to(tl.float16)
    near32 = near.to(tl.float32)
    near_bits = near.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    negative = (near_bits & 0x8000) != 0
    magnitude = near_bits & 0x7FFF
    up = x > near32
    # IEEE nextafter(near, +-inf) on the fp16 pattern (sign-magnitude)
    grow = up != negative
    other_bits = tl.where(grow, near_bits + 1, near_bits - 1)
    other_bits = tl.where(magnitude == 0, tl.where(up, 0x0001, 0x8001), other_bits)
    other = (other_bits.to(tl.int16)).to(tl.float16, bitcast=True).to(tl.float32)
    lo = tl.minimum(near32, other)
    hi = tl.maximum(near32, other)
    p_hi = tl.div_rn(x - lo, hi - lo)
    p_hi = tl.where(p_hi == p_hi, p_hi, 0.0)
    u = (rbits >> 8).to(tl.int32).to(tl.float32) * (1.0 / 16777216.0)
    pick = tl.where(u < p_hi, hi, lo)
    finite = tl.abs(x) < float("inf")
    return tl.where((near32 == x) | (finite == 0), near32, pick).to(tl.float16)


@triton.jit
def store_master(
    x,
    rbits,
    param_ptr,
    corr_ptr,
    offs,
    mask,
    MASTER: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    K: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Write the new fp32 master ``x`` to the parameter (``rbits``: uint32 uniform bits)."""
    if MASTER == 0:
        tl.store(param_ptr + offs, x, mask=mask)
    elif MASTER == 2:
        head_bits, correction = _split(x, rbits, PARAM_BF16, K, STOCHASTIC)
        finite = tl.abs(x) < float("inf")
        if PARAM_BF16:
            head = tl.where(finite, head_bits.to(tl.bfloat16, bitcast=True), x.to(tl.bfloat16))
        else:
            head = tl.where(finite, head_bits.to(tl.float16, bitcast=True), x.to(tl.float16))
        tl.store(param_ptr + offs, head, mask=mask)
        correction = tl.where(finite, correction, 0)
        if K == 16:
            tl.store(corr_ptr + offs, correction.to(tl.int16), mask=mask)
        else:
            tl.store(corr_ptr + offs, correction.to(tl.int8), mask=mask)
    elif PARAM_BF16:
        pattern = (x.to(tl.int32, bitcast=True) + (rbits >> 16).to(tl.int32)) & -65536
        tl.store(param_ptr + offs, pattern.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        tl.store(param_ptr + offs, _round_stochastic_fp16(x, rbits), mask=mask)
