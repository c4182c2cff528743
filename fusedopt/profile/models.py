"""Models for ``fusedopt.profile``: the embedded transformer LM, its size presets, and HF configs.

Everything here builds in-process from a shape: no download, no data set. The embedded model
is a Llama-style decoder (RMSNorm, rotary attention with optional grouped KV heads, SwiGLU MLP,
an LM head untied from the embedding unless the shape ties them) whose blocks can run under
non-reentrant activation checkpointing, which is the regime fusedopt is for: with checkpointing
and a small micro-batch, weights, gradients and optimizer state make the peak of a training step.
Its loss is the cross-entropy of the full logits, or ``fusedopt.chunked_cross_entropy`` (chunks of
tokens, never the full logits) when built with ``chunked_loss``.

A :class:`ModelSpec` names a model (a preset, an explicit shape, or a Hugging Face config file)
as plain data, so a profiling worker in a fresh process can rebuild it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedopt.losses import chunked_cross_entropy, default_chunk_size
from fusedopt.pieces import RowPiecesLinear, piece_rows, split_rows


class UserError(Exception):
    """Bad input from the user: reported as a one-line message and a non-zero exit, no traceback."""


DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {name!r} (choose from fp32, bf16, fp16)") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class ModelShape:
    """Shape of the embedded decoder-only LM. ``tie_embeddings``: the LM head is the embedding's
    weight (one ``[vocab, d_model]`` parameter instead of two); untied by default."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of every parameter, in the order the model registers them."""
        d, kv = self.d_model, self.kv_heads * self.head_dim
        block = [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (self.ffn, d), (self.ffn, d), (d, self.ffn)]
        head = [] if self.tie_embeddings else [(self.vocab, d)]
        return [(self.vocab, d)] + block * self.layers + [(d,)] + head

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes())

    def describe(self) -> str:
        kv = f", kv_heads={self.kv_heads}" if self.kv_heads != self.heads else ""
        tied = ", tied embeddings" if self.tie_embeddings else ""
        return (
            f"vocab={self.vocab}, d_model={self.d_model}, layers={self.layers}, heads={self.heads}{kv}, "
            f"ffn={self.ffn}{tied}"
        )


# Presets. "tiny" is for tests, "small" the CPU default, "1b" the TinyLlama shape of the H200
# measurements in benchmarks/RESULTS.md, "7b" the Llama-2-7B shape, "llama3-8b" the Llama-3-8B
# shape (8,030,261,248 parameters; its embedding and untied LM head are 525,336,576 each).
PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab=256, d_model=128, layers=8, heads=4, kv_heads=4, ffn=384),
    "small": ModelShape(vocab=1024, d_model=256, layers=8, heads=8, kv_heads=8, ffn=768),
    "125m": ModelShape(vocab=32000, d_model=768, layers=12, heads=12, kv_heads=12, ffn=2048),
    "350m": ModelShape(vocab=32000, d_model=1024, layers=24, heads=16, kv_heads=16, ffn=2816),
    "1b": ModelShape(vocab=32000, d_model=2048, layers=22, heads=32, kv_heads=4, ffn=5632),
    "7b": ModelShape(vocab=32000, d_model=4096, layers=32, heads=32, kv_heads=32, ffn=11008),
    "llama3-8b": ModelShape(vocab=128256, d_model=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}

