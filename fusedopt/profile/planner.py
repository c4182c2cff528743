"""The planner of ``fusedopt.profile``: which optimizer configurations fit in a given memory.

The peak of a training step is modelled as ``bytes_per_param * num_params + activations``:

* ``bytes_per_param`` is what scales with the model: parameters, master-weight corrections,
  optimizer state and the gradients alive at the peak. It comes, in order of preference, from
  a profiler measurement of the same configuration and parameter dtype (``measured``), from
  the optimizer's own state layout built on meta tensors (``layout``: exact state bytes, no
  memory used), or from fusedopt's byte model (``byte model``: of a large matrix, the stored bytes
  per element of each moment's codec, ``MomentCodec.bytes_per_element``, and of the master-weight
  correction, ``fusedopt.master.correction_layout``; options not given take the constructor's defaults).
* ``activations`` is everything else at the peak (activations, loss-head buffers, temporaries).
  It is taken from a measurement of the same model and batch when there is one (``measured``),
  else estimated from the model shape (``estimate``; with a bare parameter count, the shape of
  the preset nearest in size; a Llama-style Hugging Face config gives its shape), else left out
  (and the output says why, and ranks the formats on their other bytes). The estimate's loss head
  is the full logits, or one chunk of them with the chunked loss (``fusedopt.chunked_cross_entropy``).

:func:`recommend` evaluates fusedopt AdamW's formats (:data:`CANDIDATE_FORMATS`: the ``state_bits``
formats and the paired ``state_format="norm2-root4"``, each with its master-weight options, with and
without ``fused=True``) and picks the first that fits from the default down: below the default, the
paired format before the 4-bit block format, which needs more memory and measured worse. Each row
carries its quality, the held-out loss against fp32 AdamW of the paired-seed benchmark
(:data:`QUALITY`). Where the activations are estimated, each format is also evaluated with the chunked
loss after the full logits (the same loss, without the ``[tokens, vocab]`` logits; it needs the training
loop to call ``fusedopt.chunked_cross_entropy``), so the output says whether a format fits with the full
logits, with the chunked loss, or with neither.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import math
import types
from dataclasses import dataclass

import torch

import fusedopt
from fusedopt.adafactor import StatisticCodec
from fusedopt.codecs import STATE_BITS_FORMATS, SUPPORTED_STATE_BITS, MomentCodec, codec_for
from fusedopt.dispatch import bucket_budget
from fusedopt.losses import default_chunk_size
from fusedopt.master import MASTER_CORRECTION, correction_layout
from fusedopt.profile.competitors import lookup
from fusedopt.profile.configs import DEFAULT_CONFIGS, parse_config
from fusedopt.profile.models import PRESETS, ModelSpec, UserError, parse_dtype

GIB = 1 << 30
# The byte model's matrix: large enough that what does not scale with the parameter (a block's
# padding, Adafactor's row and column statistics, the fp32 moments of small tensors) is left out.
_LARGE = torch.Size([4096, 4096])


def _algorithm(optimizer: str):
    cls = {
        "adamw": fusedopt.AdamW,
        "adam": fusedopt.AdamW,
        "lion": fusedopt.Lion,
        "sgd": fusedopt.SGD,
        "adafactor": fusedopt.Adafactor,
    }.get(optimizer.split(".")[-1].lower())
    if cls is None:
        raise ValueError(f"no byte model for {optimizer}")
    return cls


@functools.cache
def constructor_defaults(cls) -> types.MappingProxyType:
    """The keyword defaults of an optimizer class's constructor: what an option not given is."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return types.MappingProxyType({p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty})


def options_of(optimizer: str, kwargs: dict) -> dict:
    """A fusedopt configuration's options: ``kwargs`` over its constructor's defaults."""
    return {**constructor_defaults(_algorithm(optimizer)), **kwargs}


# Bytes per element of one moment of a large matrix, by state_bits (the codec it selects).
MOMENT_BYTES = {bits: codec_for(bits, _LARGE, 0).bytes_per_element(_LARGE) for bits in SUPPORTED_STATE_BITS}


def correction_bytes(master_weight_bits, dtype: torch.dtype) -> float:
    """Bytes per element of the master-weight correction kept beside a parameter of ``dtype``
    (none for fp32 parameters or ``master_weight_bits=None``)."""
    layout = correction_layout(torch.empty(_LARGE, dtype=dtype, device="meta"), master_weight_bits)
    return sum(d.itemsize * shape.numel() for d, shape in layout.values()) / _LARGE.numel()


# torch.optim options that fusedopt's algorithms refuse or own differently (release): not passed on
# when a torch optimizer's moments are counted through fusedopt's counterpart.
_TORCH_ONLY_OPTIONS = ("fused", "foreach", "capturable", "differentiable", "amsgrad", "accumulation_steps")


