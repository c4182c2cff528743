"""Gradient clipping by the global L2 norm (``max_grad_norm``).

With ``fused=False`` the optimizer clips in ``step()`` exactly as ``torch.nn.utils.clip_grad_norm_``
(coefficient ``min(1, max_norm / (norm + 1e-6))``). With ``fused=True`` each parameter is updated
inside backward, before the gradients of the parameters still to come exist, so the global norm is
not known yet: ``ReleaseClipping`` clips the released gradients in one pass with an estimate of it,
and keeps the exact norm of everything it saw for ``opt.grad_norm``. Every number is a device
tensor: no host synchronisation.

Release hands gradients over in batches: the updates held for one bucket, or one parameter updated
at once. A batch costs a few small kernels however many parameters it holds (the per-parameter
host time of this bookkeeping, issued from the hooks, was what made clipping slow). The estimate
(``method``), when a batch arrives, from the squared norms ``s_j`` of the gradients seen in this
backward so far, that batch's included (``seen``), and each parameter's squared norm at its
previous update ``l_j``:

* ``"scaled"`` (the default): the last global norm, scaled by how much the gradients seen so far
  grew against their own previous norms: ``sum_seen s + sum_unseen l * (sum_seen s / sum_seen l)``.
  A spike that scales every gradient (a bad batch, a loss spike) is recognised in full at the first
  batch; in a steady state it equals the exact norm up to the noise of the seen part.
* ``"adagc"``: ``"scaled"``, and besides each gradient at most ``1.05`` times an exponential average
  (0.98) of its own clipped norms (per-tensor adaptive clipping), once that average has 10 updates:
  it also catches a spike confined to a few tensors, which moves the global norm little.

The first backward has no history: it is clipped with the norm of the part seen so far.
"""

from __future__ import annotations

import warnings

import torch

CLIP_METHODS = ("scaled", "adagc")
DEFAULT_CLIP_METHOD = "scaled"
# Methods measured and removed: each under-clipped the first parameters released in a spike step,
# and trained worse than "scaled" on every seed with loss spikes (benchmarks/RESULTS.md).
REMOVED_CLIP_METHODS = {
    "previous": "it counted the parameters not yet released at their calm norms",
    "prefix": "it counted only the part released so far",
}
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s

ADAGC_RATIO = 1.05  # a tensor's gradient norm may exceed its own average by this factor
ADAGC_DECAY = 0.98
ADAGC_WARMUP = 10  # updates before a tensor's own average is trusted


def check_clip_method(method) -> None:
    if method in REMOVED_CLIP_METHODS:
        raise ValueError(
            f"release_clipping={method!r} was removed: {REMOVED_CLIP_METHODS[method]}, so it under-clipped in a "
            f"loss spike; use {DEFAULT_CLIP_METHOD!r} (the default) or one of {', '.join(map(repr, CLIP_METHODS))}"
        )
    if method not in CLIP_METHODS:
        raise ValueError(f"Invalid release_clipping: {method!r} (expected one of {', '.join(CLIP_METHODS)})")


def exact_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient ``min(1, max_norm / (norm + 1e-6))`` for the
    total norm of a step's gradients (computed in the norm's dtype, as torch does), as an fp32 0-d
    device tensor. The update kernel multiplies the gradients by it as it reads them (``scale_``
    where it does not): one read of the gradients for the norm is all clipping adds to a step."""
    return (max_norm / (norm + EPS)).clamp(max=1.0).float()


def scale_(tensors: list[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply gradients in place by an fp32 coefficient, each product in fp32 and rounded once to
    the tensor's dtype, on every device alike (what the update kernel does with its ``grad_scale``;
    torch's multiply of a bf16 CUDA tensor would round the coefficient to bf16 first)."""
    for t in tensors:
        c = coefficient.to(t.device)
        if t.dtype == torch.float32:
            t.mul_(c)
        else:
            t.copy_(t.float().mul_(c))


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of the sum of ``grads`` (a gradient and its accumulated buffer), fp32."""
    total = grads[0] if len(grads) == 1 else grads[0].float() + grads[1].float()
    return torch.linalg.vector_norm(total, dtype=torch.float32).square()


def squared_norms(entries: list[list[torch.Tensor]]) -> torch.Tensor:
    """``squared_norm`` of every entry (a gradient, or a gradient and its accumulated buffer), as one
    float64 vector; the single gradients' norms in one multi-tensor kernel."""
    if all(len(grads) == 1 for grads in entries):
        norms = torch._foreach_norm([grads[0] for grads in entries], 2, dtype=torch.float32)
        return torch.stack(norms).square().double()
    return torch.stack([squared_norm(grads) for grads in entries]).double()


