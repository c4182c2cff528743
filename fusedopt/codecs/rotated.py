"""Rotated n-bit moments: the state formats ``rot8``, ``rot4`` and ``rot2`` (``state_format=...``).

Format of one moment tensor of ``n`` elements, taken flattened in row-major order:

* **Blocks** of ``BLOCK`` = 256 elements. The last block is padded to 256 (the rotation needs
  all of them): a tensor of fewer than 256 elements is one padded block.
* **Rotation.** Each block ``x`` is stored rotated, ``y = H x``, with ``H = H4 (x) H4 (x) H4 (x)
  H4`` (Kronecker product), ``H4 = [[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]] / 2``:
  a *regular* Hadamard matrix, normalised. ``H`` is orthogonal and symmetric (``H H = I``), so
  the same transform rotates and rotates back. The rotation spreads an outlier over the whole
  block, so one symmetric scale covers it without crushing the other 255 elements. Every row of
  ``H`` sums to 1 (that is what regular means): a constant block maps to itself, so a block of
  positive values (a second moment) does not pile its mean into one coordinate, as it would
  with the Sylvester (Walsh) matrix, whose first row takes 16 times the mean.
* **Codes** (``<slot>.codes``, uint8): ``y / scale`` as ``bits``-bit two's complement integers in
  ``[-qmax, qmax]``, ``qmax = 2**(bits - 1) - 1`` (127, 7, 1), ``8 / bits`` per byte, element ``i``
  of a byte at bits ``bits * i`` upwards. Shape ``(256 * blocks * bits / 8,)``; zero is the
  zero byte.
* **Scales** (``<slot>.scales``, fp32, shape ``(blocks,)``): one per block.
* **Nonnegative moments** (Adam's ``v``) are stored as ``s = sqrt(v)``, the quantity the update
  divides by, with half the dynamic range. Decode returns ``max(s, scale)**2``: a ``sqrt(v)``
  below one code step is not resolved by the block (the rotation mixes every coordinate's
  rounding into every element), and an Adam element whose decoded ``v`` fell to 0 would step by
  ``m / eps``; the floor bounds that step instead.

Bytes per element of one moment: ``bits / 8 + 4 / 256``: 1.016 (rot8), 0.516 (rot4), 0.266
(rot2); both Adam moments 2.03, 1.03 and 0.53.

Decode: ``H c`` of integer codes is exact in fp32 (every partial sum is a small multiple of
1/16), then one multiply by the scale.

Encode (``encode_decayed``, what the update uses when the algorithm tells the EMA decay ``d``
of the moment, ``x = d * x_old + increment``): the decay is applied exactly to the block's
scale (``scale * d``, ``sqrt(d)`` for the square-root domain), and only the increment, taken
against the value decode returned, is rotated, added to the old codes and rounded
stochastically::

    q = c_old + floor(H (T(x) - d * T(x_old)) / (scale * d) + u)     (T: identity, or sqrt for v)

An element with no gradient keeps its codes and decays exactly with the scale; rounding noise
enters in proportion to the increments (Poisson-like), not one code per step. (Re-rounding
``d * x_old`` every step would either freeze the EMA under nearest rounding, or, with
stochastic rounding, add up to a code of noise each step that an EMA of memory ``1 / (1 - d)``
keeps: about 13 codes rms for ``v`` at ``beta2 = 0.999``, more than the whole 4-bit grid.)
Only a block where a code would leave ``[-qmax, qmax]`` is re-rounded on a new scale, from the
same draws: ``max |values| / (qmax / 1.25)`` (at least ``max |values|``), 1.25 times headroom
so steady growth does not re-round it every step. A block of scale 0 (never written, or all
zero) starts from its increment. Without a decay (checkpoint conversion, algorithms that do
not declare it) ``encode`` rounds every block afresh that way.

Draws: the moment's 12-bit field of the update's shared hash word, for element ``i`` (a padding
coordinate ``i >= n`` takes element ``i mod n``'s), mixed with ``i`` by the hash's finaliser into
24 bits: ``u = (fmix32(word ^ i) >> 8) / 2**24``. The increment of ``v`` per step is often a
few thousandths of a code; a 12-bit ``u`` would round those on a grid of ``2**-12`` and lose
(or, centred, systematically misround) them, while the mixed ``u`` rounds each coordinate up
with its exact probability on average over coordinates.

The fused update kernel (``fusedopt/kernels/rotated.py``) repeats these operations in the same
order (the rotation's adds included), for algorithms that declare their EMA decays; the GPU parity
tests (``tests/gpu/test_state_formats_on_cuda.py``) hold it to this reference bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fusedopt import rng

from .base import ROTATED, BitsFn, KernelFormat, MomentCodec

BLOCK = 256
HEADROOM = 1.25  # a re-rounded block's largest value sits at qmax / HEADROOM
_TINY = 1e-30  # divisor of a block of scale 0: every nonzero value then leaves the grid
_BIG = 2.0**50  # values are saturated here (inf, NaN: 0): no overflow in the rotation or in v = s**2


def butterflies(x: torch.Tensor) -> torch.Tensor:
    """``16 H y`` for every row ``y`` of ``x`` (shape ``(..., 256)``, fp32): four 4-point stages, each
    ``2 H4`` along one base-4 digit of the index (most significant first), adds in a fixed order
    (deterministic; the kernel does the same adds in the same order)."""
    y = x.reshape(-1, 4, 4, 4, 4)
    for axis in (1, 2, 3, 4):
        a, b, c, d = y.unbind(axis)
        sab, dab, scd, dcd = a + b, a - b, c + d, c - d
        y = torch.stack((sab + dcd, sab - dcd, dab + scd, scd - dab), dim=axis)
    return y.reshape(x.shape)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``H y`` for every row ``y`` of ``x``: the butterflies, then one exact multiply by 1/16 (a power of
    two, instead of 1/2 at every stage: a quarter of the multiplies)."""
    return butterflies(x) * 0.0625


