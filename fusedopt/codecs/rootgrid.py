"""Root-grid second moments: the codec ``root4`` of nonnegative moments (Adam's ``v``), used by the
state format ``norm2-root4`` (``codecs/__init__.py``).

What makes a 4-bit ``v`` track its EMA: the decay exact on the block scale, only increments rounded.
The levels are a minifloat's, so the level below a value and the stochastic decision are a few
integer operations, and the square root Adam takes of ``v`` is what is stored.

Format of one moment tensor of ``n`` elements, taken flattened in row-major order:

* **Blocks** of ``BLOCK`` = 128 elements; the last one is padded with zeros.
* **Codes** (``<slot>.codes``, uint8, shape ``(64 * blocks,)``): a 4-bit index ``c`` per element,
  two per byte, element ``2i`` in the low nibble.
* **Units** (``<slot>.scales``, fp32, shape ``(blocks,)``): the block's unit ``w``.
* **Value**: ``r = L(c) * w`` is the square root of the moment, ``v = r * r`` (both rounded
  once; ``r`` below ``2**-63``, whose square would be subnormal, decodes as 0). So ``sqrt(v)`` is
  ``r`` exactly, and a first moment stored in units of ``sqrt(v)`` (``norm2``) needs no square root.
  ``L`` are shifted minifloat levels with 2 mantissa bits (``blockwise.MinifloatLevels(15, 2)``):
  0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 36, 44, 52; ``r`` steps of at most 1.29 (``v``
  1.65) over the top three binades, a ``v`` range of 11 binades.

Bytes per element: ``1/2 + 4/128`` = 0.531 (4.25 bits).

Encode of a block afresh (``encode``, and a block whose roots leave its grid): ``w = max r *
(HEADROOM / 52)`` (the top level a quarter above the block's largest root). Each root is rounded
stochastically to one of the two levels around ``t = r * (1 / w)`` (unbiased in ``r``, so ``v`` runs
a little high: docs/codecs.md) from a 24-bit uniform per element; a nonzero value never becomes 0
(it takes level 1 at least).

Encode in an update (``encode_decayed``, ``v = d * v_old + increment``): the unit decays by
``sqrt(d)`` (rounded to fp32 once), so every level scales with the EMA's decay; an element without
increment (``v == d * v_old``) keeps its code, and the others are rounded on the decayed grid,
where their old value sits on a level, so rounding noise enters in proportion to the increment. A
block with a root above its decayed top level (or whose unit decayed to 0) is encoded afresh.

Draws: a whole hash word per element, its top 23 bits (``NibbleBlockCodec.uniforms``).
"""

from __future__ import annotations

import functools
import math

import torch

from .base import Family, KernelFormat
from .blockwise import MinifloatLevels
from .nibbles import BLOCK, NibbleBlockCodec

LEVELS = MinifloatLevels(15, 2)
TOP = LEVELS.top  # 52
HEADROOM = 1.25  # a fresh block's top level over its largest root
FRESH_UNIT = float(torch.tensor(HEADROOM / TOP, dtype=torch.float32))  # a fresh unit per unit of the largest root
SMALLEST_ROOT = 2.0**-63  # smaller roots decode as 0
LARGEST_UNIT = 2.0**50 * FRESH_UNIT  # the unit of a block whose largest root is the saturated one (exact)
_SLACK = 2.0**-20  # a root within fp32 rounding of the top level is on the grid


def root_decay(decay: float) -> float:
    """The unit's decay for an EMA decay ``d`` of ``v``: ``sqrt(d)`` rounded once to fp32."""
    return float(torch.tensor(math.sqrt(decay), dtype=torch.float32))


