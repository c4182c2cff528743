"""Gradient clipping by the global L2 norm (``max_grad_norm``).

With ``fused=False`` the optimizer clips in ``step()`` exactly as ``torch.nn.utils.clip_grad_norm_``
(coefficient ``min(1, max_norm / (norm + 1e-6))``). With ``fused=True`` each parameter is updated
inside backward, before the gradients of the parameters still to come exist, so the global norm is
not known yet: ``ReleaseClipping`` clips the released gradients in one pass with an estimate of it,
and keeps the exact norm of everything it saw for ``opt.grad_norm``. Every number is a device
tensor: no host synchronisation.

Release hands gradients over in batches: the updates held for one bucket, or one parameter updated
at once. A batch costs one launch (``kernels/clipping.py``) however many parameters it holds: it
sums the gradients' squares and does the bookkeeping. Issued from the hooks, host time is what
clipping costs: as dozens of small torch ops per batch, it made clipping slow. The estimate
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

import math
import warnings

import torch

from .streams import is_default_stream_current, on_default_stream, queued_copy

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


def batch_norms(entries: list[list[torch.Tensor]]) -> tuple[torch.Tensor, bool]:
    """The norms of every entry (a gradient, or a gradient and its accumulated buffer) as one fp32
    vector, and whether they still need squaring: the single gradients' norms come from one
    multi-tensor kernel (``squared_norm`` of each where a buffer is added)."""
    if all(len(grads) == 1 for grads in entries):
        return torch.stack(torch._foreach_norm([grads[0] for grads in entries], 2, dtype=torch.float32)), True
    return torch.stack([squared_norm(grads) for grads in entries]), False


# The history's float64 scalars: slots of ``ReleaseClipping``'s ``stats`` buffer (the kernel's too)
SLOT = {
    name: i
    for i, name in enumerate(
        ("known", "window_known", "seen", "seen_with_history", "seen_last", "total", "last_total")
        + ("max_norm", "eps", "adagc_ratio", "adagc_decay", "adagc_keep")  # constants, as float64
    )
}
_INDEX_CACHE = 64  # batches whose parameter indices stay on the device


class ReleaseClipping:
    """One-pass clipping of released gradients for one optimizer (see the module docstring).

    The history lives in device buffers on the device of the first batch (``stats``: the window's
    sums, ``SLOT``; ``last``: each parameter's squared norm at its previous update, negative where
    it has none; ``average``/``updates``: ``adagc``'s), so that a batch costs one launch
    (``kernels/clipping.py``: the norms where it can read the gradients, then the bookkeeping), or
    its norms and the same arithmetic as torch ops (``_reference``) that fold them in and write the
    coefficient. ``kernel_for(device)`` says which (``dispatch.release_clip_kernel``; None: always
    the reference)."""

    def __init__(self, max_norm: float, method: str, kernel_for=None):
        check_clip_method(method)
        self.max_norm = max_norm
        self.method = method
        self._kernel_for = kernel_for
        self._reset()

    def _reset(self) -> None:
        self._kernel = None
        self._device: torch.device | None = None
        self._stats = self._last = self._average = self._updates = None
        self._indices: dict[tuple, torch.Tensor] = {}  # a batch's parameter indices, on the device
        self._window_open = False  # this window has clipped a batch
        self._has_total = False  # some window has (norm() has a value)
        self._has_last_total = False  # a window before the open one has
        self._has_known = False

    def new_window(self) -> None:
        """``step()`` ended an update window."""
        self._window_open = False

    def set_max_norm(self, max_norm: float) -> None:
        """Clip at ``max_norm`` from the next batch on (the history's norms stay)."""
        self.max_norm = max_norm
        if self._stats is not None:
            self._stats[SLOT["max_norm"]] = max_norm

    def abandon_window(self) -> None:
        """A window ends without its step (its backward pass failed): its partial total is no step's
        norm, so ``norm()`` and the next window see the last finished window's. The parameters it
        updated keep their squared norms: they were updated from them."""
        if self._window_open:
            if self._has_last_total:
                self._stats[SLOT["total"]] = self._stats[SLOT["last_total"]]
            self._has_total = self._has_last_total
            self._window_open = False

    def norm(self) -> torch.Tensor | None:
        """The global norm of the gradients this window has clipped so far (the last window's
        when none yet); exact once every gradient was seen."""
        return self._stats[SLOT["total"]].sqrt().float() if self._has_total else None

    def clip(self, indices: list[int], grads: list[list[torch.Tensor]], sq: torch.Tensor | None = None) -> torch.Tensor:
        """Clip a batch of released gradients. ``indices``: the parameters' indices; ``grads``: each
        one's gradient (and its accumulated buffer), all on one device. Returns each parameter's
        coefficient (an fp32 vector on that device) its gradients are multiplied by (the update
        kernel's ``grad_scale``): NaN where the squared norm of the gradient (plus its buffer) is
        not finite, which skips that update (the kernel needs to read nothing else to know).

        ``sq``: the whole gradients' squared norms (float64 vector) where ``grads`` are one rank's
        shards of them (summed over the ranks: every rank then computes the same coefficients, and
        skips a parameter whose shard on any rank held the non-finite values)."""
        grad = grads[0][0]
        if not grad.is_cuda or is_default_stream_current(grad.get_device()):
            return self._clip(indices, grads, sq)
        # every batch folds into the same history, so on one stream, in the order the hooks ran: a
        # gradient made ready on a side stream is clipped on the default stream, after it
        current = torch.cuda.current_stream(grad.device)
        with on_default_stream(grad, after_current=True):
            coefficients = self._clip(indices, grads, sq)
        coefficients.record_stream(current)  # the update reads it there
        return coefficients

    def _clip(self, indices, grads, sq) -> torch.Tensor:
        device = grads[0][0].device
        self._ensure(device, max(indices) + 1)
        adagc = self.method == "adagc"
        coefficients = torch.empty(len(indices), dtype=torch.float32, device=self._device)
        first = not self._window_open
        history = (self._stats, self._last, self._average, self._updates)
        singles = [entry[0] for entry in grads if len(entry) == 1]
        if (
            self._kernel is not None
            and sq is None
            and len(singles) == len(grads)
            and self._kernel.takes_gradients(singles, self._device)
        ):  # the norms in the same launch
            self._kernel.from_gradients(
                singles, indices, history, coefficients, first=first, adagc=adagc, warmup=ADAGC_WARMUP
            )
        else:
            if sq is None:  # squared in fp32, summed in float64: a spike's squares come and go without cancellation
                x, square = batch_norms(grads)
            else:
                x, square = sq, False
            x, index = x.to(self._device), self._index_tensor(indices)
            if self._kernel is not None:
                self._kernel(
                    x, index, history, coefficients, first=first, square=square, adagc=adagc, warmup=ADAGC_WARMUP
                )
            else:
                coefficients.copy_(self._reference(x, index, *history, first=first, square=square))
        if first:  # the kernel kept the last window's total
            self._has_last_total = self._has_total
        self._window_open = self._has_total = self._has_known = True
        return coefficients.to(device)

    def _ensure(self, device: torch.device, size: int) -> None:
        """The buffers, on ``device`` at the first batch, with room for ``size`` parameters."""
        if self._stats is None:
            self._device = device
            self._kernel = self._kernel_for(device) if self._kernel_for is not None else None
            constants = dict(
                max_norm=self.max_norm, eps=EPS, adagc_ratio=ADAGC_RATIO, adagc_decay=ADAGC_DECAY,
                adagc_keep=1 - ADAGC_DECAY,
            )  # fmt: skip
            stats = [constants.get(name, 0.0) for name in SLOT]  # the sums start at 0
            self._stats = queued_copy(torch.tensor(stats, dtype=torch.float64), device)
        if self._last is None or self._last.numel() < size:
            size = max(size, 2 * (0 if self._last is None else self._last.numel()))
            last = torch.full((size,), -1.0, dtype=torch.float64, device=self._device)
            average = torch.zeros(size, dtype=torch.float64, device=self._device)
            updates = torch.zeros(size, dtype=torch.int32, device=self._device)
            if self._last is not None:
                n = self._last.numel()
                last[:n], average[:n], updates[:n] = self._last, self._average, self._updates
            self._last, self._average, self._updates = last, average, updates

    def _index_tensor(self, indices: list[int]) -> torch.Tensor:
        """``indices`` as an int64 device tensor, copied without waiting and kept for the next time."""
        key = tuple(indices)
        cached = self._indices.get(key)
        if cached is None:
            if len(self._indices) >= _INDEX_CACHE:
                self._indices.clear()
            self._indices[key] = cached = queued_copy(torch.tensor(indices, dtype=torch.int64), self._device)
        return cached

    def _reference(self, x, index, stats, last_all, average_all, updates_all, *, first, square):
        """The kernel's arithmetic as torch ops (``kernels/clipping.py``): folds a batch into the
        history and returns each parameter's coefficient, fp32 (NaN: its squared norm is not finite)."""
        sq = (x.square() if square else x).double()
        finite = torch.isfinite(sq)
        sq_finite = torch.where(finite, sq, 0.0)
        s = {name: stats[i] for name, i in SLOT.items()}
        known = s["known"].clone()
        if first:
            stats[SLOT["last_total"]] = s["total"]
            stats[SLOT["window_known"]] = known
            seen = seen_with_history = seen_last = total = torch.zeros_like(known)
        else:
            seen, seen_with_history = s["seen"].clone(), s["seen_with_history"].clone()
            seen_last, total = s["seen_last"].clone(), s["total"].clone()
        window_known = stats[SLOT["window_known"]].clone()
        last = last_all[index]
        has = last >= 0
        last = torch.where(has, last, 0.0)
        new_last = torch.where(has, torch.where(finite, sq, last), sq_finite)
        seen = seen + sq_finite.sum()
        total = total + sq.sum()
        seen_with_history = seen_with_history + torch.where(has, sq_finite, 0.0).sum()
        seen_last = seen_last + last.sum()
        known = known + (new_last - last).sum()
        unseen = (window_known - seen_last).clamp(min=0.0)
        growth = torch.where(seen_last > 0, seen_with_history / torch.where(seen_last > 0, seen_last, 1.0), 1.0)
        estimate = seen + unseen * growth
        coefficient = (s["max_norm"] / (estimate.sqrt() + s["eps"])).clamp(max=1.0)
        coefficients = coefficient.expand_as(sq)
        if self.method == "adagc":
            norm = sq_finite.sqrt()
            updates = updates_all[index]
            averaged = updates > 0
            average = torch.where(averaged, average_all[index], 0.0)
            own = (s["adagc_ratio"] * average / (norm + s["eps"])).clamp(max=1.0)
            coefficients = torch.where(updates >= ADAGC_WARMUP, torch.minimum(coefficients, own), coefficients)
            clipped = norm * coefficients
            decayed = s["adagc_decay"] * average + s["adagc_keep"] * clipped
            average_all[index] = torch.where(averaged, torch.where(finite, decayed, average), clipped)
            updates_all[index] = updates + 1
        last_all[index] = new_last
        for name, value in (("known", known), ("seen", seen), ("seen_with_history", seen_with_history),
                            ("seen_last", seen_last), ("total", total)):  # fmt: skip
            stats[SLOT[name]] = value
        return torch.where(finite, coefficients.float(), torch.nan)

    def state_dict(self, pids: dict[int, int]) -> dict:
        """The history the estimates use, for a checkpoint (``pids``: parameter index -> saved id).
        Reads which parameters have a history from the device (one copy to the host)."""
        params = {}
        size = 0 if self._last is None else self._last.numel()
        has_last = (self._last >= 0).tolist() if size else []
        updates = self._updates.tolist() if size else []
        for index, pid in pids.items():
            entry = {}
            if index < size and has_last[index]:
                entry["norm_sq"] = self._last[index].clone()
            if index < size and updates[index]:
                entry["average"], entry["updates"] = self._average[index].clone(), updates[index]
            if entry:
                params[pid] = entry
        stats = self._stats
        known = stats[SLOT["known"]].clone() if self._has_known else None
        if self._window_open:  # the last closed window's total
            last_total = stats[SLOT["last_total"]].clone() if self._has_last_total else None
        else:
            last_total = stats[SLOT["total"]].clone() if self._has_total else None
        return {"method": self.method, "known": known, "last_total": last_total, "params": params}

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
        known, total = saved["known"], saved["last_total"]
        _refuse_corrupt_history(saved)
        device = next(iter(indices.values()))[1] if indices else torch.device("cpu")
        size = max((index for index, _ in indices.values()), default=0) + 1
        last = torch.full((size,), -1.0, dtype=torch.float64)
        average = torch.zeros(size, dtype=torch.float64)
        updates = torch.zeros(size, dtype=torch.int32)
        for pid, entry in saved["params"].items():
            index, _ = indices[pid]
            if "norm_sq" in entry:
                last[index] = entry["norm_sq"].to("cpu", torch.float64)
            if "average" in entry and self.method == method:
                average[index] = entry["average"].to("cpu", torch.float64)
                updates[index] = int(entry["updates"])
        self._reset()
        self._ensure(device, size)
        self._last.copy_(last)
        self._average.copy_(average)
        self._updates.copy_(updates)
        if known is not None:
            self._stats[SLOT["known"]] = known.to(device, torch.float64)
            self._has_known = True
        if total is not None:
            self._stats[SLOT["total"]] = total.to(device, torch.float64)
            self._has_total = True


def _refuse_corrupt_history(saved: dict) -> None:
    """Refuse a history no clipping could have written: squared norms (each parameter's, their sum
    ``known``, adagc's averages) are finite and not negative, update counts not negative. The last
    total may be NaN or inf (a non-finite gradient's step reports that norm) but never negative."""
    values = [("known", saved["known"], True)] + [("last_total", saved["last_total"], False)]
    for pid, entry in saved["params"].items():
        values += [(f"norm_sq of parameter {pid}", entry.get("norm_sq"), True)]
        values += [(f"average of parameter {pid}", entry.get("average"), True)]
        if int(entry.get("updates", 0)) < 0:
            raise ValueError(f"the clipping history's update count of parameter {pid} is negative")
    for name, value, finite in values:
        if value is None:
            continue
        x = float(value)
        if x < 0 or (finite and not math.isfinite(x)):
            raise ValueError(
                f"the clipping history's {name} is {x}: a squared norm is {'finite and ' * finite}never negative"
            )