def hadamard_matrix() -> torch.Tensor:
    """``H`` as a 256 x 256 fp32 matrix (for tests and documentation)."""
    return hadamard(torch.eye(BLOCK)).T.contiguous()


class RotatedCodec(MomentCodec):
    """A rotated n-bit moment (see the module docstring); immutable, one per (format, sign, shape)."""

    suffixes = (".codes", ".scales")

    def __init__(self, bits: int, signed: bool, shape: torch.Size, name: str):
        if bits not in (8, 4, 2):
            raise ValueError(f"rotated codes of {bits} bits are not supported (8, 4 or 2)")
        self.name, self.state_bits, self.signed = name, bits, signed
        self.shape = torch.Size(shape)
        self.qmax = (1 << (bits - 1)) - 1
        # a multiply by the inverse, not a division: what torch does for a scalar divisor anyway, made
        # explicit so the kernel repeats it (the fp32 rounding of 1 / rescale, then one fp32 multiply)
        self.inverse_rescale = 1.0 / max(self.qmax / HEADROOM, 1.0)
        self.numel = self.shape.numel()
        self.blocks = max(1, -(-self.numel // BLOCK))
        self.kernel_format = KernelFormat(
            ROTATED + bits, signed=signed, qmax=self.qmax, block=BLOCK, inverse_rescale=self.inverse_rescale
        )

    # --- layout ------------------------------------------------------------------------------

    def layout(self, shape):
        blocks = max(1, -(-torch.Size(shape).numel() // BLOCK))
        return {
            ".codes": (torch.uint8, torch.Size([blocks * BLOCK * self.state_bits // 8])),
            ".scales": (torch.float32, torch.Size([blocks])),
        }

    def zeros(self, shape, device):
        return {s: torch.zeros(size, dtype=dtype, device=device) for s, (dtype, size) in self.layout(shape).items()}

    # --- codes ---------------------------------------------------------------------------------

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        """int32 codes in ``[-qmax, qmax]`` (flat, a multiple of 256) -> the packed uint8 bytes."""
        bits = self.state_bits
        if bits == 8:
            return q.to(torch.int8).view(torch.uint8)
        per = 8 // bits
        low = (q & ((1 << bits) - 1)).view(-1, per)
        out = low[:, 0]
        for j in range(1, per):
            out = out | (low[:, j] << (bits * j))
        return out.to(torch.uint8)

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed bytes -> int32 codes, ``(blocks, 256)``."""
        bits = self.state_bits
        if bits == 8:
            return codes.view(torch.int8).to(torch.int32).view(-1, BLOCK)
        c = codes.to(torch.int32)
        low = torch.stack([(c >> (bits * j)) & ((1 << bits) - 1) for j in range(8 // bits)], dim=1).reshape(-1)
        return (low - ((low >> (bits - 1)) << bits)).view(-1, BLOCK)  # sign extension

    # --- decode ------------------------------------------------------------------------------

    def stored_values(self, stored) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes as fp32, scales, the block values in the storage domain) of a stored moment, all
        blocks padded: ``H c * scale``, floored at the scale for nonnegative moments."""
        codes = self.unpack(stored[".codes"]).to(torch.float32)
        scales = stored[".scales"]
        t = butterflies(codes) * (scales * 0.0625).unsqueeze(1)  # 16 H c is exact: one rounding
        if not self.signed:
            t = torch.maximum(t, scales.unsqueeze(1))
        return codes, scales, t

    def decode(self, stored):
        t = self.stored_values(stored)[2].reshape(-1)[: self.numel].reshape(self.shape)
        return t if self.signed else t * t

    # --- encode ------------------------------------------------------------------------------

    def _domain(self, x: torch.Tensor) -> torch.Tensor:
        """The moment in the storage domain (sqrt for a nonnegative one), flat, saturated."""
        x = x.reshape(-1).float()
        if not self.signed:
            # torch's vectorised CPU sqrt is not correctly rounded; the fp64 one is, like the kernel's sqrt_rn
            x = x.clamp_min(0.0).double().sqrt().float()
        return x.nan_to_num(0.0, _BIG, -_BIG).clamp(-_BIG, _BIG)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, self.blocks * BLOCK - self.numel)).view(self.blocks, BLOCK)

    def uniforms(self, bits: BitsFn) -> torch.Tensor:
        """One uniform in [0, 1) per coordinate, ``(blocks, 256)`` (see the module docstring)."""
        words = bits().reshape(-1)
        idx = torch.arange(self.blocks * BLOCK, dtype=torch.int64, device=words.device)
        source = torch.where(idx < self.numel, idx, idx % max(self.numel, 1))
        return rng.spread_uniform(words[source], idx).view(self.blocks, BLOCK)

    def round_blocks(self, codes: torch.Tensor, scales: torch.Tensor, increment: torch.Tensor, u: torch.Tensor):
        """The blocks ``codes * scales + increment`` (rotated, ``(blocks, 256)``) on the grid of ``scales``:
        ``codes + floor(increment / scale + u)`` (an integer code plus the rounded increment, so a
        coordinate without increment keeps its code exactly); a block where a code would leave the grid
        is rounded afresh on a new scale with headroom, from the same draws."""
        # a multiply by the block's inverse scale (one division per block, not one per coordinate)
        q = codes + torch.floor(increment * (1.0 / scales.clamp_min(_TINY)).unsqueeze(1) + u)
        over = q.abs().amax(dim=1) > self.qmax
        values = codes * scales.unsqueeze(1) + increment
        scales = torch.where(over, values.abs().amax(dim=1) * self.inverse_rescale, scales)
        fresh = torch.floor(values * (1.0 / scales.clamp_min(_TINY)).unsqueeze(1) + u)
        q = torch.where(over.unsqueeze(1), fresh, q).clamp(-self.qmax, self.qmax)
        return {".codes": self.pack(q.to(torch.int32).reshape(-1)), ".scales": scales}

    def encode(self, x, bits):
        values = hadamard(self._padded(self._domain(x)))
        zeros = torch.zeros(self.blocks, device=values.device)
        return self.round_blocks(torch.zeros_like(values), zeros, values, self.uniforms(bits))

    def encode_decayed(self, x, bits, previous, decay):
        codes, scales, t_old = self.stored_values(previous)
        d = decay if self.signed else math.sqrt(decay)
        increment = self._domain(x) - d * t_old.reshape(-1)[: self.numel]
        return self.round_blocks(codes, scales * d, hadamard(self._padded(increment)), self.uniforms(bits))

    def __repr__(self):
        return f"RotatedCodec(bits={self.state_bits}, {'signed' if self.signed else 'unsigned'})"


# name -> bits. A name keeps its meaning forever.
FORMATS = {"rot8": 8, "rot4": 4, "rot2": 2}


@functools.cache
def rotated_codec(name: str, signed: bool, shape: torch.Size) -> RotatedCodec:
    """The shared codec of the rotated format ``name`` for a moment of ``shape``."""
    return RotatedCodec(FORMATS[name], signed, torch.Size(shape), name)
