"""The planner of ``fusedopt.profile``: which optimizer configurations fit in a given memory.

The peak of a training step is modelled as ``bytes_per_param * num_params + activations``:

* ``bytes_per_param`` is what scales with the model: parameters, master-weight corrections,
  optimizer state and the gradients alive at the peak. It comes, in order of preference, from
  a profiler measurement of the same configuration and parameter dtype (``measured``), from
  the optimizer's own state layout built on meta tensors (``layout``: exact state bytes, no
  memory used), or from the byte model of DESIGN.md section 4 (``byte model``).
* ``activations`` is everything else at the peak (activations, loss-head buffers, temporaries).
  It is taken from a measurement of the same model and batch when there is one (``measured``),
  else estimated from the model shape (``estimate``), else left out (and the output says so).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

import fusedopt
from fusedopt.buckets import bucket_budget
from fusedopt.profile.competitors import lookup
from fusedopt.profile.configs import DEFAULT_CONFIGS, parse_config
from fusedopt.profile.memory import CORRECTION_KEY
from fusedopt.profile.models import ModelSpec, UserError, parse_dtype

GIB = 1 << 30
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
# DESIGN.md section 4: bytes per element of one stored moment, block scales included (approximate
# for 8 and 4 bits: one fp16 scale per 32 elements assumed).
MOMENT_BYTES = {32: 4.0, 16: 2.0, 8: 1.0 + 2 / 32, 4: 0.5 + 2 / 32}
CORRECTION_BYTES = {None: 0, 24: 1, 32: 2}
FUSEDOPT_DEFAULTS = {"state_bits": 8, "master_weight_bits": 24, "fused": False}


def moments_of(optimizer: str, kwargs: dict) -> int:
    """How many moment tensors the algorithm keeps per parameter."""
    algo = optimizer.split(".")[-1].lower()
    if algo in ("adamw", "adam"):
        return 2
    if algo == "lion":
        return 1
    if algo == "sgd":
        return 1 if kwargs.get("momentum", 0) else 0
    raise ValueError(f"no byte model for {optimizer}")


@dataclass
class PerParam:
    """Bytes per parameter: persistent (params + corrections + state) and gradients at the peak."""

    params: float
    corrections: float
    state: float
    grads_at_peak: float
    source: str

    @property
    def persistent(self) -> float:
        return self.params + self.corrections + self.state

    @property
    def at_peak(self) -> float:
        return self.persistent + self.grads_at_peak


def byte_model(optimizer: str, kwargs: dict, dtype: torch.dtype) -> PerParam:
    """DESIGN.md section 4, per parameter (small-tensor exceptions ignored)."""
    p = DTYPE_BYTES[dtype]
    fused = _releases(optimizer, kwargs) or bool(kwargs.get("release", False))  # or another library's release
    competitor = lookup(optimizer)
    if competitor is not None:  # its documented state layout (bf16 parameters)
        corrections = 0.0 if dtype == torch.float32 else competitor.correction_bytes
        return PerParam(p, corrections, competitor.state_bytes, 0.0 if fused else p, "state layout of the library")
    if optimizer.startswith("torch"):
        state = moments_of(optimizer, kwargs) * p  # torch keeps state in the parameter dtype
        corrections = 0.0
    else:
        options = {**FUSEDOPT_DEFAULTS, **kwargs}
        state = moments_of(optimizer, kwargs) * MOMENT_BYTES.get(options["state_bits"], 4.0)
        corrections = 0.0 if dtype == torch.float32 else CORRECTION_BYTES.get(options["master_weight_bits"], 0)
    return PerParam(p, corrections, state, 0.0 if fused else p, "byte model (DESIGN.md section 4)")


def _releases(optimizer: str, kwargs: dict) -> bool:
    """Whether a fusedopt configuration frees each gradient in backward: ``fused=True`` without
    accumulation (with it, the optimizer's buffers hold every gradient until the k-th backward)."""
    fused = optimizer.startswith("fusedopt") and bool(kwargs.get("fused", False))
    return fused and int(kwargs.get("accumulation_steps", 1)) <= 1


def held_gradients(config, num_params: int, dtype: torch.dtype) -> int:
    """Gradient bytes that fusedopt's release may hold at once to launch their updates in
    buckets: ``FUSEDOPT_BUCKET_MB`` (``fusedopt.buckets``), at most one full set."""
    if not _releases(config.optimizer, config.kwargs):
        return 0
    return min(bucket_budget(), num_params * DTYPE_BYTES[dtype])


def layout_model(optimizer: str, kwargs: dict, dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> PerParam | None:
    """Exact state bytes from a fusedopt optimizer built on meta tensors (None if unavailable)."""
    if not optimizer.startswith("fusedopt") or not shapes:
        return None
    cls = getattr(fusedopt, optimizer.split(".")[1])
    params = [torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype)) for s in shapes]
    options = {k: v for k, v in kwargs.items() if k not in ("fused", "accumulation_steps")}
    try:
        opt = cls(params, **options)
        for p in params:
            opt.ensure_state(p)
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return None
    corrections = state = 0
    for p in params:
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                nbytes = value.numel() * value.element_size()
                if key.startswith(CORRECTION_KEY):
                    corrections += nbytes
                else:
                    state += nbytes
    n = sum(math.prod(s) for s in shapes)
    p_bytes = DTYPE_BYTES[dtype]
    fused = _releases(optimizer, kwargs)
    return PerParam(p_bytes, corrections / n, state / n, 0.0 if fused else p_bytes, "layout (optimizer state on meta)")