_SHAPE_KEYS = {
    "vocab": "vocab",
    "vocab_size": "vocab",
    "d_model": "d_model",
    "d": "d_model",
    "hidden": "d_model",
    "hidden_size": "d_model",
    "layers": "layers",
    "n_layers": "layers",
    "num_hidden_layers": "layers",
    "heads": "heads",
    "n_heads": "heads",
    "num_attention_heads": "heads",
    "kv_heads": "kv_heads",
    "num_key_value_heads": "kv_heads",
    "ffn": "ffn",
    "intermediate": "ffn",
    "intermediate_size": "ffn",
    "tie_embeddings": "tie_embeddings",
    "tie_word_embeddings": "tie_embeddings",
}
_BOOLEAN_KEYS = {"tie_embeddings"}
_BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_shape(text: str, base: ModelShape | None = None) -> ModelShape:
    """``"layers=4,d_model=256,heads=4,ffn=1024,vocab=8192"`` -> ModelShape (unset keys from ``base``).

    Without a base, ``layers``, ``d_model`` and ``heads`` are required; ``ffn`` defaults to
    ``4 * d_model``, ``vocab`` to 32000, ``kv_heads`` to ``heads`` and ``tie_embeddings`` (true/false,
    1/0) to false.
    """
    values: dict[str, int | bool] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or key not in _SHAPE_KEYS:
            known = "vocab, d_model, layers, heads, kv_heads, ffn, tie_embeddings"
            raise UserError(f"malformed shape {text!r}: expected comma-separated key=value with keys {known}")
        if _SHAPE_KEYS[key] in _BOOLEAN_KEYS:
            flag = _BOOLEANS.get(raw.strip().lower())
            if flag is None:
                raise UserError(f"malformed shape {text!r}: {key} must be true or false, got {raw.strip()!r}")
            values[_SHAPE_KEYS[key]] = flag
            continue
        try:
            value = int(raw.strip().replace("_", ""))
        except ValueError:
            message = f"malformed shape {text!r}: {key} must be a positive integer, got {raw.strip()!r}"
            raise UserError(message) from None
        if value <= 0:
            raise UserError(f"malformed shape {text!r}: {key} must be a positive integer, got {value}")
        values[_SHAPE_KEYS[key]] = value
    if base is not None:
        fields = dataclasses.asdict(base)
        if "heads" in values and "kv_heads" not in values:
            fields["kv_heads"] = values["heads"]
        fields.update(values)
    else:
        missing = [k for k in ("layers", "d_model", "heads") if k not in values]
        if missing:
            raise UserError(f"malformed shape {text!r}: missing {', '.join(missing)}")
        fields = dict(vocab=32000, ffn=4 * values["d_model"], kv_heads=values["heads"])
        fields.update(values)
    shape = ModelShape(**fields)
    if shape.d_model % shape.heads:
        raise UserError(f"malformed shape {text!r}: d_model={shape.d_model} is not divisible by heads={shape.heads}")
    if shape.heads % shape.kv_heads:
        raise UserError(f"malformed shape {text!r}: heads={shape.heads} is not divisible by kv_heads={shape.kv_heads}")
    if shape.head_dim % 2:
        raise UserError(f"malformed shape {text!r}: the head dimension d_model/heads must be even (rotary embedding)")
    return shape


# --- the embedded model ------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, **factory):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        kv = shape.kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.d_model, shape.d_model, bias=False, **factory)
        self.k_proj = nn.Linear(shape.d_model, kv, bias=False, **factory)
        self.v_proj = nn.Linear(shape.d_model, kv, bias=False, **factory)
        self.o_proj = nn.Linear(shape.d_model, shape.d_model, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        half = self.head_dim // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, **factory):
        super().__init__()
        self.gate_proj = nn.Linear(shape.d_model, shape.ffn, bias=False, **factory)
        self.up_proj = nn.Linear(shape.d_model, shape.ffn, bias=False, **factory)
        self.down_proj = nn.Linear(shape.ffn, shape.d_model, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, **factory):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(shape.d_model, eps=1e-5, **factory)
        self.self_attn = Attention(shape, **factory)
        self.post_attention_layernorm = nn.RMSNorm(shape.d_model, eps=1e-5, **factory)
        self.mlp = MLP(shape, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    """Decoder-only LM. ``model(input_ids, labels=...)`` returns the mean next-token loss (fp32).

    ``checkpointing=True`` recomputes each block in backward (non-reentrant checkpointing),
    so only block inputs are kept from the forward pass. ``chunked_loss`` (tokens per chunk) computes
    the loss with :func:`fusedopt.chunked_cross_entropy`, which never builds the full logits; the
    default (``None``) is the cross-entropy of the full logits (:func:`lm_loss`). Both are the same
    loss. ``model.hidden_states(input_ids)`` is the final norm's output, what the head reads.
    """

    def __init__(
        self,
        shape: ModelShape,
        *,
        checkpointing: bool = True,
        chunked_loss: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.shape = shape
        self.checkpointing = checkpointing
        self.chunked_loss = chunked_loss
        self.embed_tokens = nn.Embedding(shape.vocab, shape.d_model, **factory)
        self.layers = nn.ModuleList(Block(shape, **factory) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.d_model, eps=1e-5, **factory)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab, bias=False, **factory)
        if shape.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.hidden_states(input_ids)
        if labels is not None and self.chunked_loss is not None:
            return chunked_lm_loss(hidden, head_weight(self.lm_head), labels, self.chunked_loss)
        logits = self.lm_head(hidden)
        if labels is None:
            return logits
        return lm_loss(logits, labels)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32 (labels shifted by one, as Hugging Face does)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1))


def head_weight(head: nn.Module):
    """What :func:`fusedopt.chunked_cross_entropy` takes of an LM head: its row pieces where it was split
    (:func:`fusedopt.split_rows`), else its weight."""
    return head.pieces if isinstance(head, RowPiecesLinear) else head.weight


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """:func:`lm_loss` of ``hidden @ weight.T`` without the full logits (:func:`fusedopt.chunked_cross_entropy`)."""
    return chunked_cross_entropy(hidden[:, :-1], weight, labels[:, 1:], chunk_size=chunk_size)