class RootGridCodec(NibbleBlockCodec):
    """A nonnegative moment stored as its square root on minifloat levels (see the module docstring)."""

    suffixes = (".codes", ".scales")
    block_tensors = {".scales": torch.float32}
    kernel_format = KernelFormat(Family.ROOT_GRID, 4, signed=False, block=BLOCK)

    # --- decode ------------------------------------------------------------------------------

    @staticmethod
    def roots(codes: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        """``L(c) * w`` of int32 ``codes`` ``(blocks, 128)`` under the blocks' ``units``; a root below
        ``2**-63`` as 0 (its square would be subnormal, and the square root of the square not the root)."""
        r = LEVELS.level(codes) * units.unsqueeze(1)
        return torch.where(r >= SMALLEST_ROOT, r, 0.0)

    def decode_blocks(self, stored) -> tuple[torch.Tensor, torch.Tensor]:
        codes = self.unpack(stored[".codes"])
        r = self.roots(codes, stored[".scales"])
        return codes, r * r

    def decode_elements(self, codes: torch.Tensor, units: torch.Tensor, frame=None) -> torch.Tensor:
        """``decode``'s value of each element from its own code and its block's unit (flat; a sharded
        checkpoint's element-wise layout)."""
        r = self.roots(codes.to(torch.int32).reshape(-1, 1), units.reshape(-1))
        return (r * r).reshape(-1)

    # --- encode ------------------------------------------------------------------------------

    @staticmethod
    def round_to_grid(r: torch.Tensor, units: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The codes of roots ``r`` (``(blocks, 128)``, >= 0) rounded stochastically to the levels of
        ``units`` (unbiased in ``r``); 0 stays 0, a nonzero root takes level 1 at least."""
        inverse = torch.where(units > 0, 1.0 / units, 0.0).unsqueeze(1)
        t = r * inverse
        t = torch.where(t < TOP, t, float(TOP))  # saturate (inf, NaN too)
        codes = LEVELS.quantize(t, u)
        return torch.where(r > 0, codes.clamp_min(1), 0)

    def encode(self, x, bits):
        r = self.values(x).double().sqrt().float()  # correctly rounded, as a kernel's sqrt_rn
        units = r.amax(dim=1) * FRESH_UNIT
        return {".codes": self.pack(self.round_to_grid(r, units, self.uniforms(bits))), ".scales": units}

    def encode_decayed(self, x, bits, previous, decay):
        old_codes, old_values = self.decode_blocks(previous)
        y = self.values(x)
        r = y.double().sqrt().float()
        units = previous[".scales"] * root_decay(decay)
        # no increment: the code stays (the value decays with the unit); x itself, not its saturation:
        # a stored v may exceed the saturation (the top level has headroom over the largest root)
        same = self.padded(x.float()) == old_values * decay
        below_top = r <= (units * (TOP * (1 + _SLACK))).unsqueeze(1)
        fits = (same | below_top).all(dim=1) & (units > 0)
        units = torch.where(fits, units, r.amax(dim=1) * FRESH_UNIT)
        codes = self.round_to_grid(r, units, self.uniforms(bits))
        codes = torch.where(fits.unsqueeze(1) & same, old_codes, codes)
        return {".codes": self.pack(codes), ".scales": units}

    def invalid(self, stored, *, signed=False):
        """The base checks, and units above any an encode writes (``2**50 * FRESH_UNIT``, the saturated
        root's): their roots' squares overflow, and v = inf would turn m, then the weights, into NaN."""
        problem = super().invalid(stored, signed=signed)
        if problem is not None:
            return problem
        bad = int((stored[".scales"] > LARGEST_UNIT).sum())
        if bad:
            return f"{bad} of its {stored['.scales'].numel()} block units are above the largest an encode writes"
        return None

    def __repr__(self):
        return "RootGridCodec(4 bits, unsigned)"


FORMATS = ("root4",)


@functools.cache
def root_grid_codec(name: str, signed: bool, shape: torch.Size) -> RootGridCodec:
    """The shared codec of ``name`` for a nonnegative moment of ``shape``."""
    if signed:
        raise ValueError(f"the state format {name!r} stores nonnegative moments only (a second moment)")
    return RootGridCodec(torch.Size(shape), name)
