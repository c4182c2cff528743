"""One launch for the bookkeeping of clipping under gradient release (``fusedopt/clipping.py``).

A batch of released gradients brings its squared norms; ``ReleaseClipping`` folds them into the
window's sums, estimates the global norm, and derives the batch's coefficient. As torch ops that
was about forty small kernels per batch, each costing more host time than GPU time, inside
backward. Here it is one program over the batch (at most a few hundred parameters), reading and
writing the history the class keeps in device buffers: ``stats`` (float64 scalars, the slots of
``fusedopt.clipping.SLOT``), ``last`` (each parameter's squared norm at its previous update;
negative: none), ``average`` and ``updates`` (``adagc``: each parameter's average clipped norm and
its count). The arithmetic is ``ReleaseClipping._reference``'s, in float64, its constants read
from ``stats`` (a Python float in a Triton kernel is fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedopt.clipping import SLOT
from fusedopt.kernels.launcher import DirectLauncher, LaunchConfig

KNOWN, WINDOW_KNOWN, SEEN, SEEN_WITH_HISTORY, SEEN_LAST, TOTAL, LAST_TOTAL = (
    tl.constexpr(SLOT[name])
    for name in ("known", "window_known", "seen", "seen_with_history", "seen_last", "total", "last_total")
)
MAX_NORM, EPS, ADAGC_RATIO, ADAGC_DECAY, ADAGC_KEEP = (
    tl.constexpr(SLOT[name]) for name in ("max_norm", "eps", "adagc_ratio", "adagc_decay", "adagc_keep")
)


@triton.jit
def _release_clip_kernel(
    x_ptr,  # the batch's norms (SQUARE) or squared norms
    index_ptr,  # int64: each one's parameter index
    stats_ptr,
    last_ptr,
    average_ptr,
    updates_ptr,  # int32
    coef_ptr,  # fp32 out: one coefficient (PER_PARAM=False) or one per parameter
    n,
    first,  # 1: the first batch of a window
    ADAGC_WARMUP: tl.constexpr,
    SQUARE: tl.constexpr,
    ADAGC: tl.constexpr,
    SKIP_NONFINITE: tl.constexpr,  # a non-finite squared norm: that parameter's coefficient is NaN
    PER_PARAM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SQUARE:
        x = x * x  # in the norms' dtype (fp32), as torch's square() before double()
    sq = x.to(tl.float64)
    finite = tl.abs(sq) < float("inf")  # false for NaN too
    sq_finite = tl.where(finite & mask, sq, 0.0)
    index = tl.load(index_ptr + offs, mask=mask, other=0)
    # the first batch of a window starts its sums (a select, not a branch: one straight program)
    opening = first != 0
    known = tl.load(stats_ptr + KNOWN)
    window_known = tl.where(opening, known, tl.load(stats_ptr + WINDOW_KNOWN))
    seen = tl.where(opening, 0.0, tl.load(stats_ptr + SEEN))
    seen_with_history = tl.where(opening, 0.0, tl.load(stats_ptr + SEEN_WITH_HISTORY))
    seen_last = tl.where(opening, 0.0, tl.load(stats_ptr + SEEN_LAST))
    total = tl.load(stats_ptr + TOTAL)
    tl.store(stats_ptr + LAST_TOTAL, tl.where(opening, total, tl.load(stats_ptr + LAST_TOTAL)))
    tl.store(stats_ptr + WINDOW_KNOWN, window_known)
    total = tl.where(opening, 0.0, total)
    last = tl.load(last_ptr + index, mask=mask, other=-1.0)
    has = last >= 0.0
    last = tl.where(has, last, 0.0)
    new_last = tl.where(has, tl.where(finite, sq, last), sq_finite)
    seen += tl.sum(sq_finite, axis=0)
    total += tl.sum(tl.where(mask, sq, 0.0), axis=0)  # non-finite ones too: grad_norm
    seen_with_history += tl.sum(tl.where(has, sq_finite, 0.0), axis=0)
    seen_last += tl.sum(last, axis=0)
    known += tl.sum(tl.where(mask, new_last - last, 0.0), axis=0)
    unseen = tl.maximum(window_known - seen_last, 0.0)
    growth = tl.where(seen_last > 0.0, seen_with_history / tl.where(seen_last > 0.0, seen_last, 1.0), 1.0)
    estimate = seen + unseen * growth
    eps = tl.load(stats_ptr + EPS)
    coefficient = tl.minimum(tl.load(stats_ptr + MAX_NORM) / (tl.sqrt(estimate) + eps), 1.0)
    coefficients = tl.zeros([BLOCK], tl.float64) + coefficient
    if ADAGC:
        norm = tl.sqrt(sq_finite)
        updates = tl.load(updates_ptr + index, mask=mask, other=0)
        averaged = updates > 0
        average = tl.where(averaged, tl.load(average_ptr + index, mask=mask, other=0.0), 0.0)
        own = tl.minimum(tl.load(stats_ptr + ADAGC_RATIO) * average / (norm + eps), 1.0)
        coefficients = tl.where(updates >= ADAGC_WARMUP, tl.minimum(coefficients, own), coefficients)
        clipped = norm * coefficients
        decayed = tl.load(stats_ptr + ADAGC_DECAY) * average + tl.load(stats_ptr + ADAGC_KEEP) * clipped
        average = tl.where(averaged, tl.where(finite, decayed, average), clipped)
        tl.store(average_ptr + index, average, mask=mask)
        tl.store(updates_ptr + index, updates + 1, mask=mask)
    out = coefficients.to(tl.float32)
    if SKIP_NONFINITE:
        out = tl.where(finite, out, float("nan"))
    if PER_PARAM:
        tl.store(coef_ptr + offs, out, mask=mask)
    else:
        tl.store(coef_ptr + offs, out, mask=offs == 0)
    tl.store(last_ptr + index, new_last, mask=mask)
    tl.store(stats_ptr + KNOWN, known)
    tl.store(stats_ptr + SEEN, seen)
    tl.store(stats_ptr + SEEN_WITH_HISTORY, seen_with_history)
    tl.store(stats_ptr + SEEN_LAST, seen_last)
    tl.store(stats_ptr + TOTAL, total)


_LAUNCH = DirectLauncher(_release_clip_kernel, tensors=7, ints=2)
_CONFIGS: dict = {}


def release_clip(
    x: torch.Tensor,
    index: torch.Tensor,
    stats: torch.Tensor,
    last: torch.Tensor,
    average: torch.Tensor,
    updates: torch.Tensor,
    coefficients: torch.Tensor,
    *,
    first: bool,
    square: bool,
    adagc: bool,
    skip_nonfinite: bool,
    warmup: int,
) -> None:
    """Fold a batch into the history and write its coefficient(s) into ``coefficients`` (fp32: one
    element, or one per parameter where ``adagc`` or ``skip_nonfinite``)."""
    n = x.numel()
    block = max(16, triton.next_power_of_2(n))
    per_param = adagc or skip_nonfinite
    key = (warmup, square, adagc, skip_nonfinite, per_param, block)
    config = _CONFIGS.get(key)
    if config is None:
        constexprs = dict(
            ADAGC_WARMUP=warmup, SQUARE=square, ADAGC=adagc, SKIP_NONFINITE=skip_nonfinite, PER_PARAM=per_param,
            BLOCK=block,
        )  # fmt: skip
        config = _CONFIGS[key] = LaunchConfig(constexprs, dict(num_warps=4 if block >= 512 else 1))
    _LAUNCH(1, (x, index, stats, last, average, updates, coefficients, n, int(first)), config)
