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

``ReleaseClipKernel.from_gradients`` also computes the squared norms, in the same launch: a
batch of single gradients of one dtype, on the buffers' device, needs no norm kernels (their host
time was most of what clipping still added to a step). Each program sums the squares of one chunk
of one gradient (``norms.chunk_sum_squares``, as the ``fused=False`` norm kernel does); the last
program to finish (a ticket) adds every gradient's chunk sums in a fixed order, so the result does
not depend on which program ran when, and then does the bookkeeping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedopt.clipping import SLOT
from fusedopt.kernels.launcher import DirectLauncher, LaunchConfig
from fusedopt.kernels.norms import TILE, TILES, chunk_sum_squares, fits
from fusedopt.streams import queued_copy

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
    coef_ptr,  # fp32 out: one coefficient per parameter (NaN where its squared norm is not finite)
    n,
    first,  # 1: the first batch of a window
    ADAGC_WARMUP: tl.constexpr,
    SQUARE: tl.constexpr,
    ADAGC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SQUARE:
        x = x * x  # in the norms' dtype (fp32), as torch's square() before double()
    index = tl.load(index_ptr + offs, mask=mask, other=0)
    _fold(
        x.to(tl.float64), index, offs, mask, stats_ptr, last_ptr, average_ptr, updates_ptr, coef_ptr, first,
        ADAGC_WARMUP, ADAGC, BLOCK,
    )  # fmt: skip


# columns of from_gradients' table, one row per gradient (int64): those ``norms.chunk_sum_squares``
# reads (element offset from the first gradient, size, first program), then the parameter index
COL_FIRST_PROGRAM, COL_INDEX = tl.constexpr(2), tl.constexpr(3)
TABLE_COLS = tl.constexpr(4)
PARTIALS_BLOCK = tl.constexpr(1024)  # chunk sums the last program adds per iteration
_TILE, _TILES = tl.constexpr(TILE), tl.constexpr(TILES)  # the norm kernel's chunk: TILES tiles of TILE


