"""Log-grid second moments: the codec ``log4`` of nonnegative moments (Adam's ``v``), used by the
state formats ``norm2-log4``, ``norm4-log4`` and ``rot4-log4`` (``codecs/__init__.py``).

Format of one moment tensor of ``n`` elements, taken flattened in row-major order:

* **Blocks** of ``BLOCK`` = 128 elements; the last one is padded with zeros.
* **Codes** (``<slot>.codes``, uint8, shape ``(64 * blocks,)``): a 4-bit index ``c`` per element,
  two per byte, element ``2i`` in the low nibble.
* **Tops** (``<slot>.scales``, fp32, shape ``(blocks,)``): the block's top level ``top``.
* **Steps** (``<slot>.steps``, uint8, shape ``(blocks,)``): the block's level spacing ``s``, in
  32nds of a binade.
* **Value**: ``c = 0`` is exactly 0; ``c`` in 1..15 is ``top * 2**(-(15 - c) * s / 32)``: 15
  levels evenly spaced in ``log2 v`` from ``top`` down 14 steps of ``s / 32`` binades.
  ``2**(-j / 32)`` is a table of 32 fp32 constants and the whole binades a power of two, so
  decode is one rounded multiply (the same on every device). The layout holds any ``s`` up to
  255; the encoder uses at most ``MAX_STEP`` = 18 (levels at most 1.48 times apart, a grid of 7.9
  binades).

Bytes per element: ``1/2 + 5/128`` = 0.539 (4.31 bits). A log grid spends its levels on relative
resolution, which fits a positive moment spanning orders of magnitude within a block; zeros
(elements that never had a gradient) take their own code and do not stretch the grid.

Encode of a block afresh (``encode``, and a block whose values leave its grid): ``top`` is twice
the block's largest value (a binade of headroom, so steady growth rarely re-rounds the block) and
``s`` the smallest spacing whose bottom level reaches the smallest nonzero value, at most
``MAX_STEP``. Each nonzero value is rounded stochastically to one of the two levels around it, up
with probability equal to the fraction of the way between them in value (so the rounded ``v`` is
unbiased, and its EMA too); a value below the bottom level takes level 1: a nonzero ``v`` never
becomes 0 (Adam would step by ``m / eps``), and errs towards a smaller step. The cap trades the
elements far below their block's largest (their steps shrink, as in the block formats) for
resolution everywhere else: rounding noise enters the EMA in proportion to the gap between levels,
and a grid stretched over a block's full range (often tens of binades early in training) made the
whole of ``v`` noisy (benchmarks/RESULTS.md).

Encode in an update (``encode_decayed``, ``x = d * x_old + increment``): the decay goes exactly
into the top (``top * d``; every level scales with it, the codes stay), and only elements with a
nonzero increment are rounded on that decayed grid, from their new value. An element without
gradient keeps its code and decays exactly; rounding noise enters in proportion to the increments,
not as a re-rounding of every element each step (which, with stochastic rounding, an EMA of memory
``1 / (1 - d)`` would accumulate). A block where a new value leaves the grid (above the top, or
nonzero below the bottom level of a grid not yet at ``MAX_STEP``) is encoded afresh. Without a
decay (checkpoint conversion, other algorithms) ``encode`` encodes every block afresh.

Draws: the moment's 12-bit field of the update's shared hash word for element ``i`` (its global
index, through the optimizer's ``first``), mixed with ``i`` into 24 bits (``rng.spread_uniform``):
an increment of ``v`` is often a thousandth of the gap between levels.

The fused update kernel (``fusedopt/kernels/loggrid.py``) repeats these operations in the same
order (the level below a value by the same binary search over the level values) for algorithms
that declare the moment's EMA decay (AdamW); ``tests/test_lowbit_kernel.py`` holds it to this
reference bit for bit in Triton's interpreter, ``tests/gpu/test_state_formats_on_cuda.py`` on the GPU.
"""

from __future__ import annotations

import functools

import torch

from .base import LOG_GRID, KernelFormat
from .nibbles import BLOCK, NibbleBlockCodec

