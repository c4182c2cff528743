"""signSGD with momentum (test only): ``m = beta * m + (1 - beta) * g``, ``p -= lr * sign(m)``.
No kernel branch (``kernel_id = None``): the reference runs it, ``FUSEDOPT_BACKEND=triton`` refuses."""

from __future__ import annotations

from fusedopt.optimizer import FusedOptimizer, check_number


def sign_sgd_math(p, g, moments, step, *, lr, beta):
    m = moments["momentum"] * beta + g * (1 - beta)
    return p - lr * m.sign(), {"momentum": m}


class SignSGD(FusedOptimizer):
    algorithm = "test-sign-sgd"
    math = staticmethod(sign_sgd_math)
    slots = ("momentum",)

    def __init__(self, params, lr=1e-3, beta=0.9, *, maximize=False, **options):
        defaults = dict(lr=lr, beta=beta, maximize=maximize)
        defaults.update(
            state_bits=options.pop("state_bits", 8),
            state_format=options.pop("state_format", None),
            master_weight_bits=options.pop("master_weight_bits", 24),
            min_compress_numel=options.pop("min_compress_numel", 4096),
        )
        super().__init__(params, defaults, **{"fused": False, "accumulation_steps": 1, "seed": 0, **options})

    def check_hyperparameters(self, group):
        check_number("learning rate", group["lr"])
        check_number("beta", group["beta"], high=1.0)

    def hyper(self, group):
        return dict(lr=group["lr"], beta=group["beta"], maximize=group["maximize"])
