"""fusedopt.AdamW: AdamW with compressed state, master-weight splitting and gradient release."""

from __future__ import annotations

from .optimizer import FusedOptimizer, check_betas, check_number, check_refused_options
from .reference import adamw_math


class AdamW(FusedOptimizer):
    """Drop-in ``torch.optim.AdamW`` (decoupled weight decay, bias correction, eps outside the sqrt).

    ``state_bits=32`` on fp32 parameters is exactly ``torch.optim.AdamW``. Memory per parameter
    for the state: 8 bytes at ``state_bits=32`` (two fp32 moments), 4 at ``16`` (two bf16 moments).
    See ``fusedopt.FusedOptimizer`` and the README for ``state_bits``, ``master_weight_bits``,
    ``min_compress_numel``, ``seed``, ``fused`` and ``accumulation_steps``.
    """

    algorithm = "adamw"
    math = staticmethod(adamw_math)

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
        master_weight_bits: int | None = 24,
        min_compress_numel: int = 4096,
        seed: int = 0,
        fused: bool = False,
        accumulation_steps: int = 1,
    ):
        check_refused_options(amsgrad=amsgrad, foreach=foreach, capturable=capturable, differentiable=differentiable)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            state_bits=state_bits,
            master_weight_bits=master_weight_bits,
            min_compress_numel=min_compress_numel,
        )
        super().__init__(params, defaults, fused=fused, accumulation_steps=accumulation_steps, seed=seed)

    def _check_hyperparameters(self, group):
        check_number("learning rate", group["lr"])
        check_number("epsilon value", group["eps"])
        check_betas(group["betas"])
        check_number("weight_decay value", group["weight_decay"])

    def _slots(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
        )