def moments_of(optimizer: str, kwargs: dict) -> int:
    """How many parameter-sized moment tensors the algorithm keeps per parameter (Adafactor's factored
    second moment, R + C values per R x C matrix, counts as none). A torch optimizer keeps those of
    fusedopt's counterpart with the same hyperparameters."""
    if not optimizer.startswith("fusedopt"):
        names = constructor_defaults(_algorithm(optimizer))
        kwargs = {k: v for k, v in kwargs.items() if k in names and k not in _TORCH_ONLY_OPTIONS}
    return len(_moment_codecs(optimizer, kwargs))


def _moment_codecs(optimizer: str, kwargs: dict) -> dict[str, MomentCodec]:
    """Slot -> codec of the parameter-sized moments a fusedopt optimizer built with ``kwargs`` keeps
    for a large matrix (its ``codecs``; Adafactor's factored statistics left out)."""
    cls = _algorithm(optimizer)
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("fused", "accumulation_steps")))
    try:
        codecs = _large_matrix_codecs(cls, options)
    except TypeError:  # an option value that cannot be a cache key: build without the cache
        codecs = _large_matrix_codecs.__wrapped__(cls, options)
    return {slot: c for slot, c in codecs.items() if not isinstance(c, StatisticCodec)}


@functools.lru_cache(maxsize=256)
def _large_matrix_codecs(cls, options: tuple) -> dict[str, MomentCodec]:
    """``cls``'s codecs for a large matrix, from an optimizer built with ``options`` on a meta tensor."""
    p = torch.nn.Parameter(torch.empty(_LARGE, device="meta", dtype=torch.bfloat16))
    opt = cls([p], **dict(options))
    return opt.codecs(p, opt.param_groups[0])


def state_bytes(optimizer: str, kwargs: dict) -> float:
    """Bytes per parameter of a fusedopt algorithm's parameter-sized moments in their stored formats."""
    return sum(c.bytes_per_element(_LARGE) for c in _moment_codecs(optimizer, kwargs).values())


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
    """Bytes per parameter from the byte model: the parameter, its correction, its moments in their
    stored format and its gradient unless released in backward (small-tensor exceptions ignored)."""
    p = dtype.itemsize
    fused = _releases(optimizer, kwargs) or bool(kwargs.get("release", False))  # or another library's release
    competitor = lookup(optimizer)
    if competitor is not None:  # its documented state layout (bf16 parameters)
        corrections = 0.0 if dtype == torch.float32 else competitor.correction_bytes
        return PerParam(p, corrections, competitor.state_bytes, 0.0 if fused else p, "state layout of the library")
    if optimizer.startswith("torch"):
        state = moments_of(optimizer, kwargs) * p  # torch keeps state in the parameter dtype
        corrections = 0.0
    else:
        state = state_bytes(optimizer, kwargs)
        corrections = correction_bytes(options_of(optimizer, kwargs)["master_weight_bits"], dtype)
    return PerParam(p, corrections, state, 0.0 if fused else p, "byte model")


def _releases(optimizer: str, kwargs: dict) -> bool:
    """Whether a fusedopt configuration frees each gradient in backward: ``fused=True`` without
    accumulation (with it, the optimizer's buffers hold every gradient until the k-th backward)."""
    if not optimizer.startswith("fusedopt"):
        return False
    options = options_of(optimizer, kwargs)
    return bool(options["fused"]) and int(options["accumulation_steps"]) <= 1


def held_gradients(config, num_params: int, dtype: torch.dtype, largest: int = 0) -> int:
    """Gradient bytes that fusedopt's release may hold at once: below ``FUSEDOPT_BUCKET_MB``
    (``fusedopt.dispatch``) held for a bucketed update, plus the gradient that reaches the budget,
    which exists whole before its hook frees it (at most the ``largest`` parameter's, in elements);
    at most one full set."""
    if not _releases(config.optimizer, config.kwargs):
        return 0
    return min(bucket_budget() + largest * dtype.itemsize, num_params * dtype.itemsize)


def layout_model(optimizer: str, kwargs: dict, dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> PerParam | None:
    """Exact state bytes from a fusedopt optimizer built on meta tensors (None if unavailable)."""
    if not optimizer.startswith("fusedopt") or not shapes:
        return None
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("fused", "accumulation_steps")))
    counts = collections.Counter(tuple(s) for s in shapes)
    try:
        found = _state_bytes(optimizer, options, dtype, tuple(sorted(counts)))
    except TypeError:  # an option value that cannot be a cache key: build without the cache
        found = _state_bytes.__wrapped__(optimizer, options, dtype, tuple(sorted(counts)))
    if found is None:
        return None
    corrections = sum(found[s][0] * c for s, c in counts.items())
    state = sum(found[s][1] * c for s, c in counts.items())
    n = sum(math.prod(s) * c for s, c in counts.items())
    p_bytes = dtype.itemsize
    fused = _releases(optimizer, kwargs)
    return PerParam(p_bytes, corrections / n, state / n, 0.0 if fused else p_bytes, "layout (optimizer state on meta)")


