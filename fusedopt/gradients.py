"""The gradient pipeline: what happens to gradients between backward and their update.

Both places that update from gradients hand ``GradientPipeline.prepare`` a batch of (parameter, its
gradients: the gradient and its accumulated buffer, if any) and get back each one's coefficient for
the update (the kernel's ``grad_scale``, an fp32 0-d device tensor; None: the gradients as they are):

* gradient release (``release.py``), inside backward, for the gradients of one bucket or one
  parameter, in the order released;
* ``step()``, for every gradient still waiting (all of them with ``fused=False``).

A coefficient carries the finite check too: it is NaN exactly where the norm of its gradients is
not finite (a value not finite, or squares that overflow fp32), and that update is skipped, so
the update kernel reads one coefficient instead of the whole gradient to know.

The stages, in order:

0. **Multiply** by the optimizer's ``grad_multiplier``, if set (a loss normalised after backward:
   torchtune's ``1 / num_tokens``), in place, as the framework would have multiplied ``p.grad``.
1. **Unscale** (fp16 loss scaling, ``loss_scaling.py``): release unscales with the optimizer's
   ``grad_scaler``'s current scale; ``step()`` with the ``grad_scale`` ``scaler.step(opt)`` hands it.
2. **Reduce over shards** (FSDP2, ``sharding.py``): a sharded gradient's squared norm is summed over
   the ranks that shard it, so every rank clips and skips alike.
3. **Clip** (``max_grad_norm``, ``clipping.py``): against ``ReleaseClipping``'s estimate of the
   global norm where release updates (one pass, the later gradients do not exist yet), against the
   exact global norm in ``step()`` otherwise (``torch.nn.utils.clip_grad_norm_``).

Every number stays a device tensor: no host synchronisation (no ``.item()``, no ``bool(tensor)``).
"""

from __future__ import annotations

import weakref

import torch

from .clipping import ReleaseClipping, exact_coefficient, squared_norm
from .dispatch import release_clip_kernel, total_norm
from .loss_scaling import ReleasedUnscaling, inverse, unscale_
from .sharding import is_sharded, local, sum_over_shards
from .streams import queued_copy

Batch = list[tuple[torch.Tensor, list[torch.Tensor]]]


def check_scaler_step(
    grad_scaler, grad_scale: torch.Tensor | None, scaler_stepped: bool, has_updates: bool, hooks_ran: bool
) -> None:
    """Refuse a ``step()`` of a releasing optimizer whose released updates used gradients the scaler
    protocol did not unscale as it expects. ``grad_scale``: what ``scaler.step(opt)`` handed over
    (``scaler_stepped``: it called); ``hooks_ran``: release updated from a gradient since the last step."""
    if hooks_ran and grad_scale is not None and grad_scaler is None:
        raise RuntimeError(
            "a torch.amp.GradScaler stepped this fused=True optimizer, which does not know it: gradient release "
            "already updated parameters inside backward from the scaled gradients. Pass grad_scaler=scaler to "
            "the optimizer (or set opt.grad_scaler = scaler) before the first backward"
        )
    # (not torch.distributed.checkpoint's zero-gradient step: it has no updates, or no hook ran)
    if grad_scaler is not None and not scaler_stepped and has_updates and hooks_ran:
        raise RuntimeError(
            "step() of a fused=True optimizer with a grad_scaler was called directly while gradients wait for "
            "it: call scaler.step(optimizer), which hands step() the scale to unscale them with"
        )


def _multiply(batch: Batch, factor: torch.Tensor) -> None:
    """Multiply every gradient of ``batch`` (a sharded one's local shard) by ``factor`` in place."""
    together: dict[tuple, list[torch.Tensor]] = {}
    for _, grads in batch:
        for g in grads:
            g = local(g)
            together.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in together.items():
        torch._foreach_mul_(grads, factor.to(device))


