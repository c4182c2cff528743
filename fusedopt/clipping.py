"""Gradient clipping by the global L2 norm (``max_grad_norm``).

With ``fused=False`` the optimizer clips in ``step()`` exactly as ``torch.nn.utils.clip_grad_norm_``
(coefficient ``min(1, max_norm / (norm + 1e-6))``). With ``fused=True`` each parameter is updated
inside backward, before the gradients of the parameters still to come exist, so the global norm is
not known yet: ``ReleaseClipping`` clips each gradient in one pass with an estimate of it, and keeps
the exact norm of everything it saw for ``opt.grad_norm``. Every number is a device tensor: no
host synchronisation.

The estimate (``method``), at the moment parameter ``i`` is released, from the squared norms
``s_j`` of the gradients already seen in this backward (``seen``) and each parameter's squared
norm at its previous update ``l_j``:

* ``"scaled"`` (the default): the last global norm, scaled by how much the gradients seen so far
  grew against their own previous norms: ``sum_seen s + sum_unseen l * (sum_seen s / sum_seen l)``.
  A spike that scales every gradient (a bad batch, a loss spike) is recognised in full at the first
  parameter; in a steady state it equals the exact norm up to the noise of the seen part.
* ``"previous"``: the seen gradients plus the unseen ones at their previous norms:
  ``sum_seen s + sum_unseen l``.
* ``"prefix"``: the seen gradients only (never more than the exact norm: it clips less).
* ``"adagc"``: ``"scaled"``, and besides each gradient at most ``1.05`` times an exponential average
  (0.98) of its own clipped norms (per-tensor adaptive clipping), once that average has 10 updates.

The first backward has no history: every method clips it with the seen part (``"prefix"``).
"""

from __future__ import annotations

import torch

CLIP_METHODS = ("scaled", "previous", "prefix", "adagc")
DEFAULT_CLIP_METHOD = "scaled"
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s

ADAGC_RATIO = 1.05  # a tensor's gradient norm may exceed its own average by this factor
ADAGC_DECAY = 0.98
ADAGC_WARMUP = 10  # updates before a tensor's own average is trusted


def check_clip_method(method) -> None:
    if method not in CLIP_METHODS:
        raise ValueError(f"Invalid release_clipping: {method!r} (expected one of {', '.join(CLIP_METHODS)})")


