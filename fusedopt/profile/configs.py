"""Optimizer configurations of the profiler and the planner: ``--config`` strings parsed into
:class:`OptimizerConfig` (an optimizer name and its keyword arguments) and built into optimizers."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

import torch

import fusedopt
from fusedopt.profile.competitors import COMPETITORS, LOOP_OPTIONS, torch_adamw_in_backward
from fusedopt.profile.competitors import lookup as lookup_competitor
from fusedopt.profile.models import UserError

_BUILTIN = (
    "torch.AdamW",
    "torch.SGD",
    "torch.Adafactor",
    "fusedopt.AdamW",
    "fusedopt.SGD",
    "fusedopt.Lion",
    "fusedopt.Adafactor",
)
# Other libraries' optimizers (fusedopt.profile.competitors), built as their documentation says.
OPTIMIZERS = _BUILTIN + tuple(COMPETITORS)
_ALIASES = {"torch": "torch.AdamW", "fusedopt": "fusedopt.AdamW", "adamw": "torch.AdamW"}
# The no-argument comparison: torch.optim.AdamW against fusedopt's defaults, without and with
# gradient release. Override with --config (CLI) or configs= (API).
DEFAULT_CONFIGS = ("torch.AdamW", "fusedopt.AdamW", "fusedopt.AdamW:fused=True")
AUTOCAST_DTYPES = ("bf16", "fp16")


@dataclass
class OptimizerConfig:
    """An optimizer (one of ``OPTIMIZERS``) and its keyword arguments.

    ``kwargs`` may hold the loop options of ``competitors.LOOP_OPTIONS``: ``release``
    (gradient release by the library's own mechanism; torch.AdamW: one optimizer per parameter
    stepped in a hook) and ``autocast`` (fp32 parameters, forward under ``torch.autocast``).
    """

    optimizer: str
    kwargs: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.kwargs:
            return self.optimizer
        return f"{self.optimizer}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"

    @property
    def is_fusedopt(self) -> bool:
        return self.optimizer.startswith("fusedopt.")

    @property
    def competitor(self):
        return lookup_competitor(self.optimizer)

    @property
    def fused(self) -> bool:
        return self.is_fusedopt and bool(self.kwargs.get("fused", False))

    @property
    def release(self) -> bool:
        """Gradients are freed inside backward (fusedopt's fused=True or a release loop option)."""
        return self.fused or bool(self.kwargs.get("release", False))

    @property
    def autocast(self) -> str | None:
        return self.kwargs.get("autocast")

    @property
    def constructor_kwargs(self) -> dict:
        return {k: v for k, v in self.kwargs.items() if k not in LOOP_OPTIONS}

    def param_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The parameter dtype this configuration trains in, given the profiler's ``dtype``."""
        return torch.float32 if self.autocast else dtype

    def optimizer_class(self):
        module, name = self.optimizer.split(".")
        return getattr(torch.optim if module == "torch" else fusedopt, name)

    def build(self, params, accumulation_steps: int = 1, *, model=None, device_type: str | None = None):
        """The optimizer over ``params``; release configurations also hook into ``model``."""
        kwargs = self.constructor_kwargs
        params = list(params)
        if device_type is None:
            device_type = params[0].device.type if params and isinstance(params[0], torch.Tensor) else "cpu"
        if self.competitor is not None:
            return self.competitor.build(params, kwargs, device_type, release=self.release, model=model)
        if self.release and not self.is_fusedopt:
            return torch_adamw_in_backward(params, kwargs)
        if self.fused and accumulation_steps > 1:
            kwargs.setdefault("accumulation_steps", accumulation_steps)
        if self.fused:
            kwargs.setdefault("max_grad_norm", None)  # the profiled step clips only when the configuration says so
        return self.optimizer_class()(params, **kwargs)

    def unavailable(self, device_type: str) -> str | None:
        """Why this configuration cannot run on ``device_type`` (a library missing, CUDA needed), or None."""
        return self.competitor.missing(device_type) if self.competitor is not None else None

    def check(self) -> str | None:
        """One update of a small tensor: raise UserError for bad options; a message if it cannot run.

        Another library's optimizer is only constructed (no trial step: some compile for a minute),
        and not even that when it needs CUDA (see :meth:`unavailable` for the device)."""
        if self.competitor is not None:
            why = self.competitor.missing("cuda")
            if why or self.competitor.cuda_only:
                return why
        model = torch.nn.Linear(128, 64, bias=False)
        try:
            opt = self.build(model.parameters(), model=model, device_type="cpu")
        except NotImplementedError as exc:
            return f"not implemented yet: {exc}"
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UserError(f"optimizer configuration {self.label}: {exc}") from None
        if self.competitor is not None:
            return None  # constructed: options accepted
        try:
            if hasattr(opt, "remove_hooks"):
                opt.remove_hooks()
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()
        except NotImplementedError as exc:
            return f"not implemented yet: {exc}"
        return None

    def to_dict(self) -> dict:
        return {"optimizer": self.optimizer, "kwargs": {k: _jsonable(v) for k, v in self.kwargs.items()}}


class AutocastLM(torch.nn.Module):
    """``model(input_ids, labels)`` with the forward under ``torch.autocast`` (fp32 parameters)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, input_ids, labels=None):
        with torch.autocast(input_ids.device.type, dtype=self.dtype):
            return self.model(input_ids, labels)


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def parse_config(text: str) -> OptimizerConfig:
    """``"fusedopt:fused=True,state_bits=16,master_weight_bits=None"`` -> OptimizerConfig.

    The name is one of ``torch.AdamW``, ``torch.SGD``, ``fusedopt.AdamW``, ``fusedopt.SGD``,
    ``fusedopt.Lion`` or another library's optimizer (``bnb.AdamW8bit``, see
    ``fusedopt.profile.competitors``), case-insensitive; ``torch`` and ``fusedopt`` mean the
    AdamWs. Values are Python literals (``True``, ``None``, ``16``, ``(0.9, 0.95)``);
    ``release=True`` and ``autocast='bf16'`` are loop options (see :class:`OptimizerConfig`).
    """
    name, _, args = text.strip().partition(":")
    name = _ALIASES.get(name.strip().lower(), name.strip())
    match = next((o for o in _BUILTIN if o.lower() == name.lower()), None)
    if match is None and lookup_competitor(name) is not None:
        match = lookup_competitor(name).name
    if match is None:
        raise UserError(f"unknown optimizer {name!r} in --config {text!r} (choose from {', '.join(OPTIMIZERS)})")
    kwargs = {}
    for item in _split_top_level(args):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UserError(f"malformed --config {text!r}: expected NAME[:key=value,...], got {item!r}")
        try:
            kwargs[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            message = f"malformed --config {text!r}: {key.strip()}={raw.strip()} is not a Python literal"
            raise UserError(message) from None
    config = OptimizerConfig(match, kwargs)
    _check_loop_options(config, text)
    return config


def _check_loop_options(config: OptimizerConfig, text: str) -> None:
    if "release" in config.kwargs:
        if config.is_fusedopt:
            raise UserError(f"--config {text!r}: fusedopt releases gradients with fused=True, not release=")
        competitor = config.competitor
        if config.optimizer != "torch.AdamW" and (competitor is None or competitor.release is None):
            raise UserError(f"--config {text!r}: {config.optimizer} has no gradient release")
        if not isinstance(config.kwargs["release"], bool):
            raise UserError(f"--config {text!r}: release must be True or False")
    if "autocast" in config.kwargs and config.kwargs["autocast"] not in AUTOCAST_DTYPES:
        raise UserError(f"--config {text!r}: autocast must be one of {', '.join(map(repr, AUTOCAST_DTYPES))}")
