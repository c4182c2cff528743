"""fusedopt.Adafactor: factored second moment, optional compressed first moment, CAME and the Fira limiter.

Everything that defines the algorithm is here: the class, its fp32 math (the CPU path and the
oracle of the kernels in ``kernels/factored.py``), its state slots and their storage, its kernel
scalars and its torch.optim counterpart.

Unlike AdamW, the update of one element depends on the whole tensor: the second moment of a
tensor with two or more dimensions is factored into row and column statistics (means of g**2
over its last and second-to-last dimension), and the update is clipped by its own RMS. The
math below therefore works on whole tensors; the kernels reduce first and update after.

State of one parameter (keys as ``torch.optim.Adafactor``'s, plus the options'):

* ``row_var`` (shape ``[..., R, 1]``), ``col_var`` (``[..., 1, C]``): the factored second moment,
  exact fp32 whatever ``state_bits`` (``R + C`` values per matrix).
* ``variance``: the second moment of 0-d and 1-D parameters (element-wise, fp32 like every small
  tensor's moments).
* ``exp_avg`` (``beta1`` set): the first moment of the clipped update, in the ``state_bits`` format.
* ``exp_avg_res_row``, ``exp_avg_res_col`` (``beta3`` set, CAME): the factored confidence
  statistics, fp32.
* ``update_norm`` (``growth_limit`` set, Fira): the norm of the previous (limited) update, 0-d fp32.
"""

from __future__ import annotations

import math as _math

import torch

from .clipping import DEFAULT_CLIP_METHOD
from .codecs import MomentCodec, codec_for, register_codec
from .optimizer import FusedOptimizer, check_number, check_refused_options
from .release_notices import NOT_GIVEN

# --- storage of the statistics ------------------------------------------------------------------


def row_shape(shape: torch.Size) -> torch.Size:
    """Shape of the row statistic of a parameter of ``shape`` (its last dimension reduced)."""
    return torch.Size([*shape[:-1], 1]) if len(shape) else torch.Size([1])


def col_shape(shape: torch.Size) -> torch.Size:
    """Shape of the column statistic (its second-to-last dimension reduced)."""
    return torch.Size([*shape[:-2], 1, shape[-1]]) if len(shape) >= 2 else torch.Size([1, 1])


class StatisticCodec(MomentCodec):
    """An exact fp32 statistic whose shape follows from the parameter's (a row or column reduction,
    or a scalar). Not a state format a user selects: the algorithm picks it for its statistic slots."""

    state_bits = 32

    def __init__(self, name: str, shape_of):
        self.name, self._shape_of = name, shape_of

    def zeros(self, shape, device):
        return {"": torch.zeros(self._shape_of(torch.Size(shape)), dtype=torch.float32, device=device)}

    def decode(self, stored):
        return stored[""]

    def encode(self, x, bits):
        return {"": x.float()}

    def __repr__(self) -> str:
        return f"StatisticCodec({self.name!r})"


ROWS = StatisticCodec("fp32-rows", row_shape)
COLS = StatisticCodec("fp32-cols", col_shape)
SCALAR = StatisticCodec("fp32-scalar", lambda shape: torch.Size([]))
for _codec in (ROWS, COLS, SCALAR):
    register_codec(_codec.name, lambda signed, shape, codec=_codec: codec, selectable=False)

FACTORED_SLOTS = ("row_var", "col_var")
CAME_SLOTS = ("exp_avg_res_row", "exp_avg_res_col")
_STAT_CODECS = {
    "row_var": ROWS,
    "col_var": COLS,
    "exp_avg_res_row": ROWS,
    "exp_avg_res_col": COLS,
    "update_norm": SCALAR,
}


def factored(shape) -> bool:
    """Whether a parameter of ``shape`` keeps a factored second moment (two or more dimensions)."""
    return len(shape) >= 2


# --- the math -----------------------------------------------------------------------------------


def _at_least(x: torch.Tensor, low: float) -> torch.Tensor:
    """``max(low, x)`` as torch's Python ``max`` takes it: NaN gives ``low`` (eps1=0 can make a NaN RMS)."""
    return torch.where(x > low, x, low)


def _approx_var(row: torch.Tensor, col: torch.Tensor, eps1: float) -> torch.Tensor:
    """row @ col / max(mean of row over the rows, eps1): the rank-1 estimate of a factored moment."""
    return (row @ col) / row.mean(dim=-2, keepdim=True).clamp(min=eps1)


def step_scalars(step: torch.Tensor, *, lr: float, beta2_decay: float):
    """(1 - beta2_t, rho_t) for the new step count (0-d tensors): ``t**beta2_decay`` and
    ``min(lr, 1/sqrt(t))``, in fp64 as torch computes them from a Python float."""
    t = step.double().clamp(min=1.0)  # a skipped first update (t = 0) is discarded anyway
    return t.pow(beta2_decay), torch.clamp(t.rsqrt(), max=lr)