@triton.jit
def _release_clip_gradients_kernel(
    grad_ptr,  # the batch's first gradient; the others at its address plus their row's offset
    table_ptr,  # int64 [members, TABLE_COLS], then the ticket word
    partial_ptr,  # int32 [programs]: each program's sum of squares (fp32 bits: written atomically)
    stats_ptr,
    last_ptr,
    average_ptr,
    updates_ptr,
    coef_ptr,
    members,
    programs,
    first,
    ADAGC_WARMUP: tl.constexpr,
    ADAGC: tl.constexpr,
    BLOCK: tl.constexpr,  # >= members
    ALIGNED: tl.constexpr,  # every gradient's address and size in bytes multiples of 16: vector loads
):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < members
    _, _, chunk = chunk_sum_squares(grad_ptr, table_ptr, members, pid, TABLE_COLS, BLOCK, _TILE, _TILES, ALIGNED)
    tl.atomic_xchg(partial_ptr + pid, chunk.to(tl.int32, bitcast=True))
    ticket_ptr = table_ptr + members * TABLE_COLS
    ticket = tl.atomic_add(ticket_ptr, 1)  # acq_rel: every chunk sum written before it is visible after it
    if ticket == programs - 1:  # the last program: every chunk sum is in
        sq = tl.zeros([BLOCK], tl.float64)
        for m in range(members):
            begin = tl.load(table_ptr + m * TABLE_COLS + COL_FIRST_PROGRAM)
            end = tl.load(table_ptr + (m + 1) * TABLE_COLS + COL_FIRST_PROGRAM, mask=m + 1 < members, other=programs)
            total = tl.zeros([], tl.float64)
            for j in range(begin, end, PARTIALS_BLOCK):
                k = j + tl.arange(0, PARTIALS_BLOCK)
                partial = tl.load(partial_ptr + k, mask=k < end, other=0, volatile=True).to(tl.float32, bitcast=True)
                total += tl.sum(partial.to(tl.float64), axis=0)
            sq = tl.where(offs == m, total, sq)
        index = tl.load(table_ptr + offs * TABLE_COLS + COL_INDEX, mask=mask, other=0)
        _fold(
            sq, index, offs, mask, stats_ptr, last_ptr, average_ptr, updates_ptr, coef_ptr, first, ADAGC_WARMUP,
            ADAGC, BLOCK,
        )  # fmt: skip
        tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def _fold(
    sq, index, offs, mask, stats_ptr, last_ptr, average_ptr, updates_ptr, coef_ptr, first,
    ADAGC_WARMUP: tl.constexpr, ADAGC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Fold the batch's squared norms ``sq`` (float64) into the history; write each parameter's
    coefficient, NaN where its squared norm is not finite (its update then skips without reading
    its gradient again: ``GradientPipeline``)."""
    finite = tl.abs(sq) < float("inf")  # false for NaN too
    sq_finite = tl.where(finite & mask, sq, 0.0)
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
    out = tl.where(finite, coefficients.to(tl.float32), float("nan"))
    tl.store(coef_ptr + offs, out, mask=mask)
    tl.store(last_ptr + index, new_last, mask=mask)
    tl.store(stats_ptr + KNOWN, known)
    tl.store(stats_ptr + SEEN, seen)
    tl.store(stats_ptr + SEEN_WITH_HISTORY, seen_with_history)
    tl.store(stats_ptr + SEEN_LAST, seen_last)
    tl.store(stats_ptr + TOTAL, total)


_LAUNCH = DirectLauncher(_release_clip_kernel, tensors=7, ints=2)
_LAUNCH_GRADIENTS = DirectLauncher(_release_clip_gradients_kernel, tensors=8, ints=3)
_CONFIGS: dict = {}
_TABLE_CACHE = 64  # batches whose gradient tables stay on the device
CHUNK = TILE * TILES  # elements per program
GRADIENT_WARPS = 4  # the gradients' read: one warp a program read a large gradient slower (release_clip_read.py)


def _config(key: tuple, num_warps: int | None = None, **constexprs) -> LaunchConfig:
    """``num_warps``: by default 1 (a batch's bookkeeping), 4 from 512 members; the gradients' read takes 4."""
    config = _CONFIGS.get(key)
    if config is None:
        warps = num_warps or (4 if constexprs["BLOCK"] >= 512 else 1)
        config = _CONFIGS[key] = LaunchConfig(constexprs, dict(num_warps=warps))
    return config


class ReleaseClipKernel:
    """The bookkeeping launches of one ``ReleaseClipping``: ``__call__`` from the batch's norms,
    ``from_gradients`` from the gradients themselves (keeping each batch's table of gradient
    offsets, sizes and parameter indices on the device while the gradients stay where they are)."""

    def __init__(self):
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, int, bool]] = {}

    def __call__(
        self,
        x: torch.Tensor,
        index: torch.Tensor,
        history: tuple[torch.Tensor, ...],
        coefficients: torch.Tensor,
        *,
        first: bool,
        square: bool,
        adagc: bool,
        warmup: int,
    ) -> None:
        """Fold a batch (its norms ``x``, or squared norms, and parameter indices ``index``) into the
        ``history`` (``stats``, ``last``, ``average``, ``updates``) and write each parameter's
        coefficient into ``coefficients`` (fp32, one per parameter; NaN: not finite)."""
        n = x.numel()
        block = max(16, triton.next_power_of_2(n))
        config = _config(
            ("norms", warmup, square, adagc, block), ADAGC_WARMUP=warmup, SQUARE=square, ADAGC=adagc, BLOCK=block
        )
        _LAUNCH(1, (x, index, *history, coefficients, n, int(first)), config)

    @staticmethod
    def takes_gradients(grads: list[torch.Tensor], device: torch.device) -> bool:
        """Whether ``from_gradients`` can read these: one dtype, contiguous, on ``device``."""
        dtype = grads[0].dtype
        return all(g.dtype == dtype and g.device == device and g.is_contiguous() for g in grads)

    def from_gradients(
        self,
        grads: list[torch.Tensor],
        indices: list[int],
        history: tuple[torch.Tensor, ...],
        coefficients: torch.Tensor,
        *,
        first: bool,
        adagc: bool,
        warmup: int,
    ) -> None:
        """``__call__`` with the squared norms of ``grads`` (``takes_gradients``), summed in the same launch."""
        table, partials, programs, aligned = self._table(grads, indices)
        members = len(grads)
        block = max(16, triton.next_power_of_2(members))
        config = _config(
            ("gradients", warmup, adagc, block, aligned), GRADIENT_WARPS, ADAGC_WARMUP=warmup, ADAGC=adagc,
            BLOCK=block, ALIGNED=aligned,
        )  # fmt: skip
        args = (grads[0], table, partials, *history, coefficients, members, programs, int(first))
        _LAUNCH_GRADIENTS(programs, args, config)

    def _table(self, grads: list[torch.Tensor], indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
        """The batch's table (with its zeroed ticket word), chunk-sum buffer, program count and
        whether the gradients allow vector loads (``norms.fits``)."""
        key = (grads[0].dtype, tuple(indices), tuple(g.data_ptr() for g in grads), tuple(g.numel() for g in grads))
        cached = self._tables.get(key)
        if cached is not None:
            return cached
        if len(self._tables) >= _TABLE_CACHE:
            self._tables.clear()
        base, size = grads[0].data_ptr(), grads[0].element_size()
        rows, programs = [], 0
        for g, index in zip(grads, indices):
            rows += [(g.data_ptr() - base) // size, g.numel(), programs, index]
            programs += max(1, -(-g.numel() // CHUNK))
        device = grads[0].device
        table = queued_copy(torch.tensor(rows + [0], dtype=torch.int64), device)
        partials = torch.empty(programs, dtype=torch.int32, device=device)
        cached = self._tables[key] = (table, partials, programs, fits(grads))
        return cached
