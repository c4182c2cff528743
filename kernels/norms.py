"""The global L2 norm of many gradients in one read of each (``max_grad_norm`` with ``fused=False``).

``total_norm`` is ``torch.nn.utils.get_total_norm`` for the 2-norm: each tensor's norm in fp32,
rounded to the tensor's dtype, then the norm of those. Only the order of the fp32 sums differs.
``total_norms`` also gives each tensor's norm: clipping leaves those that are not finite out.
One launch covers up to ``GROUP`` tensors of one dtype: a table of rows (the tensor's address as
an element offset from the first one's, its size, its first program) is copied to the device
without waiting, and each program finds its tensor among the rows, as a bucket of updates does
(``kernels/bucket.py``); a launch per tensor cost more host time than the GPU spent reading. Each
program writes one fp32 partial sum; one deterministic ``sum`` adds them: no atomics, so the same
gradients always give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from fusedopt.kernels.launcher import DirectLauncher, LaunchConfig
from fusedopt.streams import queued_copy

TILE = 2048
TILES = 8
NUM_WARPS = 8
GROUP = 64  # tensors per launch (the table's rows)
ALIGN = 16  # bytes: every tensor's address, and its size in bytes, a multiple of it (vector loads)
_COLS = tl.constexpr(3)  # a row: element offset from the first tensor, size, first program
_UNUSED = tl.constexpr(1 << 62)  # the first program of a row of no tensor: after every program


@triton.jit
def chunk_sum_squares(
    base_ptr, table_ptr, rows, pid, COLS: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
    TILES: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """Program ``pid``'s share of a launch over the tensors of a table (``rows`` used of ``ROWS``,
    ``COLS`` int64 columns each: element offset from ``base_ptr``, size, first program, then the
    caller's): its tensor's index in the table, its program within that tensor, and the fp32 sum of the squares
    of its ``TILE * TILES`` elements. ``ALIGNED``: every tensor's address and size in bytes are
    multiples of 16 (``fits``), so the loads are vectors."""
    slots = tl.arange(0, ROWS)
    starts = tl.load(table_ptr + slots * COLS + 2, mask=slots < rows, other=_UNUSED)
    member = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
    row = table_ptr + member * COLS
    offset = tl.load(row)
    n_elements = tl.load(row + 1)
    if ALIGNED:  # a hint where the value is computed (kernels/update.py _rebase)
        offset = tl.multiple_of(offset, 128 // base_ptr.dtype.element_ty.primitive_bitwidth)  # 16 bytes
        n_elements = tl.multiple_of(n_elements, 128 // base_ptr.dtype.element_ty.primitive_bitwidth)
    x_ptr = base_ptr + offset
    program = pid - tl.load(row + 2)
    start = program.to(tl.int64) * (TILE * TILES)
    acc = tl.zeros([TILE], tl.float32)
    for i in tl.static_range(TILES):  # unrolled: every tile's loads issued before the first is used
        offs = start + i * TILE + tl.arange(0, TILE).to(tl.int64)
        x = tl.load(x_ptr + offs, mask=offs < n_elements, other=0.0).to(tl.float32)
        acc += x * x
    return member, program, tl.sum(acc, axis=0)


@triton.jit
def _sum_squares_kernel(
    base_ptr, table_ptr, partial_ptr, programs_per_row, TILE: tl.constexpr, TILES: tl.constexpr, ROWS: tl.constexpr
):
    member, program, total = chunk_sum_squares(
        base_ptr, table_ptr, ROWS, tl.program_id(0), _COLS, ROWS, TILE, TILES, True
    )
    tl.store(partial_ptr + member.to(tl.int64) * programs_per_row + program, total)


_LAUNCH = DirectLauncher(_sum_squares_kernel, tensors=3, ints=1)
_CONFIG = LaunchConfig(dict(TILE=TILE, TILES=TILES, ROWS=GROUP), dict(num_warps=NUM_WARPS))


def _programs(n: int) -> int:
    return -(-n // (TILE * TILES))


def fits(tensors: list[torch.Tensor]) -> bool:
    """Whether ``total_norm`` takes these: contiguous, on one device, each 16-byte aligned with a size
    of whole 16-byte vectors (every gradient autograd allocates, in practice)."""
    device = tensors[0].device
    return all(
        t.device == device
        and t.is_contiguous()
        and t.data_ptr() % ALIGN == 0
        and (t.numel() * t.element_size()) % ALIGN == 0
        for t in tensors
    )


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of tensors ``fits`` accepts, as ``get_total_norm`` gives it (its dtype: the tensors'
    promoted dtype)."""
    return total_norms(tensors)[0]


def total_norms(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``total_norm``, and each tensor's norm in the order of ``tensors`` (a vector of that dtype), from
    the same launches: clipping leaves the tensors whose norm is not finite out of its norm."""
    device = tensors[0].device
    # torch's own grouping (get_total_norm's), so that the norms are summed in its order
    grouped = _group_tensors_by_device_and_dtype([tensors], with_indices=True)
    parts, order = [], []  # each group's norms as one vector, rounded to its dtype; their tensors
    for _, indices in grouped.values():
        order += indices
        for g in range(0, len(indices), GROUP):
            group = indices[g : g + GROUP]
            base = tensors[group[0]]
            rows, total = [], 0
            for i in group:
                t = tensors[i]
                rows.append([(t.data_ptr() - base.data_ptr()) // t.element_size(), t.numel(), total])
                total += _programs(t.numel())
            width = max(1, max(_programs(tensors[i].numel()) for i in group))
            partials = torch.zeros(len(group), width, dtype=torch.float32, device=device)
            if total:
                rows += [[0, 0, _UNUSED.value]] * (GROUP - len(rows))
                table = queued_copy(torch.tensor(rows, dtype=torch.int64), device)
                _LAUNCH(total, (base, table, partials, width), _CONFIG)
            parts.append(partials.sum(dim=1).sqrt().to(base.dtype))  # as torch._foreach_norm returns them
    # cat promotes mixed dtypes as get_total_norm's stack does
    norms = parts[0] if len(parts) == 1 else torch.cat(parts)
    each = norms
    if order != sorted(order):
        each = torch.empty_like(norms).index_copy_(0, queued_copy(torch.tensor(order), device), norms)
    return torch.linalg.vector_norm(norms), each
