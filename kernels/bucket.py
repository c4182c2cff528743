"""One launch pair (finite check, update) for several parameters of one configuration.

A parameter's update costs two kernel launches of host time, which gradient release pays
inside backward. A bucket launches both kernels once for up to
``BUCKET_TENSORS`` parameters from a table of one row per member (``update.py``'s ``BUCKET``
branch): every program finds its member from the rows' first-program columns, and the member's
pointers as the first member's plus the deltas of its row. The table (about 2 KiB) depends only on
the members, so it is built once and reused while the members' prepared launches are; only the
gradients are new each step, and their deltas travel as launch arguments (no host-to-device
copy, no sync).

Each member gets exactly the single-parameter launch's programs, element offsets, hash keys and
scratch words, so its result is bit-identical to its own launch (tests/test_buckets.py).
"""

from __future__ import annotations

import torch

from fusedopt.kernels import update  # its launchers by attribute: benchmarks swap them
from fusedopt.kernels.launcher import launch_remembered
from fusedopt.kernels.update import (
    _GRAD_DELTA_BIAS,
    BUCKET_TENSORS,
    COL_CHECK_START,
    COL_UPDATE_START,
    GRAD_DELTA_BIAS,
    INDEX_BIAS,
    NO_GRAD_DELTAS,
    NO_START,
    TABLE_COLS,
    PreparedUpdate,
    _check_config,
    bucket_config,
    scaled_config,
)
from fusedopt.streams import on_default_stream, queued_copy

ALIGN = 16  # bytes: the alignment the kernel's vector accesses assume for every member tensor
# A bucketed update is slower per element than one launched alone (benchmarks/step_speed.py --kernels;
# the cause is not pinned down, benchmarks/RESULTS.md). A bucket saves host time, a launch pair
# per member, which only pays while the member's own GPU time is shorter: from 2**24 elements a
# parameter launches alone.
MAX_MEMBER_NUMEL = 1 << 24

assert int(_GRAD_DELTA_BIAS) == GRAD_DELTA_BIAS


def _pointer_tensors(u: PreparedUpdate) -> tuple:
    """A member's tensors in table column order: param, correction, m, m scales, v, v scales, step, scratch."""
    return (*u.head, *u.state_tensors)


def bucketable(u: PreparedUpdate) -> bool:
    """Whether a prepared update can join a bucket: a size the kernel's 16-element vector hint
    covers, below MAX_MEMBER_NUMEL, and 16-byte aligned tensors (the gradient is checked per step)."""
    if u.n == 0 or u.n % 16 or u.n >= MAX_MEMBER_NUMEL or u.configs[0].constexprs["INDEX_64"]:
        return False
    return all(t.data_ptr() % ALIGN == 0 for t in _pointer_tensors(u))


