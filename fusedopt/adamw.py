"""fusedopt.AdamW: AdamW with compressed state, master-weight splitting and gradient release.

Everything that defines the algorithm is here: the class, its fp32 math (the reference the kernel
is held to), its state slots, its kernel branch and scalars, and its torch.optim counterpart.
"""

from __future__ import annotations

import torch

from .clipping import DEFAULT_CLIP_METHOD
from .optimizer import FusedOptimizer, check_betas, check_number, check_refused_options
from .release_notices import NOT_GIVEN


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def adamw_math(p, g, moments, step, *, lr, beta1, beta2, eps, weight_decay):
    """AdamW as ``torch.optim.AdamW`` orders its operations (decoupled decay, eps outside sqrt), but for one
    rounding: ``sqrt(v)`` is multiplied by ``1/sqrt(bias correction)`` where torch divides by its root (the
    kernel's multiply), so the two agree to fp32 round-off, not bit for bit."""
    # Bias corrections in fp64 (torch computes them from a Python step); the step size from lr
    # rounded to fp32, as the Triton kernel receives it.
    step = step.double()
    step_size = (_fp32(lr) / (1 - beta1**step)).float()
    inv_bias_correction2_sqrt = (1 / (1 - beta2**step).sqrt()).float()
    m = moments["exp_avg"].lerp(g, 1 - beta1)
    v = torch.addcmul(moments["exp_avg_sq"] * beta2, g, g, value=1 - beta2)
    p = p * (1 - lr * weight_decay)
    # torch's vectorised CPU sqrt is not correctly rounded; the fp64 one is, like the kernel's sqrt_rn
    denom = v.double().sqrt().float() * inv_bias_correction2_sqrt + eps
    p = p - (m / denom) * step_size
    return p, {"exp_avg": m, "exp_avg_sq": v}


class AdamW(FusedOptimizer):
    """Drop-in ``torch.optim.AdamW`` (decoupled weight decay, bias correction, eps outside the sqrt).

    ``state_bits=32`` on fp32 parameters is ``torch.optim.AdamW`` to fp32 round-off. Memory per parameter
    for the state: 8 bytes at ``state_bits=32`` (two fp32 moments), 4 at ``16`` (two bf16 moments).
    See ``fusedopt.FusedOptimizer`` and the README for ``state_bits``, ``state_format``,
    ``master_weight_bits``, ``min_compress_numel``, ``seed``, ``fused`` and ``accumulation_steps``.
    """

    algorithm = "adamw"
    math = staticmethod(adamw_math)
    slots = ("exp_avg", "exp_avg_sq")
    nonnegative_slots = ("exp_avg_sq",)
    frames = {"exp_avg": "exp_avg_sq"}  # m / sqrt(v) is the update's own unit (a framed format's)
    kernel_id = 0  # the ALGO == 0 branch of kernels/update.py
    bias_corrections = True  # the check kernel computes them per step
    torch_group_keys = dict(amsgrad=False, foreach=None, capturable=False, differentiable=False, fused=None)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
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
        check_refused_options(amsgrad=amsgrad, foreach=foreach, capturable=capturable, differentiable=differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
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
        check_number("epsilon value", group["eps"])
        check_betas(group["betas"])
        check_number("weight_decay value", group["weight_decay"])

    def hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
        )

    @staticmethod
    def ema_decays(hyper):
        return {"exp_avg": hyper["beta1"], "exp_avg_sq": hyper["beta2"]}

    @staticmethod
    def kernel_scalars(hyper):
        lr, beta1, beta2 = hyper["lr"], hyper["beta1"], hyper["beta2"]
        return dict(
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=hyper["eps"],
            decay=1 - lr * hyper["weight_decay"],
            lerp_weight=1 - beta1,
            one_minus_beta2=1 - beta2,
            bias_correction_betas=(beta1, beta2),
            moment_decays=(beta1, beta2),  # ema_decays in slot order
        )