class ReleaseClipping:
    """One-pass clipping of released gradients for one optimizer (see the module docstring)."""

    def __init__(self, max_norm: float, method: str):
        check_clip_method(method)
        self.max_norm = max_norm
        self.method = method
        self._last: dict[int, torch.Tensor] = {}  # param index -> squared norm at its previous update
        self._average: dict[int, tuple[torch.Tensor, int]] = {}  # adagc: index -> (average norm, updates)
        self._flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (False, True)
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

    def clip(
        self, indices: list[int], grads: list[list[torch.Tensor]], sq: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Clip a batch of released gradients. ``indices``: the parameters' indices; ``grads``: each
        one's gradient (and its accumulated buffer), all on one device. Returns the coefficient (fp32
        0-d) the caller multiplies every gradient of the batch by (the update kernel's
        ``grad_scale``); or None where the coefficients differ per parameter (``adagc``, sharded
        gradients), which are then applied here, in place (``scale_``).

        ``sq``: the whole gradients' squared norms (float64 vector) where ``grads`` are one rank's
        shards of them (summed over the ranks: every rank then computes the same coefficients). A
        non-finite one makes that parameter's coefficient NaN, so every rank skips it, not only the
        rank whose shard held the non-finite values."""
        skip_nonfinite = sq is not None
        if sq is None:
            sq = squared_norms(grads)  # float64 sums: a spike's squares come and go without cancellation
        finite = torch.isfinite(sq)
        sq_finite = torch.where(finite, sq, 0.0)
        if self._seen is None:  # the first gradient of a window
            zero = torch.zeros((), dtype=torch.float64, device=sq.device)
            if self._known is None:
                self._known = zero
            self._window_known = self._known
            self._seen = self._seen_with_history = self._seen_last = self._seen_total = zero
        history = [self._last.get(i) for i in indices]
        self._seen = self._seen + sq_finite.sum()
        self._seen_total = self._seen_total + sq.sum()
        if all(h is None for h in history):
            new_last = sq_finite
            self._known = self._known + new_last.sum()
        else:
            zero = torch.zeros_like(sq[0])
            last = torch.stack([zero if h is None else h for h in history])
            if all(h is not None for h in history):
                seen = sq_finite
                new_last = torch.where(finite, sq, last)
            else:
                known = self._mask([h is not None for h in history], sq.device)
                seen = torch.where(known, sq_finite, 0.0)
                new_last = torch.where(known, torch.where(finite, sq, last), sq_finite)
            self._seen_with_history = self._seen_with_history + seen.sum()
            self._seen_last = self._seen_last + last.sum()
            self._known = self._known + (new_last - last).sum()
        coefficient = (self.max_norm / (self._estimate().sqrt() + EPS)).clamp(max=1.0)
        if self.method == "adagc":
            coefficient = self._adagc(indices, sq_finite, finite, coefficient)
        coefficient = coefficient.float()  # fp32, as clip_grad_norm_'s
        if skip_nonfinite:
            coefficient = torch.where(finite, coefficient, torch.nan)
        for i, value in zip(indices, new_last.unbind()):
            self._last[i] = value
        if not skip_nonfinite and coefficient.dim() == 0:
            return coefficient
        for entry, c in zip(grads, coefficient.expand(len(grads)).unbind()):
            scale_(entry, c)
        return None

    def state_dict(self, pids: dict[int, int]) -> dict:
        """The history the estimates use, for a checkpoint (``pids``: parameter index -> saved id)."""
        params = {}
        for index, pid in pids.items():
            entry = {}
            if index in self._last:
                entry["norm_sq"] = self._last[index].clone()  # a view of its batch's vector
            if index in self._average:
                average, updates = self._average[index]
                entry["average"], entry["updates"] = average.clone(), updates
            if entry:
                params[pid] = entry
        return {"method": self.method, "known": self._known, "last_total": self._last_total, "params": params}

    def load_state_dict(self, saved: dict, indices: dict[int, tuple[int, torch.device]]) -> None:
        """Restore ``state_dict()``'s history (``indices``: saved id -> parameter index and device).
        A history saved by another method is kept where it means the same (the squared norms)."""
        method = saved["method"]
        if method in REMOVED_CLIP_METHODS:
            warnings.warn(
                f"this checkpoint was saved with release_clipping={method!r}, which was removed "
                f"({REMOVED_CLIP_METHODS[method]}); its clipping history (each parameter's last squared "
                f"gradient norm) is kept and clipping continues with release_clipping={self.method!r}",
                UserWarning,
                stacklevel=4,
            )
        self._last, self._average = {}, {}
        for pid, entry in saved["params"].items():
            index, device = indices[pid]
            if "norm_sq" in entry:
                self._last[index] = entry["norm_sq"].to(device, torch.float64)
            if "average" in entry and self.method == method:
                self._average[index] = (entry["average"].to(device, torch.float64), int(entry["updates"]))
        known, total = saved["known"], saved["last_total"]
        device = next(iter(indices.values()))[1] if indices else None
        self._known = None if known is None else known.to(device, torch.float64)
        self._last_total = None if total is None else total.to(device, torch.float64)
        self._seen = self._seen_total = None

    def _mask(self, flags: list[bool], device: torch.device) -> torch.Tensor:
        """``flags`` as a bool device vector, stacked from two cached device scalars (a tensor built
        from a host list would be a host-to-device copy)."""
        cached = self._flags.get(device)
        if cached is None:
            cached = self._flags[device] = (
                torch.zeros((), dtype=torch.bool, device=device),
                torch.ones((), dtype=torch.bool, device=device),
            )
        return torch.stack([cached[f] for f in flags])

    def _estimate(self) -> torch.Tensor:
        unseen = (self._window_known - self._seen_last).clamp(min=0.0)
        growth = torch.where(self._seen_last > 0, self._seen_with_history / self._seen_last, 1.0)
        return self._seen + unseen * growth

    def _adagc(self, indices: list[int], sq: torch.Tensor, finite: torch.Tensor, coefficient: torch.Tensor):
        """Each parameter's coefficient: ``coefficient``, and at most its own average's bound."""
        norm = sq.sqrt()
        saved = [self._average.get(i, (None, 0)) for i in indices]
        device = sq.device
        averages = torch.stack([torch.zeros_like(sq[0]) if a is None else a for a, _ in saved])
        coefficients = coefficient.expand_as(norm)
        warm = [count >= ADAGC_WARMUP for _, count in saved]
        if any(warm):
            own = (ADAGC_RATIO * averages / (norm + EPS)).clamp(max=1.0)
            coefficients = torch.where(self._mask(warm, device), torch.minimum(coefficients, own), coefficients)
        clipped = norm * coefficients
        updated = torch.where(finite, ADAGC_DECAY * averages + (1 - ADAGC_DECAY) * clipped, averages)
        if not all(a is not None for a, _ in saved):
            updated = torch.where(self._mask([a is not None for a, _ in saved], device), updated, clipped)
        for i, average, (_, count) in zip(indices, updated.unbind(), saved):
            self._average[i] = (average, count + 1)
        return coefficients