@functools.lru_cache(maxsize=256)
def _state_bytes(optimizer: str, options: tuple, dtype: torch.dtype, shapes: tuple) -> dict | None:
    """shape -> (correction bytes, other state bytes) of one parameter of that shape. A parameter's
    state depends on its own shape only, so each distinct shape is built once (meta tensors are slow)."""
    cls = getattr(fusedopt, optimizer.split(".")[1])
    params = [torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype)) for s in shapes]
    try:
        opt = cls(params, **dict(options))
        for p in params:
            opt.ensure_state(p)
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return None
    found = {}
    for shape, p in zip(shapes, params):
        corrections = state = 0
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                nbytes = value.numel() * value.element_size()
                if key.startswith(MASTER_CORRECTION):
                    corrections += nbytes
                else:
                    state += nbytes
        found[shape] = (corrections, state)
    return found


def activation_estimate(
    shape, *, batch: int, seq_len: int, dtype: torch.dtype, checkpointing: bool = True, chunked_loss: int | None = None
) -> int | None:
    """Rough bytes at the peak beyond weights, state and gradients for the embedded LM shape.

    Saved block inputs (checkpointing) or all block activations, one block's recomputation,
    and the loss head: :func:`loss_head_bytes`.
    """
    if shape is None:
        return None
    s = dtype.itemsize
    tokens = batch * seq_len
    per_block = tokens * (10 * shape.d_model + 3 * shape.ffn) * s + batch * shape.heads * seq_len * seq_len * s
    blocks = shape.layers * tokens * shape.d_model * s + per_block if checkpointing else shape.layers * per_block
    return int(blocks + loss_head_bytes(shape.vocab, tokens, chunked_loss))


def loss_head_bytes(vocab: int, tokens: int, chunked_loss: int | None = None) -> int:
    """Bytes of the loss head at its peak. The full logits: 12 per token and vocabulary entry, three fp32
    ``[tokens, vocab]`` tensors in the cross-entropy's backward (the saved log-probabilities, their
    gradient and the logits' gradient; the logits in the model dtype and their fp32 copy, in forward,
    hold less). The chunked loss (``fusedopt.chunked_cross_entropy``, ``chunked_loss`` tokens per
    chunk): 8 per element of one chunk, two fp32 copies of the chunk's logits (its log-sum-exp's
    input and temporary; the logits in the model dtype beside one fp32 copy hold at most as much).
    The same for fp32, bf16 and fp16 logits; measured with the CPU allocator in tests/test_losses.py.
    """
    if chunked_loss is None:
        return tokens * vocab * 12
    return min(chunked_loss, tokens) * vocab * 8


# Quality of fusedopt AdamW's formats on bf16 parameters, (state format, master_weight_bits) -> held-out
# loss against fp32 AdamW, mean over paired seeds (benchmarks/quality.py, lr 1.5e-3 on the H200:
# benchmarks/RESULTS.md, "Training quality"). The state format is a state_bits value or a
# state_format name (see format_of); a format missing here was not measured on that benchmark.
QUALITY = {
    (32, 32): "+0.00% (fp32 AdamW's update: the reference)",
    (8, 24): "-0.03% (sd 0.09, 6 seeds)",
    # measured with the half-range cap at 2.0 against the default, not fp32 AdamW, over an lr sweep
    ("norm2-root4", None): "vs the default: +0.27% at lr 2.5e-4, -0.03% at 5e-4, better above (4 seeds)",
    (4, 24): "+0.36% (sd 0.27, 6 seeds)",
    (4, None): "+0.48% (sd 0.48, 6 seeds)",
}
NOT_MEASURED = "not measured"
QUALITY_SOURCE = "quality: held-out loss against fp32 AdamW, mean over paired seeds, benchmarks/quality.py"
# Candidate formats, (state format, master_weight_bits), in order of preference: more state bits, then more
# master bits (32, 24, no correction); below the default's formats the paired norm2-root4, which stores both
# moments in less memory than block4 and measured better, then block4.
CANDIDATE_FORMATS = (
    *((bits, master) for bits in (32, 16, 8) for master in (32, 24, None)),
    ("norm2-root4", 24),
    ("norm2-root4", None),
    (4, 24),
    (4, None),
)
# The options that make a fusedopt configuration its own format, as the rows describe it.
_FORMAT_OPTIONS = ("state_bits", "state_format", "master_weight_bits", "fused")
# What a format costs besides memory, said in its rows.
FORMAT_CAVEATS = {"norm2-root4": "slower optimizer step"}
_BITS_OF_FORMAT = {name: bits for bits, name in STATE_BITS_FORMATS.items()}