def activation_estimate(
    shape, *, batch: int, seq_len: int, dtype: torch.dtype, checkpointing: bool = True
) -> int | None:
    """Rough bytes at the peak beyond weights, state and gradients for the embedded LM shape.

    Saved block inputs (checkpointing) or all block activations, one block's recomputation,
    and the loss head (logits in the model dtype, fp32 logits and their gradient).
    """
    if shape is None:
        return None
    s = DTYPE_BYTES[dtype]
    tokens = batch * seq_len
    per_block = tokens * (10 * shape.d_model + 3 * shape.ffn) * s + batch * shape.heads * seq_len * seq_len * s
    blocks = shape.layers * tokens * shape.d_model * s + per_block if checkpointing else shape.layers * per_block
    head = tokens * shape.vocab * (s + 8)
    return int(blocks + head)


@dataclass
class PlanRow:
    label: str
    per_param: PerParam
    persistent: int
    grads: int
    activations: int | None
    activation_source: str
    peak: int
    fits: bool | None
    note: str = ""


def measured_per_param(result: dict) -> PerParam | None:
    """Per-parameter costs from one profiler result (``ProfileReport.to_dict()['results'][i]``)."""
    if not result.get("ok"):
        return None
    n = result["num_params"]
    cats = result["memory"]["peak_breakdown"]["categories"]
    return PerParam(
        params=cats["parameters"] / n,
        corrections=cats["corrections"] / n,
        state=cats["optimizer_state"] / n,
        grads_at_peak=cats["gradients"] / n,
        source=f"measured ({result['device']}, {result['model']})",
    )


