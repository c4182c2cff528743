"""fusedopt.SGD: SGD with momentum, with compressed momentum and gradient release."""

from __future__ import annotations

from .optimizer import FusedOptimizer, check_number, check_refused_options
from .reference import sgd_math


class SGD(FusedOptimizer):
    """Drop-in ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay as torch).

    ``state_bits=32`` on fp32 parameters is exactly ``torch.optim.SGD``. With ``momentum=0``
    there is no state beyond the step count.
    """

    algorithm = "sgd"
    math = staticmethod(sgd_math)

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
        master_weight_bits: int | None = 24,
        min_compress_numel: int = 4096,
        seed: int = 0,
        fused: bool = False,
        accumulation_steps: int = 1,
    ):
        check_refused_options(foreach=foreach, differentiable=differentiable)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            maximize=maximize,
            state_bits=state_bits,
            master_weight_bits=master_weight_bits,
            min_compress_numel=min_compress_numel,
        )
        super().__init__(params, defaults, fused=fused, accumulation_steps=accumulation_steps, seed=seed)

    def _check_hyperparameters(self, group):
        check_number("learning rate", group["lr"])
        check_number("momentum value", group["momentum"])
        check_number("dampening value", group["dampening"])
        check_number("weight_decay value", group["weight_decay"])
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"Invalid nesterov: {group['nesterov']!r} (expected True or False)")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _slots(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _hyper(self, group):
        return {k: group[k] for k in ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize")}