def format_of(config) -> tuple:
    """(state format, master_weight_bits) of a fusedopt configuration, the key of :data:`QUALITY` and
    :data:`CANDIDATE_FORMATS`: its ``state_format`` when set (it wins over ``state_bits``, as in the
    optimizers; a format that a ``state_bits`` value selects is named by that value), else ``state_bits``."""
    options = options_of(config.optimizer, config.kwargs)
    name = options["state_format"]
    state = options["state_bits"] if name is None else _BITS_OF_FORMAT.get(name, name)
    return state, options["master_weight_bits"]


DEFAULT_FORMAT = format_of(parse_config("fusedopt.AdamW"))  # the constructor's defaults


# The rows the planner shows besides its recommendation: torch.optim.AdamW as people run it and fusedopt's
# default without and with gradient release.
BASELINE_CONFIGS = ("torch.AdamW:autocast='bf16'", "torch.AdamW", "fusedopt.AdamW", "fusedopt.AdamW:fused=True")


# What a row with the chunked loss adds to its description.
CHUNKED_LOSS_TAG = ", chunked loss"
VOCAB_PIECES_TAG = ", vocabulary in {} pieces"
# The pieces the planner tries when nothing fits with the chunked loss (measured on the H200 for
# Llama-3-8B: benchmarks/RESULTS.md, "Llama-3-8B on 24 GB").
VOCAB_PIECES = 8
# What a row without an activation figure says, and how to give one.
NOT_INCLUDED = "not included"
ACTIVATIONS_HINT = (
    "give --activations GIB, a measurement of this model, batch and sequence length (--results), or a shape "
    "the estimate knows (--model, --shape, or a Llama-style --hf-config)"
)


def _bits(value) -> str:
    return "no correction" if value is None else f"{value}-bit master"