def clip_exactly_(tensors: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on gradient tensors (not parameters): scale them in place by
    ``min(1, max_norm / (norm + 1e-6))`` and return their total norm."""
    norm = torch.nn.utils.get_total_norm(tensors)
    coefficient = (max_norm / (norm + EPS)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coefficient.to(device))
    return norm


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of the sum of ``grads`` (a gradient and its accumulated buffer), fp32."""
    total = grads[0] if len(grads) == 1 else grads[0].float() + grads[1].float()
    return torch.linalg.vector_norm(total, dtype=torch.float32).square()


class ReleaseClipping:
    """One-pass clipping of released gradients for one optimizer (see the module docstring)."""

    def __init__(self, max_norm: float, method: str):
        check_clip_method(method)
        self.max_norm = max_norm
        self.method = method
        self._last: dict[int, torch.Tensor] = {}  # param index -> squared norm at its previous update
        self._average: dict[int, tuple[torch.Tensor, int]] = {}  # adagc: index -> (average norm, updates)
        self._known = None  # sum of self._last over every parameter (device scalar)
        self._window_known = None  # self._known when this backward started
        self._seen = None  # sum of this backward's finite squared norms
        self._seen_with_history = None  # the same over parameters that have a previous norm
        self._seen_last = None  # their previous squared norms, summed
        self._seen_total = None  # sum of every squared norm seen (non-finite ones too): grad_norm
        self._last_total = None  # the previous window's _seen_total

    def new_window(self) -> None:
        """``step()`` ended an update window."""
        if self._seen_total is not None:
            self._last_total = self._seen_total
        self._seen = self._seen_total = None

    def norm(self) -> torch.Tensor | None:
        """The global norm of the gradients this window has clipped so far (the last window's
        when none yet); exact once every gradient was seen."""
        total = self._seen_total if self._seen_total is not None else self._last_total
        return None if total is None else total.sqrt().float()

    def clip(self, index: int, grads: list[torch.Tensor], sq: torch.Tensor | None = None) -> None:
        """Scale ``grads`` (parameter ``index``'s gradient and its accumulated buffer) in place by
        the coefficient of this method's estimate of the global norm.

        ``sq``: the whole gradient's squared norm (float64) where ``grads`` are one rank's shard of it
        (summed over the ranks: every rank then computes the same coefficient). A non-finite one
        makes the coefficient NaN, so every rank skips the parameter, not only the rank whose shard
        held the non-finite values."""
        skip_nonfinite = sq is not None
        if sq is None:
            sq = squared_norm(grads).double()  # float64 sums: a spike's squares come and go without cancellation
        finite = torch.isfinite(sq)
        sq_finite = torch.where(finite, sq, 0.0)
        if self._seen is None:  # the first gradient of a window
            zero = torch.zeros((), dtype=torch.float64, device=sq.device)
            if self._known is None:
                self._known = zero
            self._window_known = self._known
            self._seen = self._seen_with_history = self._seen_last = self._seen_total = zero
        last = self._last.get(index)
        self._seen = self._seen + sq_finite
        self._seen_total = self._seen_total + sq
        if last is not None:
            self._seen_with_history = self._seen_with_history + sq_finite
            self._seen_last = self._seen_last + last
        estimate = self._estimate()
        coefficient = (self.max_norm / (estimate.sqrt() + EPS)).clamp(max=1.0)
        if self.method == "adagc":
            coefficient = self._adagc(index, sq_finite, finite, coefficient)
        coefficient = coefficient.float()  # fp32, as clip_grad_norm_'s
        if skip_nonfinite:
            coefficient = torch.where(finite, coefficient, torch.nan)
        for g in grads:
            g.mul_(coefficient)  # as clip_grad_norm_ multiplies
        new_last = torch.where(finite, sq, last) if last is not None else sq_finite
        self._known = self._known + new_last - (last if last is not None else 0.0)
        self._last[index] = new_last

    def state_dict(self, pids: dict[int, int]) -> dict:
        """The history the estimates use, for a checkpoint (``pids``: parameter index -> saved id)."""
        params = {}
        for index, pid in pids.items():
            entry = {}
            if index in self._last:
                entry["norm_sq"] = self._last[index]
            if index in self._average:
                entry["average"], entry["updates"] = self._average[index]
            if entry:
                params[pid] = entry
        return {"method": self.method, "known": self._known, "last_total": self._last_total, "params": params}

    def load_state_dict(self, saved: dict, indices: dict[int, tuple[int, torch.device]]) -> None:
        """Restore ``state_dict()``'s history (``indices``: saved id -> parameter index and device).
        A history saved by another method is kept where it means the same (the squared norms)."""
        self._last, self._average = {}, {}
        for pid, entry in saved["params"].items():
            index, device = indices[pid]
            if "norm_sq" in entry:
                self._last[index] = entry["norm_sq"].to(device, torch.float64)
            if "average" in entry and self.method == saved["method"]:
                self._average[index] = (entry["average"].to(device, torch.float64), int(entry["updates"]))
        known, total = saved["known"], saved["last_total"]
        device = next(iter(indices.values()))[1] if indices else None
        self._known = None if known is None else known.to(device, torch.float64)
        self._last_total = None if total is None else total.to(device, torch.float64)
        self._seen = self._seen_total = None

    def _estimate(self) -> torch.Tensor:
        if self.method == "prefix":
            return self._seen
        unseen = (self._window_known - self._seen_last).clamp(min=0.0)
        if self.method == "previous":
            return self._seen + unseen
        growth = torch.where(self._seen_last > 0, self._seen_with_history / self._seen_last, 1.0)
        return self._seen + unseen * growth

    def _adagc(self, index: int, sq: torch.Tensor, finite: torch.Tensor, coefficient: torch.Tensor):
        norm = sq.sqrt()
        average, count = self._average.get(index, (None, 0))
        if count >= ADAGC_WARMUP:
            own = (ADAGC_RATIO * average / (norm + EPS)).clamp(max=1.0)
            coefficient = torch.minimum(coefficient, own)
        clipped = norm * coefficient
        if average is None:
            average = clipped
        else:
            average = torch.where(finite, ADAGC_DECAY * average + (1 - ADAGC_DECAY) * clipped, average)
        self._average[index] = (average, count + 1)
        return coefficient