def adafactor_math(
    p,
    g,
    moments,
    step,
    *,
    lr,
    beta2_decay,
    eps1,
    eps2,
    d,
    weight_decay,
    beta1,
    beta3,
    came_eps,
    growth_limit,
):
    """One Adafactor update of a whole tensor, as ``torch.optim.Adafactor`` orders it, then the options.

    torch: ``alpha = max(eps2, RMS(p)) * min(lr, 1/sqrt(t))``; ``p *= 1 - lr * weight_decay``; the
    second moment (factored for 2+ dimensions) is a lerp towards g**2 with weight ``t**beta2_decay``;
    ``u = g / sqrt(max(v, eps1**2))``; ``u_hat = u / max(1, RMS(u) / d)``; ``p -= alpha * u_hat``.
    Options, in this order: Fira's limiter scales ``u_hat`` down to ``growth_limit`` times the previous
    update's norm; ``beta1`` replaces ``u_hat`` by its EMA ``m``; CAME (``beta3``, factored tensors)
    multiplies ``m`` by ``1/sqrt(S)``, S the factored EMA of ``(u_hat - m)**2 + came_eps``.
    """
    if g.numel() == 0:  # nothing to update; a mean over no rows or columns would make the statistics NaN
        return p, dict(moments)
    new = {}
    one_minus_beta2, rho = step_scalars(step, lr=lr, beta2_decay=beta2_decay)
    numel = g.numel()
    rms_p = p.norm().double() / _math.sqrt(numel)
    alpha = _at_least(rms_p, eps2) * rho
    if weight_decay != 0:
        p = p * (1 - lr * weight_decay)
    w = one_minus_beta2.float()
    if factored(g.shape):
        row = moments["row_var"].lerp(g.norm(dim=-1, keepdim=True).square() / g.shape[-1], w)
        col = moments["col_var"].lerp(g.norm(dim=-2, keepdim=True).square() / g.shape[-2], w)
        new["row_var"], new["col_var"] = row, col
        var = _approx_var(row, col, eps1)
    else:
        var = new["variance"] = moments["variance"].lerp(g * g, w)
    u = var.clamp(min=eps1 * eps1).rsqrt() * g
    rms_u = u.norm().double() / _math.sqrt(numel)
    denom = _at_least(rms_u / d, 1.0)  # RMS clipping: u_hat = u / denom
    if growth_limit is not None:  # Fira: ||u_hat|| at most growth_limit * the previous one
        norm = u.norm().double() / denom
        prev = moments["update_norm"].double()
        limit = growth_limit * prev
        limited = (prev > 0) & (norm > limit)
        denom = torch.where(limited, denom * (norm / limit), denom)
        new["update_norm"] = torch.where(limited, limit, norm).float()
    if beta1 is None:
        # p - (alpha / denom) * u with one fp32 coefficient, as torch's add_(u, alpha=-alpha / denom)
        return torch.addcmul(p, u, (-alpha / denom).float()), new
    u_hat = u * (1.0 / denom).float()
    m = new["exp_avg"] = moments["exp_avg"].lerp(u_hat, 1 - beta1)
    update = m
    if beta3 is not None and factored(g.shape):  # CAME: confidence of the momentum
        res = (u_hat - m).square() + came_eps
        res_row = moments["exp_avg_res_row"].lerp(res.mean(dim=-1, keepdim=True), 1 - beta3)
        res_col = moments["exp_avg_res_col"].lerp(res.mean(dim=-2, keepdim=True), 1 - beta3)
        new["exp_avg_res_row"], new["exp_avg_res_col"] = res_row, res_col
        update = m * (res_row @ res_col / res_row.mean(dim=-2, keepdim=True)).rsqrt()
    p = torch.addcmul(p, update, -alpha.float())
    return p, new


# --- the optimizer ------------------------------------------------------------------------------


