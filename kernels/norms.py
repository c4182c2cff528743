"""The global L2 norm of many gradients in one read of each (``max_grad_norm`` with ``fused=False``).

``total_norm`` is ``torch.nn.utils.get_total_norm`` for the 2-norm: each tensor's norm in fp32,
rounded to the tensor's dtype, then the norm of those. Only the order of the fp32 sums differs.
Each tensor's squares are summed by programs of ``TILE * TILES`` elements into one fp32 partial
per program, and the partials by one deterministic ``sum``: no atomics, so the same gradients
always give the same bits. (``torch._foreach_norm`` read bf16 gradients at under half the copy
bandwidth on the H200; benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048
TILES = 8
NUM_WARPS = 8


@triton.jit
def _sum_squares_kernel(x_ptr, partial_ptr, n_elements, TILE: tl.constexpr, TILES: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (TILE * TILES)
    acc = tl.zeros([TILE], tl.float32)
    for i in tl.static_range(TILES):  # unrolled: every tile's loads issued before the first is used
        offs = start + i * TILE + tl.arange(0, TILE).to(tl.int64)
        x = tl.load(x_ptr + offs, mask=offs < n_elements, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def _programs(n: int) -> int:
    return -(-n // (TILE * TILES))


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of contiguous tensors on one device, as ``get_total_norm`` gives it (its dtype: the
    tensors' promoted dtype)."""
    rows = max(_programs(t.numel()) for t in tensors)
    partials = torch.zeros(len(tensors), max(rows, 1), dtype=torch.float32, device=tensors[0].device)
    for t, row in zip(tensors, partials):
        programs = _programs(t.numel())
        if programs:
            _sum_squares_kernel[(programs,)](t, row, t.numel(), TILE=TILE, TILES=TILES, num_warps=NUM_WARPS)
    norms = partials.sum(dim=1).sqrt()
    return torch.linalg.vector_norm(torch.stack([n.to(t.dtype) for n, t in zip(norms.unbind(), tensors)]))
