"""fusedopt.Lion: Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023)."""

from __future__ import annotations

from .optimizer import FusedOptimizer, check_betas, check_number
from .reference import lion_math


class Lion(FusedOptimizer):
    """Lion: ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``, then ``m = beta2 * m + (1 - beta2) * g``.

    Weight decay is decoupled: ``p *= 1 - lr * weight_decay`` before the signed step. One
    moment: 4 bytes per parameter at ``state_bits=32``, 2 at ``16``.
    """

    algorithm = "lion"
    math = staticmethod(lion_math)

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0,
        *,
        maximize: bool = False,
        state_bits: int = 8,
        master_weight_bits: int | None = 24,
        min_compress_numel: int = 4096,
        seed: int = 0,
        fused: bool = False,
        accumulation_steps: int = 1,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            maximize=maximize,
            state_bits=state_bits,
            master_weight_bits=master_weight_bits,
            min_compress_numel=min_compress_numel,
        )
        super().__init__(params, defaults, fused=fused, accumulation_steps=accumulation_steps, seed=seed)

    def _check_hyperparameters(self, group):
        check_number("learning rate", group["lr"])
        check_betas(group["betas"])
        check_number("weight_decay value", group["weight_decay"])

    def _slots(self, group):
        return ("exp_avg",)

    def _hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], maximize=group["maximize"]
        )
