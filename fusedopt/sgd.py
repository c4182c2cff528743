"""fusedopt.SGD: SGD with momentum, with compressed momentum and gradient release.

The class, its fp32 math (the reference the kernel is held to), its state slot, its kernel
branch and scalars, and its torch.optim counterpart.
"""

from __future__ import annotations

import torch

from .clipping import DEFAULT_CLIP_METHOD
from .optimizer import FusedOptimizer, check_number, check_refused_options
from .release_notices import NOT_GIVEN


def sgd_math(p, g, moments, step, *, lr, momentum, dampening, nesterov, weight_decay):
    """SGD with momentum, dampening and nesterov as ``torch.optim.SGD`` (first step: buffer = gradient)."""
    # torch.add(..., alpha=) as torch.optim.SGD writes it (the CPU kernel fuses multiply and add)
    d = torch.add(g, p, alpha=weight_decay) if weight_decay != 0 else g
    new_moments = {}
    if momentum != 0:
        decayed = torch.add(moments["momentum_buffer"] * momentum, d, alpha=1 - dampening)
        buf = torch.where(step == 1, d, decayed)
        new_moments["momentum_buffer"] = buf
        d = torch.add(d, buf, alpha=momentum) if nesterov else buf
    return torch.add(p, d, alpha=-lr), new_moments


class SGD(FusedOptimizer):
    """Drop-in ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay as torch).

    ``state_bits=32`` on fp32 parameters is exactly ``torch.optim.SGD``. With ``momentum=0``
    there is no state beyond the step count.
    """

    algorithm = "sgd"
    math = staticmethod(sgd_math)
    slots = ("momentum_buffer",)
    kernel_id = 1  # the ALGO == 1 branch of kernels/update.py
    torch_group_keys = dict(foreach=None, differentiable=False, fused=None)
    torch_saves_step = False  # torch.optim.SGD keeps only the momentum buffer

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        nesterov: bool = False,
        weight_decay: float = 0,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        state_bits: int = 8,
        state_format: str | None = None,
        master_weight_bits: int | None = 24,
        min_compress_numel: int = 4096,
        seed: int | None = None,
        fused: bool = False,
        accumulation_steps: int = 1,
        max_grad_norm: float | None = NOT_GIVEN,
        release_clipping: str = DEFAULT_CLIP_METHOD,
        grad_scaler: torch.amp.GradScaler | None = None,
    ):
        check_refused_options(foreach=foreach, differentiable=differentiable)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            maximize=maximize,
        )
        defaults.update(
            state_bits=state_bits,
            state_format=state_format,
            master_weight_bits=master_weight_bits,
            min_compress_numel=min_compress_numel,
        )
        super().__init__(
            params,
            defaults,
            fused=fused,
            accumulation_steps=accumulation_steps,
            seed=seed,
            max_grad_norm=max_grad_norm,
            release_clipping=release_clipping,
            grad_scaler=grad_scaler,
        )

    def check_hyperparameters(self, group):
        check_number("learning rate", group["lr"])
        check_number("momentum value", group["momentum"])
        check_number("dampening value", group["dampening"])
        check_number("weight_decay value", group["weight_decay"])
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"Invalid nesterov: {group['nesterov']!r} (expected True or False)")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def state_slots(self, group):
        return self.slots if group["momentum"] != 0 else ()

    def hyper(self, group):
        return {k: group[k] for k in ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize")}

    @staticmethod
    def ema_decays(hyper):
        # buf = momentum * buf + (1 - dampening) * d (the first step's buf = d starts from zeros)
        return {"momentum_buffer": hyper["momentum"]}

    @staticmethod
    def kernel_scalars(hyper):
        # the kernel's beta1 carries the momentum, lerp_weight 1 - dampening
        return dict(
            lr=hyper["lr"],
            beta1=hyper["momentum"],
            weight_decay=hyper["weight_decay"],
            lerp_weight=1 - hyper["dampening"],
            moment_decays=(hyper["momentum"],),  # ema_decays in slot order
        )