def describe(config, dtype: torch.dtype) -> str:
    """What a configuration is, in words: the parameter dtype it trains in and its state format."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    kwargs = config.kwargs
    if config.optimizer == "torch.AdamW":
        if config.autocast:
            what = f"torch AdamW, fp32 master + {config.autocast} autocast"
        else:
            what = f"torch AdamW, pure {names[dtype]}" if dtype != torch.float32 else "torch AdamW, fp32"
        return what + (", step in backward" if kwargs.get("release") else "")
    if config.optimizer == "fusedopt.AdamW":
        options = options_of(config.optimizer, kwargs)
        state_format = options["state_format"]  # wins over state_bits, as in the optimizer
        parts = [f"{state_format} state" if state_format is not None else f"{options['state_bits']}-bit state"]
        if config.param_dtype(dtype) != torch.float32:
            parts.append(_bits(options["master_weight_bits"]))
        if options["fused"]:
            parts.append("fused=True")
        if state_format in FORMAT_CAVEATS:
            parts.append(FORMAT_CAVEATS[state_format])
        defaults = constructor_defaults(fusedopt.AdamW)
        default = all(options[k] == defaults[k] for k in _FORMAT_OPTIONS)
        return "fusedopt AdamW, " + ", ".join(parts) + (" (default)" if default else "")
    return config.label


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
    config: object = None  # the OptimizerConfig
    description: str = ""  # describe(config, dtype)
    margin: int = 0  # memory minus peak, bytes (negative: does not fit)
    quality: str = ""  # QUALITY's figure, or NOT_MEASURED
    chunked_loss: int | None = None  # tokens per chunk of fusedopt.chunked_cross_entropy; None: the full logits
    vocab_pieces: int | None = None  # the embedding and head in that many row pieces (fusedopt.split_rows)


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
    activation_source: str = "estimate",
    why_no_estimate: str = "",
    chunked_loss: int | None = None,
    vocab_pieces: int | None = None,
) -> list[PlanRow]:
    """One row per configuration: estimated peak and whether it fits in ``memory_bytes``.

    ``configs`` are ``OptimizerConfig``s. ``measurements`` are profiler results; one whose
    configuration label and parameter dtype match is used for the per-parameter costs, and its
    activation figure (activations + rest at the peak) when ``model_key``, batch and sequence
    length match too; one of another dtype is not used, and the row's ``note`` says so.
    ``activations`` (bytes) overrides every activation figure. Without a figure, a row's
    ``activation_source`` is ``"not included"`` and ``why_no_estimate`` when given. ``chunked_loss``:
    the estimate's loss head is one chunk of that many tokens (``None``: the full logits).
    ``vocab_pieces``: ``shapes`` hold the embedding and head as that many row pieces (a row says so).
    """
    rows = []
    if shapes:
        largest = max(math.prod(s) for s in shapes)
    else:
        largest = max(math.prod(s) for s in model_shape.param_shapes()) if model_shape is not None else 0
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    for config in configs:
        param_dtype = config.param_dtype(dtype)  # fp32 under autocast, as the profiler trains it
        match, other_dtypes, notes = None, set(), []
        for result in measurements or ():
            if result.get("ok") and result["label"] == config.label:
                if result["dtype"] == names[param_dtype]:
                    match = result
                else:
                    other_dtypes.add(result["dtype"])
        if match is None and other_dtypes:
            notes.append(
                f"--results measured it with {'/'.join(sorted(other_dtypes))} parameters, this plan is for "
                f"{names[param_dtype]}: not used"
            )
        per = measured_per_param(match) if match else None
        if per is not None and (match["device"] == "cpu" or match["num_params"] * 10 < num_params):
            notes.append(
                f"measured on {match['device']} with {match['num_params']:,} parameters, scaled to {num_params:,}: "
                "a rough guide (CPU runs the reference update; small models' fixed costs scale), "
                "measure at size on the GPU"
            )
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
                model_shape,
                batch=batch,
                seq_len=seq_len,
                dtype=dtype,
                checkpointing=checkpointing,
                chunked_loss=chunked_loss,
            )
            if act is not None:
                act_source = activation_source
            else:
                act_source = NOT_INCLUDED + (f": {why_no_estimate}" if why_no_estimate else "")
        persistent = int(per.persistent * num_params)
        grads = int(per.grads_at_peak * num_params)
        if match is None:  # a measurement saw what release held; a model adds its bound
            grads += held_gradients(config, num_params, param_dtype, largest)
        peak = persistent + grads + (act or 0)
        fits = peak <= memory_bytes if act is not None else (None if persistent + grads <= memory_bytes else False)
        rows.append(
            PlanRow(
                config.label,
                per,
                persistent,
                grads,
                act,
                act_source,
                peak,
                fits,
                note="; ".join(notes),
                config=config,
                description=describe(config, dtype)
                + (CHUNKED_LOSS_TAG if chunked_loss is not None else "")
                + (VOCAB_PIECES_TAG.format(vocab_pieces) if vocab_pieces else ""),
                margin=memory_bytes - peak,
                quality=_quality(config, param_dtype),
                chunked_loss=chunked_loss,
                vocab_pieces=vocab_pieces,
            )
        )
    return rows


def _quality(config, param_dtype: torch.dtype) -> str:
    if config.optimizer == "torch.AdamW" and config.autocast:
        return "the reference (fp32 AdamW)"
    if config.optimizer != "fusedopt.AdamW" or param_dtype != torch.bfloat16:
        return NOT_MEASURED
    return QUALITY.get(format_of(config), NOT_MEASURED)


def candidate_configs(dtype: torch.dtype) -> list:
    """fusedopt AdamW's formats (:data:`CANDIDATE_FORMATS`) in order of preference, each without and with
    ``fused=True`` (same update, gradients released in backward; without it the step is faster at small
    micro-batches). fp32 parameters need no correction: their formats without one only."""
    configs = []
    for state, master in CANDIDATE_FORMATS:
        if dtype == torch.float32 and master is not None:
            continue
        option = f"state_format={state!r}" if isinstance(state, str) else f"state_bits={state}"
        for fused in (False, True):
            text = f"fusedopt.AdamW:{option},master_weight_bits={master}"
            configs.append(parse_config(text + (",fused=True" if fused else "")))
    return configs


def nearest_preset(num_params: int) -> str:
    """The preset whose parameter count is nearest ``num_params`` (by ratio)."""
    return min(PRESETS, key=lambda k: abs(math.log(PRESETS[k].num_params() / num_params)))


def _inputs(num_params, model, dtype, batch, seq_len, activations_gib, chunked_loss=None, vocab_pieces=None):
    """The planner's common inputs: (num_params, keyword arguments of :func:`plan_configs`).
    ``chunked_loss`` (tokens per chunk, ``0``: the default chunk) overrides the model's loss, and
    ``vocab_pieces`` its embedding and head."""
    spec = ModelSpec.from_args(model, None, None) if isinstance(model, str) else model
    if spec is not None and chunked_loss is not None:
        spec = spec.with_chunked_loss(chunked_loss)
    if vocab_pieces is not None:
        if spec is None:
            raise UserError("--vocab-pieces needs a model (--model, --shape or --hf-config)")
        spec = spec.with_vocab_pieces(vocab_pieces)
    if num_params is None:
        if spec is None:
            raise UserError("give a parameter count or a model")
        num_params = spec.num_params()
    num_params = int(num_params)
    if num_params < 1:
        raise UserError(f"impossible parameter count: {num_params}")
    why_no_estimate = ""
    if spec is not None:
        shape, caveat = spec.activation_shape()
        source = f"estimate ({caveat})" if shape is not None and caveat else "estimate"
        if shape is None:
            why_no_estimate = caveat
    else:
        preset = nearest_preset(num_params)
        shape = PRESETS[preset]
        source = f"estimate for the {preset} preset's shape ({PRESETS[preset].num_params():,} params)"
    if spec is not None:
        chunked_loss = spec.chunked_loss
    elif chunked_loss == 0:
        chunked_loss = default_chunk_size(shape.vocab)
    kwargs = dict(
        dtype=parse_dtype(dtype),
        shapes=spec.param_shapes() if spec is not None else None,
        model_shape=shape,
        model_key=json.dumps(spec.to_dict(), sort_keys=True) if spec is not None else None,
        batch=batch,
        seq_len=seq_len,
        checkpointing=spec.checkpointing if spec is not None else True,
        activations=int(activations_gib * GIB) if activations_gib is not None else None,
        activation_source=source,
        why_no_estimate=why_no_estimate,
        chunked_loss=chunked_loss,
        vocab_pieces=spec.vocab_pieces if spec is not None else None,
    )
    return num_params, kwargs


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
    chunked_loss: int | None = None,
    vocab_pieces: int | None = None,
) -> list[PlanRow]:
    """Which configurations fit in ``memory_gib``; one :class:`PlanRow` per configuration. The loss is
    the model's (``ModelSpec.chunked_loss``; the full logits for a bare count) unless ``chunked_loss``
    (tokens per chunk, ``0``: the default chunk) says otherwise; ``vocab_pieces`` likewise."""
    num_params, kwargs = _inputs(num_params, model, dtype, batch, seq_len, activations_gib, chunked_loss, vocab_pieces)
    configs = [parse_config(c) if isinstance(c, str) else c for c in (configs or DEFAULT_CONFIGS)]
    return plan_configs(num_params, int(memory_gib * GIB), configs, measurements=measurements, **kwargs)


@dataclass
class Recommendation:
    """Every candidate format (in order of preference) and the one to use (None: nothing is known to fit).

    Where activations are not known, ``undecided`` lists the formats whose other bytes fit, and
    ``choice_if_activations_fit`` is the one to use if the activations fit in its margin."""

    rows: list[PlanRow]
    choice: PlanRow | None
    choice_if_activations_fit: PlanRow | None = None

    @property
    def fitting(self) -> list[PlanRow]:
        return [r for r in self.rows if r.fits]

    @property
    def undecided(self) -> list[PlanRow]:
        return [r for r in self.rows if r.fits is None]


def recommend(
    num_params: int | None = None,
    memory_gib: float = 24.0,
    *,
    model: ModelSpec | str | None = None,
    dtype: str = "bf16",
    batch: int = 1,
    seq_len: int = 1024,
    measurements: list[dict] | None = None,
    activations_gib: float | None = None,
    chunked_loss: int | None = None,
    vocab_pieces: int | None = None,
) -> Recommendation:
    """The fusedopt AdamW configurations that fit in ``memory_gib``, and which one to use.

    The choice is the first that fits from the default format down (:data:`CANDIDATE_FORMATS`):
    formats with more bits than the default cost memory and were not measured better (the default
    is within noise of fp32 AdamW, :data:`QUALITY`); below it, the default's bits without the
    correction, then the paired ``norm2-root4`` (less memory than the 4-bit block format and measured
    better than it; after the default, whose optimizer step is faster and whose loss the seeds do
    not tell apart from it), then the 4-bit block format. Among equals, ``fused=False`` (a faster
    step) before ``fused=True``, and the full logits before the chunked loss (the same loss and update;
    it recomputes the head's logits in backward and needs the training loop to call
    ``fusedopt.chunked_cross_entropy``): a format with the chunked loss comes before a leaner format.
    The chunked loss is a candidate where the model's loss is the full logits and the activations are
    estimated from its shape (a given or measured figure already holds the loss the run used);
    ``chunked_loss`` sets the model's loss, as for :func:`plan`. Where no format fits with the chunked
    loss, the chunked loss with the embedding and head in :data:`VOCAB_PIECES` row pieces
    (``fusedopt.split_rows``: release then holds one piece's gradient, not the head's) follows each
    format's chunked row; ``vocab_pieces`` sets them for every row instead.
    """
    args = (num_params, model, dtype, batch, seq_len, activations_gib)
    num_params, kwargs = _inputs(*args, chunked_loss, vocab_pieces)
    configs = candidate_configs(kwargs["dtype"])
    memory = int(memory_gib * GIB)
    rows = plan_configs(num_params, memory, configs, measurements=measurements, **kwargs)
    estimated = kwargs["model_shape"] is not None and kwargs["activations"] is None
    variants = [rows]
    if kwargs["chunked_loss"] is None and estimated:
        chunk = default_chunk_size(kwargs["model_shape"].vocab)
        chunked = plan_configs(num_params, memory, configs, measurements=None, **{**kwargs, "chunked_loss": chunk})
        variants.append([r for r in chunked if r.activation_source != "measured"])
    if vocab_pieces is None and estimated and model is not None and not any(r.fits for r in variants[-1]):
        try:
            _, split = _inputs(*args, kwargs["chunked_loss"] or 0, VOCAB_PIECES)
        except UserError:  # tied embeddings, or a Hugging Face model type split_rows does not fit
            split = None
        if split is not None:
            pieces = plan_configs(num_params, memory, configs, measurements=None, **split)
            variants.append([r for r in pieces if r.activation_source != "measured"])
    rows = _interleave(variants, configs)
    choice = _first_from_default(rows, lambda r: r.fits is True)
    tentative = None if choice else _first_from_default(rows, lambda r: r.fits is None)
    return Recommendation(rows, choice, tentative)


def _interleave(variants: list[list[PlanRow]], configs: list) -> list[PlanRow]:
    """Each format's rows of the first variant (the full logits), then of the next (the chunked loss, then
    with the vocabulary in pieces)."""
    out = []
    for fmt in dict.fromkeys(format_of(c) for c in configs):
        out += [r for rows in variants for r in rows if format_of(r.config) == fmt]
    return out


def _first_from_default(rows: list[PlanRow], eligible) -> PlanRow | None:
    """The first eligible row from the default format down, else the first eligible row."""
    formats = [format_of(r.config) for r in rows]
    if DEFAULT_FORMAT in formats:
        start = formats.index(DEFAULT_FORMAT)
    else:  # fp32 parameters take no correction: the default is the default state format
        start = next((i for i, f in enumerate(formats) if f[0] == DEFAULT_FORMAT[0]), 0)
    return next((r for r in rows[start:] if eligible(r)), None) or next((r for r in rows if eligible(r)), None)


def config_string(config) -> str:
    """The ``--config`` string of a configuration (what the profiler takes)."""
    name = config.optimizer.replace("fusedopt.AdamW", "fusedopt").replace("torch.AdamW", "torch")
    return name + (":" + ",".join(f"{k}={v!r}" for k, v in config.kwargs.items()) if config.kwargs else "")


def _profiler_args(row: PlanRow) -> str:
    """The profiler's arguments that measure a row: its ``--config`` and, for the chunked loss, ``--chunked-loss``."""
    loss = f" --chunked-loss {row.chunked_loss}" if row.chunked_loss is not None else ""
    loss += f" --vocab-pieces {row.vocab_pieces}" if row.vocab_pieces else ""
    return f'--config "{config_string(row.config)}"{loss}'


