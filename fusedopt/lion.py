"""fusedopt.Lion: Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023).

The class, its fp32 math (the reference the kernel is held to), its state slot and its kernel
branch and scalars.
"""

from __future__ import annotations

import torch

from .clipping import DEFAULT_CLIP_METHOD
from .optimizer import FusedOptimizer, check_betas, check_number
from .release_notices import NOT_GIVEN


def lion_math(p, g, moments, step, *, lr, beta1, beta2, weight_decay):
    """Lion (Chen et al. 2023): sign of an interpolated momentum, decoupled weight decay."""
    m = moments["exp_avg"]
    direction = (m * beta1 + g * (1 - beta1)).sign()
    p = torch.add(p * (1 - lr * weight_decay), direction, alpha=-lr)
    return p, {"exp_avg": torch.add(m * beta2, g, alpha=1 - beta2)}


class Lion(FusedOptimizer):
    """Lion: ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``, then ``m = beta2 * m + (1 - beta2) * g``.

    Weight decay is decoupled: ``p *= 1 - lr * weight_decay`` before the signed step. One
    moment: 4 bytes per parameter at ``state_bits=32``, 2 at ``16``.
    """

    algorithm = "lion"
    math = staticmethod(lion_math)
    slots = ("exp_avg",)
    kernel_id = 2  # the ALGO == 2 branch of kernels/update.py
    torch_group_keys = None  # torch.optim has no Lion

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0,
        *,
        maximize: bool = False,
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
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
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
        check_betas(group["betas"])
        check_number("weight_decay value", group["weight_decay"])

    def hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], maximize=group["maximize"]
        )

    @staticmethod
    def ema_decays(hyper):
        return {"exp_avg": hyper["beta2"]}

    @staticmethod
    def kernel_scalars(hyper):
        lr, beta1, beta2 = hyper["lr"], hyper["beta1"], hyper["beta2"]
        return dict(
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            decay=1 - lr * hyper["weight_decay"],
            lerp_weight=1 - beta1,
            one_minus_beta2=1 - beta2,
            moment_decays=(beta2,),  # ema_decays in slot order
        )
