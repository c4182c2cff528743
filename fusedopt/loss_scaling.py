"""fp16 loss scaling with ``torch.amp.GradScaler``.

``fused=False``: the optimizer takes part in the scaler's protocol for fused optimizers
(``_step_supports_amp_scaling``): ``scaler.step(opt)`` gives ``step()`` the scale as
``opt.grad_scale``, and ``step()`` unscales each gradient before its update. A non-finite gradient
skips its parameter (the optimizer's rule) and the scaler, which checked every gradient, backs off.

``fused=True``: the updates run inside backward, before ``scaler.step(opt)``, so the optimizer must
know the scaler beforehand (``grad_scaler=scaler``). Each released gradient is unscaled with the
scaler's current scale (read from its device tensor: no host synchronisation) and checked for
non-finite values; ``step()`` hands what was found to the scaler, so ``scaler.update()`` backs off
as it would have.

Sharded parameters (FSDP2): a rank unscales only its shard, so it alone cannot know whether the
parameter's gradient is finite. The optimizer sums the shards' squared norms over the ranks
(``sharding.py``) and passes the verdict as ``skip``: every rank then skips the parameter (its
gradient made NaN) and records an overflow, so the ranks' updates and the scaler's found_inf agree.
"""

from __future__ import annotations

import torch


def check_grad_scaler(scaler) -> None:
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"Invalid grad_scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")


def unscale_(grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` to 1 if any value is not finite,
    exactly as the scaler unscales."""
    for g in grads:  # the fused op wants tensors of one dtype
        if g.dtype == torch.bfloat16:  # the fused op has no bf16 CUDA kernel: the same two steps, unfused
            found_inf.masked_fill_(~torch.isfinite(g).all(), 1.0)
            g.mul_(inv_scale)  # computed in fp32, rounded to bf16 once, as the fused op does
        else:
            torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, inv_scale)


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in fp32, as GradScaler computes it."""
    return scale.double().reciprocal().float()


class ReleasedUnscaling:
    """Unscales released gradients with a scaler's scale and reports non-finite ones back to it."""

    def __init__(self):
        self._inv_scale: dict[torch.device, torch.Tensor] = {}  # per device, for one update window
        self._found_inf: dict[torch.device, torch.Tensor] = {}

    def unscale_(
        self, scaler: torch.amp.GradScaler, grads: list[torch.Tensor], skip: torch.Tensor | None = None
    ) -> None:
        """Unscale ``grads`` in place; ``skip`` (a 0-d bool device tensor): the whole gradient, over
        every rank, is not finite, so make these NaN (the update skips them) and record an overflow."""
        device = grads[0].device
        inv_scale = self._inv_scale.get(device)
        if inv_scale is None:
            scale = scaler._scale  # the scaler's device tensor (get_scale() would synchronise)
            if scale is None:
                raise RuntimeError(
                    "the optimizer's grad_scaler has no scale yet: backward ran on a loss that the scaler did not "
                    "scale; call scaler.scale(loss).backward()"
                )
            inv_scale = self._inv_scale[device] = inverse(scale.to(device))
            self._found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        if skip is not None:
            inv_scale = torch.where(skip, torch.nan, inv_scale)
        unscale_(grads, inv_scale, self._found_inf[device])
        if skip is not None:
            self.note_nonfinite(skip)

    def note_nonfinite(self, skip: torch.Tensor) -> None:
        """Record an overflow when ``skip`` (a 0-d bool device tensor) is set."""
        found = self._found_inf.get(skip.device)
        if found is None:
            found = self._found_inf[skip.device] = torch.zeros((), dtype=torch.float32, device=skip.device)
        found.masked_fill_(skip, 1.0)

    def report(self, scaler: torch.amp.GradScaler, optimizer, stepped: bool) -> None:
        """Add what the released gradients showed to the scaler's record for ``optimizer``, which
        ``scaler.update()`` reads (it backs off when anything was not finite). ``stepped``:
        ``scaler.step(optimizer)`` is the caller; a window that released nothing (a failed backward
        closed it) then records no overflow, as ``scaler.update()`` needs a record of every optimizer
        stepped."""
        if self._found_inf:
            recorded = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for device, found in self._found_inf.items():
                recorded[device] = recorded[device] + found if device in recorded else found
        elif stepped and scaler.is_enabled() and scaler._scale is not None:
            recorded = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            if not recorded:
                device = scaler._scale.device
                recorded[device] = torch.zeros((), dtype=torch.float32, device=device)
        self.new_window()

    def new_window(self) -> None:
        self._inv_scale.clear()
        self._found_inf.clear()