def _gib(b) -> str:
    return f"{b / GIB:.2f}"


def format_plan(rows: list[PlanRow], *, num_params: int, memory_bytes: int, header: str = "") -> str:
    lines = []
    if header:
        lines.append(header)
    lines.append(f"{num_params:,} parameters; memory {memory_bytes / GIB:.2f} GiB")
    sources = {(r.activations, r.activation_source) for r in rows}
    one_source = len(sources) == 1
    if one_source and rows[0].activations is not None:
        lines.append(f"activations: {_gib(rows[0].activations)} GiB, {rows[0].activation_source}")
    elif one_source:
        lines.append(f"activations: {rows[0].activation_source}")
    width = max(len("config"), *(len(r.description) for r in rows))
    head = (
        f"{'config':<{width}}  {'B/param':>7}  {'persist GiB':>11}  {'grads GiB':>9}  {'activ GiB':>9}  "
        f"{'peak GiB':>8}  {'margin GiB':>10}  {'fits':>4}  bytes per parameter from"
    )
    lines += [head, "-" * len(head)]
    for r in rows:
        fits = {True: "yes", False: "no", None: "?"}[r.fits]
        act = _gib(r.activations) if r.activations is not None else "n/a"
        peak = _gib(r.peak) + ("+" if r.activations is None else "")
        margin = f"{r.margin / GIB:+.2f}" if r.activations is not None else "n/a"
        lines.append(
            f"{r.description:<{width}}  {r.per_param.at_peak:>7.2f}  {_gib(r.persistent):>11}  {_gib(r.grads):>9}  "
            f"{act:>9}  {peak:>8}  {margin:>10}  {fits:>4}  {r.per_param.source}"
            + ("" if one_source else f"; activations: {r.activation_source}")
        )
    lines += [f"note: {r.description}: {r.note}" for r in rows if r.note]
    if any(r.activations is None for r in rows):
        lines.append(f"activations not included ('+'): {ACTIVATIONS_HINT}")
    lines.append(
        "B/param = parameter + master-weight correction + optimizer state + gradient alive at the peak (none with "
        "fused=True: each gradient is applied and freed in backward), per parameter; peak = B/param x parameters "
        "+ activations"
    )
    return "\n".join(lines)


