"""Bucketed kernel updates: gather parameters' updates and launch them together.

Host time, not GPU time, limits an optimizer step over many parameters (two kernel launches,
~50-100 us on the H200 host, per parameter) and, worse, gradient release, which pays it inside
backward. ``UpdateBuckets`` holds updates that go through a parameter's prepared kernel launch
until ``BUCKET_TENSORS`` parameters of one configuration and group are waiting, then launches
them as one bucket (``kernels/bucket.py``). Whoever queues updates flushes the rest: ``step()``
before it returns; gradient release (``release.py``), which holds up to ``FUSEDOPT_BUCKET_MB``
MiB of gradients and queues their updates in one go, when that budget is reached and at the end
of backward. Every result is bit-identical to per-parameter launches; only the moment at which
an update runs moves. ``FUSEDOPT_BUCKET_MB=0`` turns bucketing (and holding) off.
"""

from __future__ import annotations

import functools
import os

import torch

BUCKET_MB = "FUSEDOPT_BUCKET_MB"
# 128, not 32: in backward a budget of 32 MiB closed a bucket every ~3 parameters of a 1.1B model
# (its MLP gradients are 22 MiB), and the launch pairs cost more than release saved; at 128 the
# peak of that model's step did not move (the peak comes before backward holds anything;
# benchmarks/RESULTS.md, seventh sitting)
DEFAULT_BUCKET_MB = 128
_MAX_BUILT = 1024  # bucket compositions kept (2 KiB of device memory each); more: it changes every step


def bucket_budget() -> int:
    """Gradient bytes per bucket from ``FUSEDOPT_BUCKET_MB`` (0: no bucketing), validated."""
    text = os.environ.get(BUCKET_MB, "").strip()
    try:
        mb = float(text) if text else DEFAULT_BUCKET_MB
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(f"{BUCKET_MB}={text!r} is invalid; expected a number of MiB >= 0 (0 turns bucketing off)")
    return int(mb * 2**20)


@functools.cache
def _kernels():
    """``fusedopt.kernels.bucket``, imported at the first bucketed update (it imports Triton)."""
    from .kernels import bucket

    return bucket


def can_join(prepared) -> bool:
    """Whether a prepared update can join a bucket: its size and tensors' alignment (decided once per
    prepared update; the gradient is checked at each update)."""
    if prepared.bucketable is None:
        prepared.bucketable = _kernels().bucketable(prepared)
    return prepared.bucketable


class _Pending:
    __slots__ = ("members", "grads", "hyper")

    def __init__(self, hyper: dict):
        self.members, self.grads, self.hyper = [], [], hyper


class UpdateBuckets:
    """Pending bucketed updates of one optimizer, and the buckets built so far."""

    def __init__(self):
        self._pending: dict[tuple, _Pending] = {}  # (launch configuration, group index) -> waiting updates
        self._built: dict[tuple, object] = {}  # ids of the members -> PreparedBucket
        self._waiting: set[int] = set()  # ids of the pending members

    def add(self, prepared, grad: torch.Tensor, hyper: dict, group_index: int) -> bool:
        """Queue ``prepared``'s update from ``grad``; False when it cannot join a bucket (the
        caller launches it alone). May launch a full bucket."""
        kernels = _kernels()
        if not (can_join(prepared) and kernels.gradient_bucketable(grad, prepared.head[0].dtype)):
            return False
        key = (prepared.configs[0].key, group_index)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(hyper)
        pending.members.append(prepared)
        self._waiting.add(id(prepared))
        pending.grads.append(grad)
        if len(pending.members) == kernels.BUCKET_TENSORS:
            del self._pending[key]
            self._launch(pending)
        return True

    def has_pending(self) -> bool:
        return bool(self._pending)

    def is_pending(self, prepared) -> bool:
        return id(prepared) in self._waiting

    def flush(self) -> None:
        """Launch every waiting update."""
        while self._pending:
            _, pending = self._pending.popitem()
            self._launch(pending)

    def forget(self) -> None:
        """Drop the built buckets (a member's prepared launch was replaced: they point at its tensors)."""
        self._built.clear()

    def _launch(self, pending: _Pending) -> None:
        members = pending.members
        self._waiting.difference_update(map(id, members))
        if len(members) == 1:
            members[0].launch(pending.grads[0], None, pending.hyper)
            return
        key = tuple(map(id, members))
        bucket = self._built.get(key)
        if bucket is None:
            if len(self._built) >= _MAX_BUILT:
                self._built.clear()
            bucket = self._built[key] = _kernels().PreparedBucket(members)  # holds the members: ids stay theirs
        bucket.launch(pending.grads, pending.hyper)