LEVELS = 15  # nonzero levels of a 4-bit index; 0 is zero
STEP_UNITS = 32  # the spacing is s / 32 binades
MAX_STEP = 18  # the encoder's widest spacing (the format allows 255)
HEADROOM = 2.0  # a fresh block's top over its largest value (exact in fp32)
_SLACK = 2.0**-20  # a value within fp32 rounding of the top or the bottom level is on the grid
# 2**(-j / 32), j = 0..31, rounded once to fp32
FRACTIONS = torch.tensor([2.0 ** (-j / STEP_UNITS) for j in range(STEP_UNITS)], dtype=torch.float32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent for int32 exponents in [-126, 127], exact, from the fp32 bit pattern."""
    return ((exponent + 127) << 23).view(torch.float32)


class LogGridCodec(NibbleBlockCodec):
    """A log-grid nonnegative moment (see the module docstring); one per shape."""

    suffixes = (".codes", ".scales", ".steps")
    block_tensors = {".scales": torch.float32, ".steps": torch.uint8}
    kernel_format = KernelFormat(LOG_GRID + 4, signed=False, block=BLOCK)

    # --- levels ------------------------------------------------------------------------------

    @staticmethod
    def levels(codes: torch.Tensor, tops: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Value of int32 ``codes`` (``(blocks, k)``; 0 and 16 are allowed: 0 -> 0, 16 -> above the
        top) under each block's ``tops`` and ``steps``: ``top * 2**(-(15 - c) * s / 32)``."""
        j = (LEVELS - codes).clamp_min(-1) * steps.to(torch.int32).unsqueeze(1)  # 32nds of a binade below top
        whole, frac = j >> 5, j & (STEP_UNITS - 1)  # floor division: j = -s (c = 16) gives a level above top
        value = tops.unsqueeze(1) * FRACTIONS.to(tops.device)[frac]
        return torch.where(codes > 0, value * _pow2(-whole), 0.0)  # -8 <= whole <= 15 * 255 / 32: no clamp needed

    # --- decode ------------------------------------------------------------------------------

    def decode_blocks(self, stored) -> tuple[torch.Tensor, torch.Tensor]:
        codes = self.unpack(stored[".codes"])
        return codes, self.levels(codes, stored[".scales"], stored[".steps"])

    # --- encode ------------------------------------------------------------------------------

    @staticmethod
    def fresh_grid(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tops, steps) of blocks ``y`` encoded afresh: top = 2 * max, the smallest spacing whose
        bottom level reaches the smallest nonzero value (all-zero blocks: 0, 0)."""
        largest = y.amax(dim=1)
        smallest = torch.where(y > 0, y, float("inf")).amin(dim=1)
        tops = largest * HEADROOM
        binades = torch.log2(tops.double() / smallest.double())  # >= 1 (the headroom); inf for a zero block
        steps = torch.ceil(binades * STEP_UNITS / (LEVELS - 1)).clamp(0, MAX_STEP)
        steps = torch.where(largest > 0, steps, 0.0).to(torch.uint8)
        return tops, steps

    def on_grid(self, y: torch.Tensor, tops: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Whether each value of ``y`` (``(blocks, 128)``, >= 0) is on the grid of (tops, steps): 0, or
        between the bottom level and the top, give or take fp32 rounding (at the widest spacing, where a
        refit would not reach lower, any value up to the top: it takes level 1)."""
        bottom = self.levels(torch.ones_like(y[:, :1], dtype=torch.int32), tops, steps)
        widest = (steps >= MAX_STEP).unsqueeze(1)
        return (y == 0) | ((y <= tops.unsqueeze(1) * (1 + _SLACK)) & ((y >= bottom * (1 - _SLACK)) | widest))

    def round_to_grid(self, y: torch.Tensor, tops: torch.Tensor, steps: torch.Tensor, u: torch.Tensor):
        """The codes of ``y`` (``(blocks, 128)``, >= 0) rounded stochastically to the levels of (tops,
        steps), unbiased in value; 0 stays 0, a nonzero value below the bottom level takes it."""
        # the highest level at or below y (level 1 if none): a binary search over the level values,
        # which rise with the code, so the answer is exact (no log2 to round) and cheap in the kernel
        lo = torch.ones_like(y, dtype=torch.int32)
        for half in (8, 4, 2, 1):
            candidate = lo + half
            lo = torch.where((candidate <= LEVELS) & (self.levels(candidate, tops, steps) <= y), candidate, lo)
        low, high = self.levels(lo, tops, steps), self.levels(lo + 1, tops, steps)
        gap = high - low
        # u * gap < y - low, decided in fp64 (exact for these fp32 products)
        up = (lo < LEVELS) & (gap > 0) & (u.double() * gap.double() < (y - low).double())
        return torch.where(y > 0, lo + up.to(torch.int32), 0)

    def _store(self, codes, tops, steps):
        return {".codes": self.pack(codes), ".scales": tops, ".steps": steps}

    def encode(self, x, bits):
        y = self.values(x)
        tops, steps = self.fresh_grid(y)
        return self._store(self.round_to_grid(y, tops, steps, self.uniforms(bits)), tops, steps)

    def encode_decayed(self, x, bits, previous, decay):
        old_codes, old_values = self.decode_blocks(previous)
        y = self.values(x)
        tops, steps = previous[".scales"] * decay, previous[".steps"]
        same = y == old_values * decay  # no increment: the code stays (the value decays with the top, exactly)
        fits = (same | self.on_grid(y, tops, steps)).all(dim=1)
        # each block is rounded once: on its decayed grid where it fits, else on a fresh one
        fresh_tops, fresh_steps = self.fresh_grid(y)
        tops, steps = torch.where(fits, tops, fresh_tops), torch.where(fits, steps, fresh_steps)
        codes = self.round_to_grid(y, tops, steps, self.uniforms(bits))
        return self._store(torch.where(fits.unsqueeze(1) & same, old_codes, codes), tops, steps)

    def __repr__(self):
        return "LogGridCodec(4 bits, unsigned)"


FORMATS = ("log4",)


@functools.cache
def log_grid_codec(name: str, signed: bool, shape: torch.Size) -> LogGridCodec:
    """The shared codec of ``name`` for a nonnegative moment of ``shape``."""
    if signed:
        raise ValueError(f"the state format {name!r} stores nonnegative moments only (a second moment)")
    return LogGridCodec(torch.Size(shape), name)