def format_recommendation(rec: Recommendation, *, memory_bytes: int) -> str:
    fitting = rec.fitting
    lines = []
    if not fitting and rec.undecided:
        return _format_undecided(rec, memory_bytes=memory_bytes)
    if not fitting:
        leanest = min(rec.rows, key=lambda r: r.peak)
        needs = f"{_gib(leanest.peak)} GiB" + (" before activations" if leanest.activations is None else "")
        if leanest.activations is not None:
            needs += f" (margin {leanest.margin / GIB:+.2f} GiB)"
        full = [r for r in rec.rows if r.chunked_loss is None]
        also = ""
        if leanest.chunked_loss is not None and full:
            lean_full = min(full, key=lambda r: r.peak)
            also = (
                f"; with the full logits the leanest, {lean_full.description}, needs {_gib(lean_full.peak)} GiB "
                f"(margin {lean_full.margin / GIB:+.2f} GiB)"
            )
        lines.append(
            f"No fusedopt AdamW configuration fits in {memory_bytes / GIB:.2f} GiB: the leanest, "
            f"{leanest.description}, needs {needs}{also}. Try a smaller --batch or --seq-len, "
            "activation checkpointing, or more GPU memory."
        )
        return "\n".join(lines)
    lines.append(
        f"fusedopt AdamW configurations that fit in {memory_bytes / GIB:.2f} GiB, in order of preference "
        f"({QUALITY_SOURCE}):"
    )
    width = max(len(r.description) for r in fitting)
    for r in fitting:
        mark = "*" if r is rec.choice else " "
        lines.append(
            f" {mark} {r.description:<{width}}  peak {_gib(r.peak)} GiB  margin {r.margin / GIB:+.2f} GiB  "
            f"quality {r.quality}"
        )
    c = rec.choice
    lines.append(
        f"Use: {c.description} ({_profiler_args(c)}), peak {_gib(c.peak)} GiB, margin {c.margin / GIB:.2f} GiB."
    )
    if c.vocab_pieces:
        lines.append(
            f"  (the vocabulary in pieces: model.lm_head = fusedopt.split_rows(model.lm_head, {c.vocab_pieces}), the "
            "same for the input embedding, before building the optimizer)"
        )
    if c.chunked_loss is not None:
        head = "lm_head.pieces" if c.vocab_pieces else "lm_head.weight"
        lines.append(
            f"  (the chunked loss: compute the loss with fusedopt.chunked_cross_entropy(hidden, {head}, "
            f"labels, chunk_size={c.chunked_loss}), which never builds the full logits)"
        )
    if format_of(c.config) != format_of(fitting[0].config):
        lines.append("  (rows above it keep more bits than the default: more memory for no measured gain)")
    if rec.undecided:
        lines.append(f"  ({len(rec.undecided)} more formats fit on their other bytes; their activations are not known)")
    return "\n".join(lines)