# --- Hugging Face models -----------------------------------------------------------------------


def load_hf_config(path: str):
    """A ``transformers`` config from a ``config.json`` file or a directory holding one (no download)."""
    try:
        import transformers
    except ImportError:
        raise UserError("--hf-config needs the optional package 'transformers' (pip install transformers)") from None
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"Hugging Face config {path!r} not found (give a config.json file or a directory with one)")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not text (UnicodeDecodeError)
        raise UserError(f"cannot read Hugging Face config {path!r}: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"Hugging Face config {path!r} has no 'model_type'")
    model_type = data.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise their own error types
        raise UserError(f"Hugging Face config {path!r}: {exc}") from None


def build_hf_model(config, *, checkpointing: bool, device, dtype) -> nn.Module:

    with torch.device(device):
        model = causal_lm_from_config(config)
    model.to(device=device, dtype=dtype)
    if checkpointing:
        enable_hf_checkpointing(model)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


def enable_hf_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing on a transformers model (old and new method names)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class HFLossWrapper(nn.Module):
    """``wrapper(input_ids, labels)`` -> ``model(input_ids, labels=labels).loss``, output dropped early.

    With ``chunked_loss`` (tokens per chunk) the loss is :func:`fusedopt.chunked_cross_entropy` of the
    base model's last hidden state and the output embedding's weight, the same next-token loss
    without the full logits (for the Llama-style model types, whose head is a plain linear layer)."""

    def __init__(self, model: nn.Module, chunked_loss: int | None = None):
        super().__init__()
        self.model = model
        self.chunked_loss = chunked_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is not None and self.chunked_loss is not None:
            hidden = self.model.base_model(input_ids=input_ids).last_hidden_state
            head = self.model.get_output_embeddings()
            return chunked_lm_loss(hidden, head_weight(head), labels, self.chunked_loss)
        return self.model(input_ids=input_ids, labels=labels).loss


def causal_lm_from_config(config) -> nn.Module:
    """``AutoModelForCausalLM.from_config``; a config it cannot build (not a causal LM, a negative
    size, heads that do not divide the width) is a UserError."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, RuntimeError, TypeError, ZeroDivisionError) as exc:
        raise UserError(f"cannot build a causal LM from this Hugging Face config: {exc}") from None


# The fields of a Llama-style Hugging Face config that give the embedded model's shape (one field each).
HF_SHAPE_FIELDS = {
    "vocab_size": "vocab",
    "hidden_size": "d_model",
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "intermediate_size": "ffn",
}
# Model types whose decoder block is the embedded model's (RMSNorm, rotary attention, SwiGLU MLP).
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")


def hf_model_shape(config) -> tuple[ModelShape | None, str]:
    """The embedded model's shape equal to a Llama-style Hugging Face config, with a caveat when the
    config is of another model type (``""`` for a Llama one); or ``(None, why)``, ``why`` completing
    "it ..." (e.g. "is not a Llama-style config (no intermediate_size)")."""
    values, missing = {}, []
    for key, field in HF_SHAPE_FIELDS.items():
        value = getattr(config, key, None)
        if value is None:
            missing.append(key)
        elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return None, f"has {key}={value!r}, not a positive integer"
        else:
            values[field] = value
    if missing:
        return None, f"is not a Llama-style config (no {', '.join(missing)})"
    shape = ModelShape(**values, tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    if shape.d_model % shape.heads or shape.heads % shape.kv_heads:
        return None, "has a hidden_size, num_attention_heads or num_key_value_heads that does not divide evenly"
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim != shape.head_dim:
        return None, f"has head_dim={head_dim}, not hidden_size / num_attention_heads = {shape.head_dim}"
    if config.model_type in LLAMA_MODEL_TYPES:
        return shape, ""
    return shape, f"from its Llama-style fields; a {config.model_type} block may differ from a Llama one"


def hf_num_params(config) -> int:
    """Parameter count of the HF model for ``config``, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = causal_lm_from_config(config)
    return sum(p.numel() for p in model.parameters())


# --- specs ---------------------------------------------------------------------------------------


@dataclass
class ModelSpec:
    """A model as plain data: ``kind`` is ``"preset"``, ``"shape"`` or ``"hf"``. ``chunked_loss``: the
    loss is :func:`fusedopt.chunked_cross_entropy` with that many tokens per chunk (``None``: the
    cross-entropy of the full logits). ``vocab_pieces``: the embedding and the head are held as that
    many row pieces each (:func:`fusedopt.split_rows`), so release holds one piece's gradient at a time."""

    kind: str = "preset"
    preset: str | None = "small"
    shape: dict | None = None  # ModelShape fields, for kind "shape" (and filled in for presets)
    hf_config: str | None = None  # path to a config.json, for kind "hf"
    checkpointing: bool = True
    chunked_loss: int | None = None
    vocab_pieces: int | None = None

    @classmethod
    def from_args(
        cls,
        preset: str | None,
        shape: str | None,
        hf_config: str | None,
        checkpointing: bool = True,
        chunked_loss: int | None = None,
    ):
        """The spec of the command line's model arguments. ``chunked_loss=0`` asks for the chunked loss
        with the default chunk for the model's vocabulary (:func:`fusedopt.losses.default_chunk_size`)."""
        spec = cls._from_args(preset, shape, hf_config, checkpointing)
        if chunked_loss is None:
            return spec
        if isinstance(chunked_loss, bool) or not isinstance(chunked_loss, int) or chunked_loss < 0:
            raise UserError(f"--chunked-loss takes a number of tokens per chunk, got {chunked_loss!r}")
        if spec.kind == "hf":
            model_type = load_hf_config(spec.hf_config).model_type
            if model_type not in LLAMA_MODEL_TYPES:
                raise UserError(
                    f"--chunked-loss with a Hugging Face config needs a model type whose head is a plain linear "
                    f"layer ({', '.join(LLAMA_MODEL_TYPES)}), not {model_type}"
                )
        vocab = spec.vocab_size()
        spec.chunked_loss = chunked_loss or default_chunk_size(vocab or 1)
        return spec

    @classmethod
    def _from_args(cls, preset: str | None, shape: str | None, hf_config: str | None, checkpointing: bool):
        if hf_config is not None:
            if preset is not None or shape is not None:
                raise UserError("--hf-config cannot be combined with --model or --shape")
            load_hf_config(hf_config)  # validate now, with a clear message
            return cls(kind="hf", preset=None, hf_config=hf_config, checkpointing=checkpointing)
        base = None
        if preset is not None:
            key = preset.lower()
            if key not in PRESETS:
                raise UserError(f"unknown model preset {preset!r} (choose from {', '.join(PRESETS)})")
            base = PRESETS[key]
            if shape is None:
                return cls(kind="preset", preset=key, shape=dataclasses.asdict(base), checkpointing=checkpointing)
        if shape is not None:
            parsed = parse_shape(shape, base)
            return cls(kind="shape", preset=preset, shape=dataclasses.asdict(parsed), checkpointing=checkpointing)
        return cls.default(checkpointing=checkpointing)

    def with_vocab_pieces(self, pieces: int | None) -> ModelSpec:
        """This model with its embedding and head in ``pieces`` row pieces each (``None``: whole)."""
        if pieces is not None:
            if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
                raise UserError(f"--vocab-pieces takes a positive number of pieces, got {pieces!r}")
            if self.kind == "hf" and load_hf_config(self.hf_config).model_type not in LLAMA_MODEL_TYPES:
                types = ", ".join(LLAMA_MODEL_TYPES)
                raise UserError(f"--vocab-pieces with a Hugging Face config needs one of these model types: {types}")
            if self.kind != "hf" and self.model_shape().tie_embeddings:
                raise UserError("--vocab-pieces needs an untied head: split_rows would untie the tied embeddings")
            vocab = self.vocab_size()
            if vocab is not None and pieces > vocab:
                raise UserError(f"--vocab-pieces {pieces} is more pieces than the vocabulary has rows ({vocab})")
        return dataclasses.replace(self, vocab_pieces=pieces)

    def with_chunked_loss(self, chunk_size: int | None) -> ModelSpec:
        """This model with the chunked loss (``chunk_size`` tokens per chunk, ``0``: the default chunk) or,
        with ``None``, with the full logits."""
        if chunk_size == 0:
            chunk_size = default_chunk_size(self.vocab_size() or 1)
        return dataclasses.replace(self, chunked_loss=chunk_size)

    @classmethod
    def default(cls, checkpointing: bool = True, device: str | None = None) -> ModelSpec:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        preset = "1b" if device.startswith("cuda") else "small"
        return cls(kind="preset", preset=preset, shape=dataclasses.asdict(PRESETS[preset]), checkpointing=checkpointing)

    def model_shape(self) -> ModelShape | None:
        if self.kind == "hf":
            return None
        return ModelShape(**self.shape) if self.shape else PRESETS[self.preset]

    def activation_shape(self) -> tuple[ModelShape | None, str]:
        """The shape the activation estimate uses, with a caveat (``""``: none), or ``(None, why)``:
        a Hugging Face config gives the equal embedded shape when it is Llama-style."""
        if self.kind == "hf":
            shape, caveat = hf_model_shape(load_hf_config(self.hf_config))
            if shape is None:
                return None, f"{self.hf_config} gives no shape to estimate them from; it {caveat}"
            return shape, caveat
        return self.model_shape(), ""

    def num_params(self) -> int:
        if self.kind == "hf":
            return hf_num_params(load_hf_config(self.hf_config))
        return self.model_shape().num_params()

    def param_shapes(self) -> list[tuple[int, ...]]:
        if self.kind == "hf":
            with torch.device("meta"):
                model = causal_lm_from_config(load_hf_config(self.hf_config))
            shapes = [tuple(p.shape) for p in model.parameters()]
        else:
            shapes = self.model_shape().param_shapes()
        if not self.vocab_pieces:
            return shapes
        vocab, out = self.vocab_size(), []
        for shape in shapes:  # the embedding and the head: [vocab, hidden] -> split_rows' row blocks
            if len(shape) == 2 and shape[0] == vocab:
                out += [(rows, shape[1]) for rows in piece_rows(vocab, self.vocab_pieces)]
            else:
                out.append(shape)
        return out

    def vocab_size(self) -> int | None:
        if self.kind == "hf":
            return getattr(load_hf_config(self.hf_config), "vocab_size", None)
        return self.model_shape().vocab

    def max_positions(self) -> int | None:
        if self.kind == "hf":
            return getattr(load_hf_config(self.hf_config), "max_position_embeddings", None)
        return None

    def describe(self) -> str:
        ckpt = "activation checkpointing" if self.checkpointing else "no checkpointing"
        if self.chunked_loss is not None:
            ckpt += f", chunked loss ({self.chunked_loss} tokens per chunk)"
        if self.vocab_pieces:
            ckpt += f", embedding and head in {self.vocab_pieces} pieces"
        if self.kind == "hf":
            config = load_hf_config(self.hf_config)
            return f"Hugging Face {config.model_type} from {self.hf_config} ({ckpt})"
        name = f"preset {self.preset}" if self.kind == "preset" else "custom shape"
        return f"{name} ({self.model_shape().describe()}; {ckpt})"

    def build(self, device, dtype: torch.dtype) -> nn.Module:
        """The model on ``device`` in ``dtype``, taking ``(input_ids, labels)`` and returning the loss."""
        if self.kind == "hf":
            config = load_hf_config(self.hf_config)
            model = build_hf_model(config, checkpointing=self.checkpointing, device=device, dtype=dtype)
            if self.vocab_pieces:
                model.set_input_embeddings(split_rows(model.get_input_embeddings(), self.vocab_pieces))
                model.set_output_embeddings(split_rows(model.get_output_embeddings(), self.vocab_pieces))
            return HFLossWrapper(model, self.chunked_loss)
        shape, loss = self.model_shape(), self.chunked_loss
        model = TinyLM(shape, checkpointing=self.checkpointing, chunked_loss=loss, device=device, dtype=dtype)
        if self.vocab_pieces:
            model.embed_tokens = split_rows(model.embed_tokens, self.vocab_pieces)
            model.lm_head = split_rows(model.lm_head, self.vocab_pieces)
        return model

    def to_dict(self) -> dict:
        """The fields as plain data; the options added later (``chunked_loss``, a shape's
        ``tie_embeddings``) only when set, so that a spec without them keeps the key it had in
        earlier results files (the planner matches measured activations by it)."""
        data = dataclasses.asdict(self)
        for later in ("chunked_loss", "vocab_pieces"):
            if data[later] is None:
                del data[later]
        if data["shape"] is not None and not data["shape"].get("tie_embeddings", False):
            data["shape"].pop("tie_embeddings", None)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        return cls(**data)


def stdlib_source_bytes(n_bytes: int) -> torch.Tensor:
    """Real text available offline: the first ``n_bytes`` of the standard library's top-level
    ``.py`` files in name order, as a uint8 tensor (examples, convergence test, benchmarks)."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
            if total >= n_bytes:
                break
    return torch.frombuffer(bytearray(b"".join(chunks)[:n_bytes]), dtype=torch.uint8)


def random_batch(vocab: int, batch: int, seq_len: int, device, generator: torch.Generator | None = None):
    """Random token ids (``input_ids``, ``labels``): memory and speed do not depend on the data."""
    ids = torch.randint(0, vocab, (batch, seq_len), device=device, generator=generator)
    return ids, ids