def _check_torch(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_float(name: str, value, message: str, *, low=-_math.inf, high=_math.inf) -> None:
    """A finite float in ``[low, high]`` (torch's message otherwise)."""
    check_number(name, value, low=-_math.inf, message=message)
    _check_torch(low <= value <= high, message)


class Adafactor(FusedOptimizer):
    """Drop-in ``torch.optim.Adafactor`` (factored second moment, relative step size, RMS clipping).

    With fp32 parameters and ``beta1=None`` it is ``torch.optim.Adafactor`` (``eps1=None`` means
    fp32's machine epsilon: the update is computed on the fp32 master weight, also for bf16
    parameters). Options beyond torch's, keyword-only:

    * ``beta1``: keep a first moment (an EMA of the clipped update) in the ``state_bits`` format;
      None (default): no first moment, the leanest state (``R + C`` fp32 values per matrix).
    * ``beta3``: CAME's confidence-guided update (needs ``beta1``): the momentum is divided by the
      square root of a factored EMA of its squared deviation from the update (plus ``came_eps``).
    * ``growth_limit``: Fira's norm-growth limiter: the norm of the clipped update may grow by at
      most this factor per step (e.g. 1.01); None (default): off.

    ``state_bits`` applies to the first moment (and to element-wise second moments, which only
    0-d and 1-D parameters keep: always fp32); the factored statistics are fp32. See
    ``fusedopt.FusedOptimizer`` and the README for the other options.
    """

    algorithm = "adafactor"
    shardable = False  # row, column and update statistics of the whole tensor
    math = staticmethod(adafactor_math)
    slots = ("exp_avg", "row_var", "col_var", "variance", *CAME_SLOTS, "update_norm")
    nonnegative_slots = ("row_var", "col_var", "variance", *CAME_SLOTS, "update_norm")
    kernel = "factored"  # kernels/factored.py: reductions, then the update
    kernel_id = 0
    torch_group_keys = dict(foreach=None)
    torch_lacks = ("beta1", "beta3", "growth_limit")  # torch.optim.Adafactor would drop their state

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        beta1: float | None = None,
        beta3: float | None = None,
        came_eps: float = 1e-16,
        growth_limit: float | None = None,
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
        check_refused_options(foreach=foreach)
        defaults = dict(
            lr=lr,
            beta2_decay=beta2_decay,
            eps=eps,
            d=d,
            weight_decay=weight_decay,
            maximize=maximize,
            beta1=beta1,
            beta3=beta3,
            came_eps=came_eps,
            growth_limit=growth_limit,
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
        lr = group["lr"]
        _check_float("learning rate", lr, f"Learning rate should be >= 0 but is: {lr}", low=0.0)
        decay = group["beta2_decay"]
        _check_float("beta2_decay", decay, f"beta2_decay should be <= 0 but is: {decay}", high=0.0)
        eps = group["eps"]
        _check_torch(isinstance(eps, (tuple, list)) and len(eps) == 2, f"Invalid eps: {eps!r} (expected a pair)")
        if eps[0] is not None:
            _check_float("epsilon1", eps[0], f"epsilon1 should be >= 0 but is: {eps[0]}", low=0.0)
        _check_float("epsilon2", eps[1], f"epsilon2 should be >= 0 but is: {eps[1]}", low=0.0)
        d = group["d"]
        _check_float("d", d, f"Clipping threshold d should be >= 1 but is: {d}", low=1.0)
        wd = group["weight_decay"]
        _check_float("weight_decay", wd, f"weight_decay should be >= 0 but is: {wd}", low=0.0)
        for name in ("beta1", "beta3"):
            beta = group[name]
            if beta is not None:
                check_number(name, beta, high=1.0, message=f"Invalid {name}: {beta} (expected None or [0, 1))")
        if group["beta3"] is not None and group["beta1"] is None:
            raise ValueError("beta3 (CAME) needs a first moment: set beta1 as well")
        came_eps = group["came_eps"]
        check_number("came_eps", came_eps, message=f"Invalid came_eps: {came_eps} (expected >= 0)")
        limit = group["growth_limit"]
        if limit is not None:
            message = f"Invalid growth_limit: {limit} (expected None or a factor >= 1, e.g. 1.01)"
            check_number("growth_limit", limit, low=1.0, message=message)

    def state_slots(self, group):
        """Every slot the group may keep (``codecs`` picks those a parameter's shape needs)."""
        slots = ("exp_avg",) if group["beta1"] is not None else ()
        slots += ("row_var", "col_var", "variance")
        if group["beta3"] is not None:
            slots += CAME_SLOTS
        if group["growth_limit"] is not None:
            slots += ("update_norm",)
        return slots

    def codecs(self, p, group):
        """Slot -> codec for ``p``: the first moment in the group's format (slot 0: the one that draws
        random bits), the statistics exact (``StatisticCodec``) in the shapes ``p`` needs."""
        keep = factored(p.shape)
        out: dict[str, MomentCodec] = {}
        for slot in self.state_slots(group):
            if slot in FACTORED_SLOTS + CAME_SLOTS and not keep:
                continue
            if slot == "variance" and keep:
                continue
            if slot in _STAT_CODECS:
                out[slot] = _STAT_CODECS[slot]
            else:  # exp_avg, and the element-wise variance of small tensors (always fp32)
                bits, fmt, numel = group["state_bits"], group.get("state_format"), group["min_compress_numel"]
                signed = slot not in self.nonnegative_slots
                out[slot] = codec_for(bits, p.shape, numel, signed=signed, state_format=fmt)
        return out

    def hyper(self, group):
        eps1, eps2 = group["eps"]
        return dict(
            lr=group["lr"],
            beta2_decay=group["beta2_decay"],
            eps1=torch.finfo(torch.float32).eps if eps1 is None else eps1,
            eps2=eps2,
            d=group["d"],
            weight_decay=group["weight_decay"],
            beta1=group["beta1"],
            beta3=group["beta3"],
            came_eps=group["came_eps"],
            growth_limit=group["growth_limit"],
            maximize=group["maximize"],
        )

    @staticmethod
    def kernel_scalars(hyper):
        return {k: v for k, v in hyper.items() if k != "maximize"}
