"""Block-quantized moments: the codecs of ``state_bits=8`` and ``state_bits=4``.

Format of one moment tensor of ``n`` elements, taken flattened in row-major order:

* **Blocks** of ``BLOCK`` = 16 consecutive elements; the last block may be partial.
* **Scales** (``<slot>.scales``, uint8, shape ``(ceil(n / 16),)``): one byte per block, a
  biased power-of-two exponent ``s``; the block's exponent is ``e = s - 127`` (the E8M0
  scale of the OCP microscaling formats). No mantissa: every scaling is a multiply by a
  power of two, exact in fp32 on CPU and GPU alike, and the range is fp32's, so fine-tuning
  moments (|g| ~ 1e-8, v ~ 1e-16) are not flushed as by fp16 scales (zero below ~6e-8).
* **Codes** (``<slot>.codes``, uint8): a magnitude ``q`` in ``[0, qmax]`` and, for signed
  moments, a sign bit above it (sign-magnitude; the value's own sign bit, so a negative value
  that rounds to zero is stored as -0). 8 bits: one code per byte, shape of the parameter.
  4 bits: two per byte, element ``2i`` in the low nibble, shape ``(ceil(n / 2),)``.
* **Value** ``= ±L(q) * 2**(e - k)``, ``k = ceil(log2(top))``, ``top = L(qmax)``, the largest
  level just below ``2**e``. ``L(q) < 2**24``, so decode is exact. Two level maps:

  - 8 bits, **shifted minifloat** (``MinifloatLevels``, M = 4 mantissa bits):
    ``L(q) = (16 + q mod 16) * 2**(q >> 4) - 16``: 0..15, then 16, 18, .., 46, 48, 52, ..:
    a relative step of 1/16 to 1/32 over 8 (m) or 16 (v) binades, linear near zero.
    ``L(q) + 16`` is the fp32 number whose exponent and top 4 mantissa bits are ``q``
    (offset by 16's), which makes decode and encode a few integer operations.
  - 4 bits, **square levels** (``PowerLevels``, p = 2): ``L(q) = q**2``, evenly spaced in
    ``sqrt(|x|)`` (fine near zero, where linear levels lose the block's small elements).

=====  ======================  =====  ===========  ====  ===============================
 bits  moment                   qmax   top          k    bytes/element (codes + scale)
=====  ======================  =====  ===========  ====  ===============================
 8     signed (m, momentum)     127    3952         12   1 + 1/16 = 1.0625
 8     nonnegative (v)          255    1015792      20   1 + 1/16 = 1.0625
 4     signed                   7      49           6    1/2 + 1/16 = 0.5625
 4     nonnegative              15     225          8    1/2 + 1/16 = 0.5625
=====  ======================  =====  ===========  ====  ===============================

AdamW keeps 2.125 bytes per element for both moments at 8 bits, 1.125 at 4 bits.
``docs/codecs.md`` gives the measurements behind these choices (against linear levels,
cube-root and minifloat levels, fp32 scales, blocks of 8 to 128).

Encode, element by element (what the Triton kernel repeats in registers):

1. ``e = E(absmax) + 1 + (mantissa(absmax) > thr)`` from the fp32 bits of the absmax of
   the block's new values, clamped to ``[k - 126, 127]``: the smallest exponent whose top
   level ``top * 2**(e - k)`` covers the block. The clamps keep ``2**(e - k)`` and
   ``2**(k - e)`` normal fp32 numbers (larger values saturate; values below ``2**-126``
   round on that grid).
2. ``t = min(|x| * 2**(k - e), top)`` (exact; inf and NaN saturate).
3. Stochastic rounding to one of the two levels around ``t``, unbiased in the value itself
   (up with probability equal to the fraction of the way to the upper level), from a 12-bit
   draw per element and moment:

   - minifloat: ``q = (bits(t + 16) - bits(16) + floor(u * 2**19)) >> 19``: within a level
     interval the fp32 mantissa of ``t + 16`` is linear in ``t``, so this is exact integer
     arithmetic (the one rounding, of ``t + 16``, is IEEE's on CPU and GPU alike);
   - square levels: ``lo = round(sqrt(t) - 0.5)`` (``floor(sqrt(t))`` except within ~2**-22
     of a level, where it may be one off: ``PowerLevels.quantize`` says why that is harmless),
     then ``q = lo + (u * (2 lo + 1) < t - lo**2)``, compared exactly.

   ``u = (bits >> 9) * 2**-23`` (the draw's top bits). CPU and GPU agree bit for bit (square
   levels: given the same ``lo``, always so in the Triton interpreter; on the GPU, whose sqrt is
   approximate, but for the rare near-level cases). Nearest rounding would freeze the EMA
   (``0.999 * v`` rounds back to ``v``); this keeps its decay exact in expectation, and a
   value on a level (zero included) stays put.
4. Nonnegative moments: a nonzero ``v`` never becomes 0 (``q = 1`` where ``q = 0 < x``). An
   Adam element with ``m != 0`` and a decoded ``v = 0`` would step by ``m / eps``; rounding
   up errs towards a smaller step. A round trip never more than halves ``sqrt(v)``: square
   levels, between the levels 1 and 4; minifloat levels never more than halve ``v`` itself
   (between 1 and 2).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .base import BitsFn, Family, KernelFormat, MomentCodec

BLOCK = 16
_SCALE_BIAS = 127
_MAX_EXPONENT = 127  # fp32's largest; a block's top level stays below 2**127 (beyond: saturation)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as fp32 for int32 exponents in [-126, 127], built from the bit pattern (exact)."""
    return ((exponent + 127) << 23).view(torch.float32)