def gradient_bucketable(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    return grad.dtype == dtype and grad.is_contiguous() and grad.data_ptr() % ALIGN == 0


class PreparedBucket:
    """The launch arguments of one bucket of prepared updates (same configuration, same group)."""

    def __init__(self, members: list[PreparedUpdate]):
        if not 1 <= len(members) <= BUCKET_TENSORS:
            raise ValueError(f"a bucket holds 1 to {BUCKET_TENSORS} parameters, got {len(members)}")
        first = members[0]
        if any(u.algo != first.algo or u.configs[0].key != first.configs[0].key for u in members):
            raise ValueError("a bucket's members must share the algorithm and the launch configuration")
        if not all(bucketable(u) for u in members):
            raise ValueError("a bucket member is empty, too large, of a size not a multiple of 16, or misaligned")
        self.members = members  # kept: the table points into their tensors
        self.algo = first.algo
        base = _pointer_tensors(first)
        update_starts, self.programs = _starts([u.programs for u in members])
        check_starts, self.check_programs = _starts([u.check_programs for u in members])
        rows = []
        for u, update_start, check_start in zip(members, update_starts, check_starts):
            deltas = []
            for t, b in zip(_pointer_tensors(u), base, strict=True):
                offset = t.data_ptr() - b.data_ptr()
                if offset % b.element_size():
                    raise ValueError("bucket members' tensors of one role must share a dtype")
                deltas.append(offset // b.element_size())
            row = deltas + [u.n, (u.n + 1) // 2, *u.keys, u.check_programs, update_start, check_start]
            row.append(u.first + INDEX_BIAS)
            rows.append(row + [0] * (TABLE_COLS - len(row)))  # in the order of update.py's COL_* columns
        unused = [0] * TABLE_COLS  # rows of no member: their first programs are after every program
        unused[COL_UPDATE_START.value] = unused[COL_CHECK_START.value] = NO_START
        rows += [unused] * (BUCKET_TENSORS - len(members))
        with on_default_stream(first.head[0]):  # launches on any stream can then wait for the copy
            self.table = queued_copy(torch.tensor(rows, dtype=torch.int64), first.head[0].device)
        self.head, self.state_tensors = first.head, first.state_tensors
        self.step, self.scratch, self.skipped = first.step, first.scratch, first.skipped
        self.ints = first.ints  # the first member's sizes and keys (unused: the table has them)
        config = bucket_config(first.configs[False])
        self.update_configs = {False: config, True: scaled_config(config)}
        self.check_configs = {s: _check_config(False, first.bias_corrections, True, s) for s in (False, True)}
        self.launches: dict = {}  # resolved direct launches (launch_remembered)

    def launch(
        self,
        grads: list[torch.Tensor],
        scalars: tuple[tuple, tuple],
        grad_scales: list[torch.Tensor] | None = None,
    ) -> None:
        """Update every member from its gradient (``grads[i]`` for member i; same dtype, contiguous,
        16-byte aligned: ``gradient_bucketable``), multiplied by its coefficient ``grad_scales[i]``
        (fp32 0-d tensors on the members' device; NaN skips the member, as ``PreparedUpdate.launch``)
        if given."""
        if len(grads) != len(self.members) or (grad_scales is not None and len(grad_scales) != len(grads)):
            raise ValueError(f"a bucket of {len(self.members)} parameters got {len(grads)} gradients")
        args, check_args = scalars
        deltas = _deltas(grads)
        # nothing in the launch keys varies (the gradients' dtype and alignment are the members'):
        # one resolved direct launch each
        scaled = grad_scales is not None
        if scaled:  # the check reads each member's coefficient, not its gradient: a program each
            check = (grads[0], grads[0], self.scratch, self.step, self.skipped, self.table, grad_scales[0], 0)
            check_args = (*check, *_deltas(grad_scales), *check_args)
            check_programs = len(self.members)
        else:
            check = (grads[0], grads[0], self.scratch, self.step, self.skipped, self.table, self.head[0], 0)
            check_args = (*check, *deltas, *check_args)
            check_programs = self.check_programs
        launch_remembered(
            update._launch_check,
            self.launches,
            ("check", scaled),
            check_programs,
            check_args,
            self.check_configs[scaled],
        )
        runtime_args = (
            *self.head, grads[0], self.head[0], *self.state_tensors, self.table, *self.ints, *deltas, *args
        )  # fmt: skip
        update_launcher = update._launch_update
        launch_remembered(
            update_launcher, self.launches, ("update", scaled), self.programs, runtime_args, self.update_configs[scaled]
        )


def _deltas(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's address as an element offset from the first one's (+ GRAD_DELTA_BIAS), padded
    to BUCKET_TENSORS: the kernels' per-member arguments."""
    deltas = list(NO_GRAD_DELTAS)
    address, size = tensors[0].data_ptr(), tensors[0].element_size()
    for i, t in enumerate(tensors):
        deltas[i] = (t.data_ptr() - address) // size + GRAD_DELTA_BIAS
    return deltas


def _starts(programs: list[int]) -> tuple[list[int], int]:
    """Each member's first program in a launch of members of ``programs`` programs each, and the total."""
    starts, total = [], 0
    for count in programs:
        starts.append(total)
        total += count
    return starts, total