class GradientPipeline:
    """Unscaling, the reduction of sharded norms, and clipping of one optimizer's gradients (see the
    module docstring). Reads the owner's ``max_grad_norm``, ``release_clipping`` and ``grad_scaler``
    as they are at each call; the clipping history under release lives here."""

    def __init__(self, optimizer, store):
        # its options, and its key in the scaler's record; weakly (state_store.py says why)
        self._owner = weakref.ref(optimizer)
        self._store = store  # param_index and shard_groups of its parameters
        self._clipping = self._fresh_clipping() if optimizer.max_grad_norm else None
        self._unscaling = ReleasedUnscaling()
        self._exact_norm: torch.Tensor | None = None  # exact clipping's last norm (step())

    # --- the clipping history (checkpoints) --------------------------------------------------

    @property
    def clipping(self) -> ReleaseClipping | None:
        """The history of clipping under release (None: the optimizer does not clip)."""
        return self._clipping

    def new_clipping(self) -> ReleaseClipping | None:
        """An empty history for the optimizer's settings as they are now (None: it does not clip)."""
        return None if self._clipping is None else self._fresh_clipping()

    def _fresh_clipping(self) -> ReleaseClipping:
        owner = self._owner()
        return ReleaseClipping(owner.max_grad_norm, owner.release_clipping, release_clip_kernel)

    def follow_max_grad_norm(self) -> None:
        """The owner's ``max_grad_norm`` was set: clipping under release starts with an empty history,
        stops, or continues its history at the new threshold."""
        max_norm = self._owner().max_grad_norm
        if max_norm is None:
            self._clipping = None
        elif self._clipping is None:
            self._clipping = self._fresh_clipping()
        else:
            self._clipping.set_max_norm(max_norm)

    def replace_clipping(self, clipping: ReleaseClipping) -> None:
        """Continue from ``clipping``'s history (a loaded checkpoint's)."""
        self._clipping = clipping

    def norm(self, releasing: bool) -> torch.Tensor | None:
        """``FusedOptimizer.grad_norm``: the norm the last clipping saw, before clipping."""
        if releasing and self._clipping is not None:
            return self._clipping.norm()
        return self._exact_norm

    def new_window(self) -> None:
        """``step()`` ended an update window."""
        if self._clipping is not None:
            self._clipping.new_window()

    def abandon_window(self) -> None:
        """A window ends without its step (a failed backward pass): its partial norm and the
        non-finite values its released gradients showed are forgotten."""
        if self._clipping is not None:
            self._clipping.abandon_window()
        self._unscaling.new_window()

    # --- the pipeline --------------------------------------------------------------------------

    def prepare(
        self,
        batch: Batch,
        *,
        releasing: bool,
        in_step: bool = False,
        grad_scale: torch.Tensor | None = None,
        scaler_stepped: bool = False,
    ) -> list:
        """Unscale and clip ``batch`` (each parameter with its gradient and accumulated buffer, if
        any) in place; returns each one's coefficient for its update (``grad_scale``; None: none).

        Gradient release calls it with ``in_step=False`` and local tensors (a sharded parameter's
        shard). ``step()`` calls it with ``in_step=True``, the tensors as the parameters hold them,
        ``releasing`` (release updated the rest of this window), ``grad_scale`` (what
        ``scaler.step(opt)`` handed over, or None) and ``scaler_stepped`` (``scaler.step(opt)`` called it)."""
        owner = self._owner()
        if owner.grad_multiplier is not None:
            _multiply(batch, owner.grad_multiplier)
        if in_step:
            unscaled = grad_scale is not None
            grads_of = [(p, [local(g) for g in grads]) for p, grads in batch] if unscaled or releasing else batch
            if unscaled:
                inv_scale = inverse(grad_scale)
                found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)  # the scaler has checked
                for _, grads in grads_of:
                    unscale_(grads, inv_scale.to(grads[0].device), found_inf)
        else:
            grads_of = batch
            scaler = owner.grad_scaler
            unscaled = scaler is not None and scaler.is_enabled()
            if unscaled:
                by_device: dict[torch.device, list[torch.Tensor]] = {}
                for _, grads in batch:
                    by_device.setdefault(grads[0].device, []).extend(grads)
                for grads in by_device.values():
                    self._unscaling.unscale_(scaler, grads)
        scales = [None] * len(batch)
        if releasing and (self._clipping is not None or unscaled):
            # step(): the rest of the window, as release treated the rest
            scales = self._clip_estimated(grads_of, note_nonfinite=unscaled, whole=in_step)
        if in_step and releasing and owner.grad_scaler is not None:
            self._unscaling.report(owner.grad_scaler, owner, scaler_stepped)  # the optimizer's id keys the record
        max_norm = owner.max_grad_norm
        if in_step and not releasing and max_norm is not None and batch:
            scales = self._clip_exact(batch, max_norm)
        return scales

    def _clip_exact(self, batch: Batch, max_norm: float) -> list:
        """``torch.nn.utils.clip_grad_norm_`` over the finite gradients of this step (no host sync): the
        coefficient of every update, on its gradient's device. A gradient whose norm is not finite adds
        nothing to the norm the coefficient comes from, and its own coefficient is NaN: only its update
        skips (torch's norm would be NaN or inf: every update skipped, or made from a zero gradient),
        and the update kernel learns it from the coefficient without reading the gradient again.
        While every norm is finite the coefficient is torch's, bit for bit. ``grad_norm`` is the norm
        of them all, as torch's and release's: not finite when a gradient is not."""
        tensors = [g for _, grads in batch for g in grads]
        self._exact_norm, norms = total_norm(tensors)
        norm = self._exact_norm
        if is_sharded(norm):  # over the ranks: every rank sees which whole gradients are not finite
            norm, norms = norm.full_tensor(), norms.full_tensor()
        finite = torch.isfinite(norms)
        finite_norm = torch.linalg.vector_norm(torch.where(finite, norms, 0.0))
        coefficient = exact_coefficient(torch.where(torch.isfinite(norm), norm, finite_norm), max_norm)
        if len(tensors) != len(batch):  # accumulated buffers: an update is finite if all its tensors are
            owners = [i for i, (_, grads) in enumerate(batch) for _ in grads]
            bad = torch.zeros(len(batch), dtype=torch.float32, device=finite.device)
            bad.index_add_(0, queued_copy(torch.tensor(owners), finite.device), (~finite).float())
            finite = bad == 0
        each = torch.where(finite, coefficient, torch.nan)
        on_device = {each.device: each.unbind()}
        scales = []
        for i, (_, grads) in enumerate(batch):
            device = local(grads[0]).device
            if device not in on_device:
                on_device[device] = each.to(device).unbind()
            scales.append(on_device[device][i])
        return scales

    def _clip_estimated(self, batch: Batch, *, note_nonfinite: bool, whole: bool) -> list:
        """Clip (unscaled, local) gradients as ``ReleaseClipping`` estimates, in batches of one
        device; returns each one's coefficient. A sharded parameter's gradient is clipped against
        its whole gradient's norm (an all-reduce of its squared norm) and, where that is not finite,
        skipped on every rank (and reported to the scaler when ``note_nonfinite``). Every rank must
        issue the same all-reduces: release's batches follow each rank's own shard sizes, so there
        they go parameter by parameter; ``whole`` (step()'s rest of the window, the same parameters
        on every rank) batches them as it batches whole gradients, with one all-reduce per batch."""
        clipping = self._clipping
        pending: Batch = []
        pending_groups: tuple = ()
        scales: list = []

        def clip_pending():
            if not pending:
                return
            indices, grads = [self._store.param_index(p) for p, _ in pending], [g for _, g in pending]
            sq = None
            if pending_groups:
                sq = sum_over_shards(torch.stack([squared_norm(g) for g in grads]).double(), pending_groups)
                if note_nonfinite:
                    self._unscaling.note_nonfinite(~torch.isfinite(sq).all())
            if clipping is not None:
                scales.extend(clipping.clip(indices, grads, sq).unbind())
            else:
                if sq is not None:  # loss scaling alone: a gradient not finite on any rank is skipped on all
                    for entry, finite in zip(grads, torch.isfinite(sq).unbind()):
                        torch._foreach_mul_(entry, torch.where(finite, 1.0, torch.nan))
                scales.extend([None] * len(pending))
            pending.clear()

        for p, grads in batch:
            groups = self._store.shard_groups(p)
            if pending and (pending[0][1][0].device != grads[0].device or groups != pending_groups):
                clip_pending()
            pending.append((p, grads))
            pending_groups = groups
            if groups and not whole:  # in release order, one by one
                clip_pending()
        clip_pending()
        return scales
