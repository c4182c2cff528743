"""Normalised first moments: the codec ``norm2`` of a signed moment stored in units of the square
root of its frame (``MomentCodec.frame``; AdamW: ``m / sqrt(v)``), used by the state format
``norm2-root4`` (``codecs/__init__.py``).

Adam applies ``m`` through ``m / (sqrt(v) + eps)``. A block scale on ``m`` itself gives every
element of a block the same absolute error, which becomes a large error in the update of an
element with a small ``v``; stored as ``q = m / sqrt(v)`` (the update before bias corrections and
eps), every element's error is a fraction of its own update. ``|q|`` is bounded by the EMAs
(about ``(1 - b1) / sqrt(1 - b2) / (1 - b1 / sqrt(b2))``, 32 at the default betas), whatever the
gradients' scale.

Format of one moment tensor of ``n`` elements, taken flattened in row-major order:

* **Frame**: the frame's decoded value ``f`` (the second moment as stored, after the update when
  encoding, the same tensor when decoding at the next update), ``r = sqrt(f)`` (correctly
  rounded). Where ``f = 0`` (an element that never had a gradient) ``m`` is stored and decoded as 0.
* **Blocks** of ``BLOCK`` = 64 elements; the last one is padded.
* **Scales** (``<slot>.scales``, bf16, shape ``(blocks,)``): the half-range of the block's levels,
  rounded up to bf16: its largest ``|q|``, at most ``CLIP`` = 2.5 times the root mean square of its
  64 ``q`` (larger ``|q|`` are clipped to it).
* **Codes** (``<slot>.codes``, uint8): ``bits``-bit indices ``c`` in ``[0, L]``, ``L = 2**bits - 1``,
  ``8 / bits`` per byte, element ``i`` of a byte at bits ``bits * i`` upwards. Shape
  ``(64 * blocks * bits / 8,)``.
* **Value**: ``m = (2 c - L) / L * scale * r``: ``L + 1`` levels evenly spaced over
  ``[-scale, scale]`` (2 bits: ``-1, -1/3, 1/3, 1``; no level at 0, which halves the gap of a
  3-level code over the same range). A block of scale 0 is all zeros.

Encode: stochastic rounding to the two levels around ``q * (1 / scale)`` (the reciprocal rounded once
per block), unbiased, from the top 23 bits of a whole hash word per element (``rng.top_uniform``;
``whole_word``; 16, the rest zero, where a bf16 parameter without a correction takes the word's low 16).
The codes are rounded afresh each step: the frame moves every step, so a decay cannot be kept exact on a
scale. Each step's rounding noise stays in ``m`` with weight ``b1**k``, about ``1 / (1 - b1**2)`` steps'
worth; with 4 levels spanning the block's absmax that noise is larger than ``m`` itself, so the
half-range is capped. The cap biases ``|m|``, and with it every update, towards zero: at 1.2 rms (the
cap until measured across learning rates) updates drifted at 0.54-0.72 of AdamW's, a smaller effective
lr that trained 13% worse than the default at lr 2.5e-4; at 2.5 rms the drift is 0.87-1.02 of AdamW's
and the format is within 0.3% of the default at lrs up to 5e-4 and better above (benchmarks/RESULTS.md,
"norm2-root4 across learning rates").

Bytes per element: ``2 / 8 + 2 / 64`` = 0.281 (2.25 bits).

The fused update kernel (``fusedopt/kernels/normalised.py``) repeats these operations in the same
order, with the root-grid second moment as the frame (its decoded roots are the frame's square
roots exactly, so the kernel takes them without a square root);
``tests/test_lowbit_kernel.py`` holds it to this reference bit for bit in Triton's interpreter,
``tests/gpu/test_state_formats_on_cuda.py`` on the GPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fusedopt import rng

from .base import BitsFn, Family, KernelFormat, MomentCodec

BLOCK = 64
_BIG = 2.0**60  # q is saturated here (inf: here, NaN: 0)


def neighbour_sums(x: torch.Tensor) -> torch.Tensor:
    """The sum of each row of ``x`` (a power-of-two width), added in a fixed order: neighbours first,
    then neighbouring pairs, and so on. torch's reduction order is its own; this one the kernel repeats."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x.squeeze(-1)


def block_rms(q: torch.Tensor) -> torch.Tensor:
    """The root mean square of each row of ``q`` (``(blocks, BLOCK)``): the sum of squares in
    ``neighbour_sums``' order, an exact multiply by ``1 / BLOCK``, a correctly rounded square root."""
    return (neighbour_sums(q * q) * (1.0 / BLOCK)).double().sqrt().float()