def plan_configs(
    num_params: int,
    memory_bytes: int,
    configs: list,
    *,
    dtype: torch.dtype,
    shapes: list[tuple[int, ...]] | None = None,
    model_shape=None,
    model_key: str | None = None,
    batch: int = 1,
    seq_len: int = 1024,
    checkpointing: bool = True,
    measurements: list[dict] | None = None,
    activations: int | None = None,
) -> list[PlanRow]:
    """One row per configuration: estimated peak and whether it fits in ``memory_bytes``.

    ``configs`` are ``OptimizerConfig``s. ``measurements`` are profiler results; one whose
    configuration label and parameter dtype match is used for the per-parameter costs, and its
    activation figure (activations + rest at the peak) when ``model_key``, batch and sequence
    length match too. ``activations`` (bytes) overrides every activation figure.
    """
    rows = []
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    for config in configs:
        param_dtype = config.param_dtype(dtype)  # fp32 under autocast, as the profiler trains it
        match = None
        for result in measurements or ():
            if result.get("ok") and result["label"] == config.label and result["dtype"] == names[param_dtype]:
                match = result
        per = measured_per_param(match) if match else None
        if per is None:
            per = layout_model(config.optimizer, config.kwargs, param_dtype, shapes or []) or byte_model(
                config.optimizer, config.kwargs, param_dtype
            )
        act, act_source = activations, "given"
        if act is None and match is not None:
            same = (
                match["model_key"] == model_key
                and match["batch"] == batch
                and match["seq_len"] == seq_len
                and model_key is not None
            )
            if same:
                cats = match["memory"]["peak_breakdown"]["categories"]
                act, act_source = cats["activations"] + cats["rest"], "measured"
        if act is None:
            act = activation_estimate(
                model_shape, batch=batch, seq_len=seq_len, dtype=dtype, checkpointing=checkpointing
            )
            act_source = "estimate" if act is not None else "not included"
        persistent = int(per.persistent * num_params)
        grads = int(per.grads_at_peak * num_params)
        if match is None:  # a measurement saw what release held; a model adds its bound
            grads += held_gradients(config, num_params, param_dtype)
        peak = persistent + grads + (act or 0)
        fits = peak <= memory_bytes if act is not None else (None if persistent + grads <= memory_bytes else False)
        rows.append(PlanRow(config.label, per, persistent, grads, act, act_source, peak, fits))
    return rows


def plan(
    num_params: int | None = None,
    memory_gib: float = 24.0,
    configs: list | None = None,
    *,
    model: ModelSpec | str | None = None,
    dtype: str = "bf16",
    batch: int = 1,
    seq_len: int = 1024,
    measurements: list[dict] | None = None,
    activations_gib: float | None = None,
):
    """Which configurations fit in ``memory_gib``; returns :class:`PlanRow`s."""
    spec = ModelSpec.from_args(model, None, None) if isinstance(model, str) else model
    if num_params is None:
        if spec is None:
            raise UserError("give a parameter count or a model")
        num_params = spec.num_params()
    configs = [parse_config(c) if isinstance(c, str) else c for c in (configs or DEFAULT_CONFIGS)]
    return plan_configs(
        int(num_params),
        int(memory_gib * GIB),
        configs,
        dtype=parse_dtype(dtype),
        shapes=spec.param_shapes() if spec is not None else None,
        model_shape=spec.model_shape() if spec is not None else None,
        model_key=json.dumps(spec.to_dict(), sort_keys=True) if spec is not None else None,
        batch=batch,
        seq_len=seq_len,
        checkpointing=spec.checkpointing if spec is not None else True,
        measurements=measurements,
        activations=int(activations_gib * GIB) if activations_gib is not None else None,
    )


def format_plan(rows: list[PlanRow], *, num_params: int, memory_bytes: int, header: str = "") -> str:
    gib = lambda b: f"{b / GIB:.2f}"
    lines = []
    if header:
        lines.append(header)
    lines.append(f"{num_params:,} parameters; memory {memory_bytes / GIB:.1f} GiB")
    width = max(len("config"), *(len(r.label) for r in rows))
    head = (
        f"{'config':<{width}}  {'B/param':>7}  {'persist GiB':>11}  {'grads GiB':>9}  {'activ GiB':>9}  "
        f"{'peak GiB':>8}  {'fits':>4}  source"
    )
    lines += [head, "-" * len(head)]
    for r in rows:
        fits = {True: "yes", False: "no", None: "?"}[r.fits]
        act = gib(r.activations) if r.activations is not None else "n/a"
        peak = gib(r.peak) + ("+" if r.activations is None else "")
        lines.append(
            f"{r.label:<{width}}  {r.per_param.at_peak:>7.2f}  {gib(r.persistent):>11}  {gib(r.grads):>9}  "
            f"{act:>9}  {peak:>8}  {fits:>4}  per-param: {r.per_param.source}; activations: {r.activation_source}"
        )
    if any(r.activations is None for r in rows):
        lines.append(
            "activations not included ('+'): give --model/--shape/--hf-config, --activations, or a measurement"
        )
    lines.append(
        "B/param = parameters + corrections + optimizer state + gradients alive at the peak, per parameter; "
        "peak = B/param x parameters + activations"
    )
    return "\n".join(lines)