# --- level maps: code magnitude q (int32) <-> value in units of the block's 2**(e - k) --------


class PowerLevels:
    """Levels ``q**p`` for ``q`` in [0, qmax] (p = 1: linear; p = 2: evenly spaced in sqrt)."""

    def __init__(self, qmax: int, power: int):
        if not 1 <= power <= 4 or qmax**power >= 1 << 24:
            raise ValueError(f"levels q**{power} up to q={qmax} are not exact in fp32")
        self.qmax, self.power, self.top = qmax, power, qmax**power

    def level(self, q: torch.Tensor) -> torch.Tensor:
        """q**p in fp32, exact (integers below 2**24)."""
        q = q.to(torch.float32)
        level = q
        for _ in range(self.power - 1):
            level = level * q
        return level

    def quantize(self, t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``t`` in [0, top] -> q (int32): ``lo`` with ``lo**p <= t < (lo + 1)**p``, plus one when
        ``u * gap < t - lo**p``. ``u`` uniform in [0, 1) rounds stochastically, 0.5 to nearest."""
        p = self.power
        if p == 1:
            lo = t.floor()
        elif p == 2:
            # round(sqrt(t) - 0.5) (ties to even), not corrected: the kernel does the same with its
            # approximate sqrt. lo is floor(sqrt(t)) except within ~2**-22 of a level, where it may
            # be one off; the decision below stays exact for any lo and is then still right with
            # probability > 1 - 2**-14 (one too low: d >= gap, always up; one too high: d < 0,
            # never up), so the fix-up (7 instructions per element in the kernel) is not worth it.
            lo = torch.round(t.sqrt() - 0.5)
        else:  # reference only: the root is rounded, fix its floor by at most one either way
            lo = (t.sqrt().sqrt() if p == 4 else t.pow(1.0 / 3.0)).floor()
            lo = lo - (self.level(lo) > t).to(torch.float32)
            lo = lo + (self.level(lo + 1) <= t).to(torch.float32)
        low = self.level(lo)
        # u * gap < t - low decided exactly (fp64 holds the product of two 24-bit values; the
        # difference is exact in fp32): the kernel gets the same answer from the sign of one fma
        up = u.double() * (self.level(lo + 1) - low).double() < (t - low).double()
        return lo.to(torch.int32) + up.to(torch.int32)

    def __repr__(self):
        return f"q**{self.power}"


class MinifloatLevels:
    """Levels ``L(c) = (2**M + c mod 2**M) * 2**(c >> M) - 2**M`` for codes ``c`` in [0, qmax]:
    ``c`` itself below ``2**M``, then ``M`` mantissa bits per binade (a relative step of
    ``2**-M`` to ``2**-(M + 1)``), like a minifloat shifted so that the linear part near zero
    joins the first binade.

    ``L(c) + 2**M`` is the fp32 number whose exponent and top ``M`` mantissa bits hold ``c``
    (plus ``2**M``'s pattern), so decode is an integer add; and since levels are linear between
    neighbours, stochastic rounding of ``t`` is an integer add of the draw to the bits of
    ``t + 2**M`` below the code and a shift: exact, unbiased, and about 15 fewer kernel
    instructions per element than square levels' root and exact decision.
    """

    def __init__(self, qmax: int, mantissa_bits: int):
        m = mantissa_bits
        self.qmax, self.mantissa_bits = qmax, m
        self.top = ((2**m + (qmax & (2**m - 1))) << (qmax >> m)) - 2**m
        if not 1 <= m <= 8 or self.top >= 1 << 24:
            raise ValueError(f"minifloat levels with {m} mantissa bits up to code {qmax} are not exact in fp32")
        self._base = (127 + m) << 23  # the pattern of 2**m

    def level(self, q: torch.Tensor) -> torch.Tensor:
        """L(q) in fp32, exact (integers below 2**24)."""
        m = self.mantissa_bits
        return ((q.to(torch.int32) << (23 - m)) + self._base).view(torch.float32) - float(2**m)

    def quantize(self, t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``t`` in [0, top] -> c (int32), rounded up with probability equal to the fraction of the
        way from L(c) to L(c + 1); ``u`` uniform in [0, 1) on a 2**-23 grid."""
        m = self.mantissa_bits
        y = (t + float(2**m)).view(torch.int32)  # fp32 add: the only rounding, as in the kernel
        draw = (u * float(2 ** (23 - m))).floor().to(torch.int32)  # exact: u has 23 bits
        return ((y - self._base + draw) >> (23 - m)).clamp(max=self.qmax)

    def __repr__(self):
        return f"minifloat M{self.mantissa_bits}"


class BlockCodec(MomentCodec):
    """A block-quantized moment (see the module docstring); immutable, one per (format, shape)."""

    suffixes = (".codes", ".scales")

    def __init__(self, bits: int, signed: bool, levels, block: int, shape: torch.Size, name: str = ""):
        if bits not in (8, 4) or levels.qmax != (1 << (bits - signed)) - 1 or block < 2 or block & (block - 1):
            raise ValueError(f"unsupported block format: bits={bits}, signed={signed}, {levels!r}, block={block}")
        self.state_bits = bits
        self.signed = signed
        self.levels = levels
        self.block = block  # a power of two (so 4-bit pairs never straddle blocks)
        self.shape = torch.Size(shape)
        self.qmax, self.top = levels.qmax, levels.top
        self.k = (self.top - 1).bit_length()  # top <= 2**k < 2 * top
        # e = E(absmax) + 1 covers the block iff the absmax mantissa 1.f <= 2 * top / 2**k.
        self.mantissa_threshold = ((self.top << 24) >> self.k) - (1 << 23)
        self.min_exponent = self.k - 126
        self.name = name or f"block{bits}-{levels!r}-{block}"
        self.kernel_format = self._kernel_format()

    def _kernel_format(self) -> KernelFormat | None:
        """The kernel's switches for these levels and E8M0 scales (None: the kernel lacks the levels)."""
        if type(self.levels) is PowerLevels and self.levels.power in (1, 2):
            power = self.levels.power
        elif type(self.levels) is MinifloatLevels:
            power = -self.levels.mantissa_bits
        else:
            return None
        return KernelFormat(
            Family.BLOCK,
            self.state_bits,
            signed=self.signed,
            power=power,
            qmax=self.qmax,
            k=self.k,
            min_exponent=self.min_exponent,
            threshold=self.mantissa_threshold,
            top=self.top,
            block=self.block,
        )

    # --- layout ------------------------------------------------------------------------------

    def _blocks(self, shape: torch.Size) -> int:
        return -(-shape.numel() // self.block)

    def _codes_shape(self, shape: torch.Size) -> torch.Size:
        return shape if self.state_bits == 8 else torch.Size([-(-shape.numel() // 2)])

    def layout(self, shape):
        shape = torch.Size(shape)
        return {
            ".codes": (torch.uint8, self._codes_shape(shape)),
            ".scales": (self.scale_dtype, torch.Size([self._blocks(shape)])),
        }

    def zeros(self, shape, device):
        # The canonical encoding of zeros, so encode(decode(zeros)) == zeros.
        shape = torch.Size(shape)
        codes = torch.zeros(self._codes_shape(shape), dtype=torch.uint8, device=device)
        absmax = torch.zeros(self._blocks(shape), dtype=torch.float32, device=device)
        return {".codes": codes, ".scales": self.block_scales(absmax)}

    # --- scales: the only part that knows the scale format ------------------------------------

    scale_dtype = torch.uint8

    def block_scales(self, absmax: torch.Tensor) -> torch.Tensor:
        """Stored scale of each block from its fp32 absmax (step 1 of the docstring)."""
        pattern = absmax.view(torch.int32)
        biased = (pattern >> 23) & 0xFF
        e = biased - 126 + ((pattern & 0x7FFFFF) > self.mantissa_threshold).to(torch.int32)
        return (e.clamp(self.min_exponent, _MAX_EXPONENT) + _SCALE_BIAS).to(torch.uint8)

    def level_units(self, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(value of one level unit, its inverse) per block, fp32; both exact powers of two."""
        # Any byte gives finite units: the exponent is clamped as on encode.
        e = (scales.to(torch.int32) - _SCALE_BIAS).clamp(self.min_exponent, _MAX_EXPONENT)
        return _pow2(e - self.k), _pow2(self.k - e)

    def invalid(self, stored, *, signed=True):
        """Scale bytes outside the biased exponents ``block_scales`` writes, ``min_exponent`` to fp32's
        largest. Decode clamps them, so they read as finite numbers, but no checkpoint of this format holds
        them: the bytes are not what was saved. Every code byte is some level (a sign bit included)."""
        scales = stored[".scales"]
        low, high = self.min_exponent + _SCALE_BIAS, _MAX_EXPONENT + _SCALE_BIAS
        bad = int(((scales < low) | (scales > high)).sum())
        if bad:
            n = scales.numel()
            return f"{bad} of its {n} block scales are outside [{low}, {high}], the biased exponents an encode writes"
        return None

    # --- decode ------------------------------------------------------------------------------

    def _unpack(self, codes: torch.Tensor, n_padded: int) -> torch.Tensor:
        codes = codes.reshape(-1).to(torch.int32)
        if self.state_bits == 4:
            codes = torch.stack((codes & 0xF, codes >> 4), dim=1).reshape(-1)
        return F.pad(codes, (0, n_padded - codes.numel()))

    def decode(self, stored):
        n, nb = self.shape.numel(), self._blocks(self.shape)
        codes = self._unpack(stored[".codes"], nb * self.block).view(nb, self.block)
        unit, _ = self.level_units(stored[".scales"])
        x = self.levels.level(codes & self.qmax) * unit.unsqueeze(1)
        if self.signed:
            x = torch.where((codes >> (self.state_bits - 1)) != 0, -x, x)
        return x.reshape(-1)[:n].reshape(self.shape)

    # --- encode ------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, bits: BitsFn):
        n, nb = self.shape.numel(), self._blocks(self.shape)
        pad = nb * self.block - n
        x = F.pad(x.reshape(-1).float(), (0, pad)).view(nb, self.block)
        mag = x.abs()
        scales = self.block_scales(mag.amax(dim=1))
        t = mag * self.level_units(scales)[1].unsqueeze(1)
        t = torch.where(t < self.top, t, float(self.top))  # saturate (also inf and NaN)
        u = ((bits().reshape(-1) >> 9).to(torch.int32)).to(torch.float32) * 2.0**-23
        q = self.levels.quantize(t, F.pad(u, (0, pad)).view(nb, self.block))
        if self.signed:  # the sign bit of the value (a negative value rounded to zero gives -0)
            q = q | ((x.view(torch.int32) >> 31) & (1 << (self.state_bits - 1)))
        else:
            q = torch.where((q == 0) & (x > 0), 1, q)
        codes = q.reshape(-1)
        if self.state_bits == 4:
            codes = codes.view(-1, 2)  # nb * block is even
            codes = codes[:, 0] | (codes[:, 1] << 4)
        codes = codes[: self._codes_shape(self.shape).numel()].to(torch.uint8)
        return {
            ".codes": codes.reshape(self._codes_shape(self.shape)),
            ".scales": scales,
        }

    def __repr__(self):
        kind = "signed" if self.signed else "unsigned"
        return f"BlockCodec(bits={self.state_bits}, {kind}, levels={self.levels!r}, block={self.block})"


# The formats by checkpoint name: (bits, levels of a signed moment, of a nonnegative one). A name
# keeps its meaning forever; a new level map gets a new name.
FORMATS = {
    "block8": (8, MinifloatLevels(127, 4), MinifloatLevels(255, 4)),
    "block4": (4, PowerLevels(7, 2), PowerLevels(15, 2)),
}


@functools.cache
def block_codec(name: str, signed: bool, shape: torch.Size) -> BlockCodec:
    """The shared codec of the format ``name`` for a moment of ``shape`` (signed: m, momentum; else v)."""
    bits, signed_levels, unsigned_levels = FORMATS[name]
    return BlockCodec(bits, signed, signed_levels if signed else unsigned_levels, BLOCK, shape, name)