class NormalisedCodec(MomentCodec):
    """A signed moment in units of the square root of its frame (see the module docstring)."""

    suffixes = (".codes", ".scales")
    frame = True
    whole_word = True
    block = BLOCK

    def __init__(self, bits: int, clip: float, shape: torch.Size, name: str):
        if bits != 2 or not clip > 0:
            raise ValueError(f"normalised codes of {bits} bits, clip {clip!r} are not supported (2 bits, a clip > 0)")
        self.name, self.state_bits, self.clip = name, bits, clip
        self.shape = torch.Size(shape)
        self.numel = self.shape.numel()
        self.blocks = max(1, -(-self.numel // BLOCK))
        self.top = (1 << bits) - 1  # L
        # the kernel multiplies by the clip as torch does here: rounded to fp32 first
        fp32_clip = float(torch.tensor(clip, dtype=torch.float32))
        self.kernel_format = KernelFormat(Family.NORMALISED, bits, qmax=self.top, block=BLOCK, clip=fp32_clip)

    # --- layout ------------------------------------------------------------------------------

    def layout(self, shape):
        blocks = max(1, -(-torch.Size(shape).numel() // BLOCK))
        return {
            ".codes": (torch.uint8, torch.Size([blocks * BLOCK * self.state_bits // 8])),
            ".scales": (torch.bfloat16, torch.Size([blocks])),
        }

    def zeros(self, shape, device):
        return {s: torch.zeros(size, dtype=dtype, device=device) for s, (dtype, size) in self.layout(shape).items()}

    # --- codes ---------------------------------------------------------------------------------

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        bits = self.state_bits
        per = 8 // bits
        c = codes.reshape(-1, per).to(torch.int32)
        out = c[:, 0]
        for j in range(1, per):
            out = out | (c[:, j] << (bits * j))
        return out.to(torch.uint8)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        bits = self.state_bits
        c = packed.to(torch.int32)
        low = torch.stack([(c >> (bits * j)) & self.top for j in range(8 // bits)], dim=1)
        return low.reshape(self.blocks, BLOCK)

    # --- the frame -----------------------------------------------------------------------------

    def _root(self, frame: torch.Tensor) -> torch.Tensor:
        """sqrt of the frame, flat, padded with zeros; fp64 sqrt: correctly rounded, like a kernel's sqrt_rn."""
        if frame is None or frame.numel() != self.numel:
            raise ValueError(f"the state format {self.name!r} needs its frame (the decoded second moment)")
        r = frame.reshape(-1).double().clamp_min(0.0).sqrt().float()
        return F.pad(r, (0, self.blocks * BLOCK - self.numel)).view(self.blocks, BLOCK)

    def invalid(self, stored, *, signed=True):
        """The base checks, and half-ranges above the saturated ``|q|`` (``_BIG``), which an encode never
        exceeds: a bf16 scale can be far larger, and times the frame's root it decodes an infinite m."""
        problem = super().invalid(stored, signed=signed)
        if problem is not None:
            return problem
        scales = stored[".scales"]
        bad = int((scales.float() > _BIG).sum())
        if bad:
            return f"{bad} of its {scales.numel()} block scales are above the largest an encode writes ({_BIG:g})"
        return None

    # --- decode ------------------------------------------------------------------------------

    def decode(self, stored, frame=None):
        codes = self.unpack(stored[".codes"]).to(torch.float32)
        q = (2 * codes - self.top) * (stored[".scales"].float() / self.top).unsqueeze(1)
        m = q * self._root(frame)
        return m.reshape(-1)[: self.numel].reshape(self.shape)

    def decode_elements(self, codes: torch.Tensor, scales: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
        """``decode``'s value of each element from its own code, its block's scale and its frame's value
        (flat; a sharded checkpoint's element-wise layout)."""
        q = (2 * codes.float() - self.top) * (scales.float() / self.top)
        return q * frame.reshape(-1).double().clamp_min(0.0).sqrt().float()

    # --- encode ------------------------------------------------------------------------------

    def encode(self, x, bits: BitsFn, frame=None):
        r = self._root(frame)
        x = F.pad(x.reshape(-1).float(), (0, self.blocks * BLOCK - self.numel)).view(self.blocks, BLOCK)
        q = torch.where(r > 0, x / r, 0.0).nan_to_num(0.0, _BIG, -_BIG).clamp(-_BIG, _BIG)
        half = torch.minimum(q.abs().amax(dim=1), self.clip * block_rms(q))
        scales = half.to(torch.bfloat16)
        scales = torch.where(scales.float() < half, scales.view(torch.int16).add(1).view(torch.bfloat16), scales)
        u = F.pad(rng.top_uniform(bits().reshape(-1)), (0, self.blocks * BLOCK - self.numel)).view(self.blocks, BLOCK)
        unit = scales.float().unsqueeze(1)
        # times the block's reciprocal (one division per block, not per element: the kernel's cost)
        t = ((q * (1.0 / unit.clamp_min(1e-30)) + 1) * (self.top / 2)).clamp(0, self.top)
        codes = torch.floor(t + u).clamp(max=self.top)
        codes = torch.where(unit > 0, codes, 0.0).to(torch.int32)  # a zero block: the zero encoding
        return {".codes": self.pack(codes), ".scales": scales}

    def __repr__(self):
        return f"NormalisedCodec(bits={self.state_bits}, clip={self.clip})"


# name -> (bits, clip: the half-range at most this many block rms)
FORMATS = {"norm2": (2, 2.5)}


@functools.cache
def normalised_codec(name: str, signed: bool, shape: torch.Size) -> NormalisedCodec:
    """The shared codec of ``name`` for a signed moment of ``shape``."""
    if not signed:
        raise ValueError(f"the state format {name!r} stores signed moments only (a first moment)")
    bits, clip = FORMATS[name]
    return NormalisedCodec(bits, clip, torch.Size(shape), name)