def _format_undecided(rec: Recommendation, *, memory_bytes: int) -> str:
    """Nothing is known to fit, but some formats fit before activations: rank those, '+' marking
    a peak still without activations, and say what settles it."""
    undecided = rec.undecided
    whys = {r.activation_source for r in undecided}
    why = whys.pop().removeprefix(NOT_INCLUDED).removeprefix(": ") if len(whys) == 1 else ""
    lines = [
        f"Whether a fusedopt AdamW configuration fits in {memory_bytes / GIB:.2f} GiB depends on the "
        "activations, which are not known" + (f": {why}." if why else ".") + f" To include them, {ACTIVATIONS_HINT}.",
        "Before activations ('+'), these fit, in order of preference, with the room left for "
        f"activations ({QUALITY_SOURCE}):",
    ]
    width = max(len(r.description) for r in undecided)
    c = rec.choice_if_activations_fit
    for r in undecided:
        mark = "*" if r is c else " "
        lines.append(
            f" {mark} {r.description:<{width}}  peak {_gib(r.peak)}+ GiB  room {r.margin / GIB:.2f} GiB  "
            f"quality {r.quality}"
        )
    if c is not None:
        lines.append(
            f"If the activations fit in {c.margin / GIB:.2f} GiB, use: {c.description} "
            f'(--config "{config_string(c.config)}"), peak {_gib(c.peak)}+ GiB.'
        )
    return "\n".join(lines)
