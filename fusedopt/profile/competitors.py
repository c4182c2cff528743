"""Other optimizers the profiler can measure: ``torch`` patterns and competing libraries.

``fusedopt-profile --config bnb.AdamW8bit`` measures a step with bitsandbytes' 8-bit AdamW on
the same model as fusedopt, so a user can see what switching would save. Each entry builds
the optimizer the way its library's documentation recommends (the ``how`` text says which
options that means and why); the libraries are optional and imported only when used. A
configuration string takes the entry's name and keyword arguments for the optimizer, plus two
loop options that the profiler handles itself (see :data:`LOOP_OPTIONS`):

* ``release=True``: gradient release through the library's own mechanism (FlashOptim's
  ``enable_gradient_release``, optimi's ``gradient_release=True`` +
  ``prepare_for_gradient_release``, or for ``torch.AdamW`` one optimizer per parameter stepped
  in a post-accumulate-grad hook, the PyTorch "optimizer in backward" tutorial pattern).
* ``autocast='bf16'``: fp32 parameters, forward under ``torch.autocast`` in that dtype (the
  classic mixed-precision baseline); without it parameters are in the profiler's ``--dtype``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Keys of a configuration that belong to the training loop, not to the optimizer's constructor.
LOOP_OPTIONS = ("release", "autocast")


@dataclass(frozen=True)
class Competitor:
    """How to build one optimizer of another library, as its documentation recommends."""

    name: str  # the --config name, e.g. "bnb.AdamW8bit"
    module: str  # import name of the library
    pip: str  # what to pip install
    make: Callable  # (params, kwargs, device_type) -> optimizer
    how: str  # the recommended usage this entry follows, in words
    recommended: dict = field(default_factory=dict)  # options set unless the config overrides them
    cuda_only: bool = False
    compiles: bool = False  # its step runs torch.compile (cannot be op-tracked by the profiler)
    release: Callable | None = None  # (model, optimizer) -> None: the library's gradient release
    release_option: dict = field(default_factory=dict)  # constructor options that release needs
    correction_keys: tuple[str, ...] = ()  # optimizer-state keys that hold master-weight corrections
    state_bytes: float = 4.0  # persistent state bytes per parameter (bf16 params), for the planner
    correction_bytes: float = 0.0

    def missing(self, device_type: str = "cuda") -> str | None:
        """Why this entry cannot run here (library not installed, needs CUDA), or None."""
        if importlib.util.find_spec(self.module) is None:
            return f"not installed: pip install {self.pip}"
        if self.cuda_only and device_type != "cuda":
            return f"{self.pip} needs a CUDA device"
        return None

    def build(self, params, kwargs: dict, device_type: str, *, release: bool = False, model=None):
        if release and self.release is None:
            raise ValueError(f"{self.name} has no gradient release")
        options = {**self.recommended, **(self.release_option if release else {}), **kwargs}
        optimizer = self.make(params, options, device_type)
        if release:
            if model is None:
                raise ValueError(f"{self.name}: gradient release needs the model")
            self.release(model, optimizer)
        return optimizer


def _import(name: str):
    return importlib.import_module(name)


def _plain(module: str, attr: str):
    def make(params, kwargs, device_type):
        return getattr(_import(module), attr)(params, **kwargs)

    return make


def _optimi_make(params, kwargs, device_type):
    # optimi's fused Triton kernel needs a GPU; with triton=None its gradient-release path falls
    # back to eager per-op PyTorch (the flag is resolved only in the non-release step()).
    kwargs = {"triton": device_type == "cuda", **kwargs}
    return _import("optimi").AdamW(params, **kwargs)


def _flash_release(model, optimizer):
    model._flashoptim_release = _import("flashoptim").enable_gradient_release(model, optimizer)


def _optimi_release(model, optimizer):
    _import("optimi").prepare_for_gradient_release(model, optimizer)


class OptimizerInBackward(torch.optim.Optimizer):
    """The PyTorch "optimizer in backward" pattern: one optimizer per parameter, stepped (and its
    gradient freed) in that parameter's post-accumulate-grad hook. ``step()`` and ``zero_grad()``
    are no-ops; the per-parameter optimizers follow this optimizer's hyperparameters, so LR
    schedulers work on it as usual."""

    def __init__(self, params, make: Callable, defaults: dict):
        super().__init__(params, dict(defaults))
        self._per_param = {}
        self._handles = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                sub = make([p], {k: v for k, v in group.items() if k != "params"})
                sub.state = self.state  # one state dict, as a single optimizer would have
                self._per_param[p] = (sub, group)
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p):
        sub, group = self._per_param[p]
        sub_group = sub.param_groups[0]
        for key in sub_group:
            if key != "params" and key in group:
                sub_group[key] = group[key]
        sub.step()
        sub.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []


def torch_adamw_in_backward(params, kwargs: dict, model=None):
    options = {"fused": True, **kwargs}

    def make(ps, group):
        return torch.optim.AdamW(ps, **{k: v for k, v in group.items() if k in _ADAMW_KEYS})

    return OptimizerInBackward(params, make, options)


_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused", "capturable")


COMPETITORS: dict[str, Competitor] = {
    c.name: c
    for c in (
        Competitor(
            "bnb.AdamW8bit",
            "bitsandbytes",
            "bitsandbytes",
            _plain("bitsandbytes.optim", "AdamW8bit"),
            "bitsandbytes.optim.AdamW8bit(params, ...) on bf16 parameters, blockwise 8-bit state "
            "(the library default); no stochastic rounding of bf16 weights. Its README also suggests "
            "bnb.nn.StableEmbedding for NLP models: not done, every optimizer trains the same model",
            state_bytes=2.03,
        ),
        Competitor(
            "torchao.AdamW8bit",
            "torchao",
            "torchao",
            _plain("torchao.optim", "AdamW8bit"),
            "torchao.optim.AdamW8bit(..., bf16_stochastic_round=True): torchao's recommendation for "
            "bf16 parameters (its update is a torch.compile'd function per parameter)",
            recommended={"bf16_stochastic_round": True},
            compiles=True,
            state_bytes=2.03,
        ),
        Competitor(
            "torchao.AdamW4bit",
            "torchao",
            "torchao",
            _plain("torchao.optim", "AdamW4bit"),
            "torchao.optim.AdamW4bit(..., bf16_stochastic_round=True), as AdamW8bit",
            recommended={"bf16_stochastic_round": True},
            compiles=True,
            state_bytes=1.06,
        ),
        Competitor(
            "flashoptim.FlashAdamW",
            "flashoptim",
            "flashoptim",
            _plain("flashoptim", "FlashAdamW"),
            "flashoptim.FlashAdamW with its defaults (8-bit quantized moments, master_weight_bits=24: "
            "bf16 parameter + int8 error bits, fused Triton kernel) on bf16 parameters; release=True "
            "adds flashoptim.enable_gradient_release(model, optimizer) as its README shows",
            cuda_only=True,
            release=_flash_release,
            correction_keys=("error_bits",),
            state_bytes=2.125,
            correction_bytes=1.0,
        ),
        Competitor(
            "turboadam.TurboAdam",
            "turboadam",
            "turboadam",
            _plain("turboadam", "TurboAdam"),
            "turboadam.TurboAdam(params, ...) with its defaults (UState first moment, 4-bit 1Q second "
            "moment, fused Triton path on CUDA), the README's drop-in AdamW replacement",
            state_bytes=0.81,
        ),
        Competitor(
            "optimi.AdamW",
            "optimi",
            "torch-optimi",
            _optimi_make,
            "optimi.AdamW(..., kahan_sum=True, triton=True on CUDA) on bf16 parameters (Kahan summation "
            "is optimi's recommendation for pure bf16 training); release=True adds gradient_release=True "
            "and optimi.prepare_for_gradient_release(model, optimizer), as its README shows",
            recommended={"kahan_sum": True, "lr": 1e-3},  # optimi has no default lr: torch.optim's
            release=_optimi_release,
            release_option={"gradient_release": True},
            correction_keys=("kahan_comp",),
            state_bytes=4.0,
            correction_bytes=2.0,
        ),
    )
}
_BY_LOWER = {name.lower(): name for name in COMPETITORS}


def lookup(name: str) -> Competitor | None:
    """The entry called ``name`` (case-insensitive), or None."""
    key = _BY_LOWER.get(name.lower())
    return COMPETITORS[key] if key else None


@functools.cache
def correction_keys() -> tuple[str, ...]:
    """State keys that hold master-weight corrections, across fusedopt and every entry."""
    keys = ["master_correction"]
    for c in COMPETITORS.values():
        keys += [k for k in c.correction_keys if k not in keys]
    return tuple(keys)


# --- the line-up of the head-to-head benchmarks ------------------------------------------------
#
# Every configuration that benchmarks/ compares (memory, step time, quality, fit), by key: A..I are
# torch's and the other libraries' configurations, FO* fusedopt's AdamW, AF* fusedopt's Adafactor.
# Each entry is a ``--config`` string of this profiler plus what the benchmarks need to know of it.

# Identical for every AdamW-like entry (the libraries' own defaults differ: optimi eps 1e-6, betas
# (0.9, 0.99); TurboAdam weight decay 0): decoupled weight decay scaled by lr, on every parameter.
HPARAMS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
REFERENCE = "A"  # the benchmarks' ratios and gaps are to torch AdamW, fp32 parameters + bf16 autocast


def fusedopt_step_bytes(state_bits: int, master_weight_bits) -> float:
    """Bytes per element one fusedopt AdamW step moves on bf16 parameters, each tensor read and
    written once: gradient 2 (read), parameter 2 + 2, correction, moments and block scales (one byte
    per 16 elements and moment). The finite check's second read of the gradient (+2) is not counted."""
    corr = {None: 0, 24: 2, 32: 4}[master_weight_bits]
    moments = {8: 4, 4: 2, 16: 8, 32: 16}[state_bits]
    scales = 2 * 2 / 16 if state_bits in (8, 4) else 0
    return 2 + 4 + corr + moments + scales


@dataclass(frozen=True)
class Entry:
    """One configuration of the line-up."""

    key: str
    config: str  # profiler --config string, without HPARAMS
    label: str
    # bytes moved per element by one optimizer step on bf16 parameters (fp32 with autocast), every
    # tensor read and written once (None: unknown, or a release configuration, which has no step)
    step_bytes: float | None = None
    # the entry's own hyperparameters instead of HPARAMS (an optimizer whose arguments are not AdamW's)
    hparams: dict | None = None

    def optimizer_config(self, hparams: dict | None = None):
        """The :class:`~fusedopt.profile.configs.OptimizerConfig` with ``hparams`` (default HPARAMS)."""
        from fusedopt.profile.configs import OptimizerConfig, parse_config
        from fusedopt.profile.models import UserError

        config = parse_config(self.config)
        if self.hparams is not None and hparams is not None:
            raise UserError(
                f"line-up key {self.key} ({config.optimizer}) takes its own hyperparameters, not AdamW's: "
                "this benchmark cannot run it"
            )
        own = self.hparams if self.hparams is not None else HPARAMS
        return OptimizerConfig(config.optimizer, {**(own if hparams is None else hparams), **config.kwargs})

    @property
    def release(self) -> bool:
        from fusedopt.profile.configs import parse_config

        return parse_config(self.config).release

    def unavailable(self, device_type: str) -> str | None:
        from fusedopt.profile.configs import parse_config

        return parse_config(self.config).unavailable(device_type)


def _fo(key: str, options: str, label: str, bytes_per_element: float | None = None, **own) -> Entry:
    name = "fusedopt.Adafactor" if key.startswith("AF") else "fusedopt.AdamW"
    return Entry(key, f"{name}:{options}" if options else name, label, bytes_per_element, own.get("hparams"))


_BLOCK_SCALES_8 = 2 * 2 * 4 / 256  # bitsandbytes / torchao: an fp32 scale per 256 elements and moment
LINEUP: tuple[Entry, ...] = (
    Entry("A", "torch.AdamW:fused=True,autocast='bf16'", "torch AdamW fused, fp32 params + bf16 autocast", 28.0),
    Entry("B", "torch.AdamW:fused=True", "torch AdamW fused, pure bf16 (bf16 state)", 14.0),
    Entry("C", "torch.AdamW:fused=True,release=True", "torch AdamW per parameter in backward hooks, bf16"),
    Entry("D", "bnb.AdamW8bit", "bitsandbytes AdamW8bit, bf16", 2 + 4 + 4 + _BLOCK_SCALES_8),
    Entry("E", "torchao.AdamW8bit", "torchao AdamW8bit, bf16, stochastic rounding", 2 + 4 + 4 + _BLOCK_SCALES_8),
    Entry("E4", "torchao.AdamW4bit", "torchao AdamW4bit, bf16, stochastic rounding", 2 + 4 + 2 + 2 * 2 * 4 / 128),
    Entry("F", "flashoptim.FlashAdamW", "FlashOptim FlashAdamW (8-bit state, 24-bit master), bf16", 12.25),
    Entry("G", "flashoptim.FlashAdamW:release=True", "FlashOptim FlashAdamW + gradient release, bf16"),
    Entry("H", "turboadam.TurboAdam", "TurboAdam defaults (UState m, 4-bit v), bf16", 2 + 4 + 2 * 0.8125),
    Entry("I0", "optimi.AdamW", "optimi AdamW, Kahan summation, bf16", 18.0),
    Entry("I", "optimi.AdamW:release=True", "optimi AdamW, Kahan summation + gradient release, bf16"),
    _fo("FO", "", "fusedopt default (8-bit state, 24-bit master)", fusedopt_step_bytes(8, 24)),
    _fo("FOR", "fused=True", "fusedopt default + gradient release (fused=True)"),
    _fo("FO4", "state_bits=4", "fusedopt 4-bit state, 24-bit master", fusedopt_step_bytes(4, 24)),
    _fo("FO4R", "state_bits=4,fused=True", "fusedopt 4-bit state, 24-bit master, fused=True"),
    _fo(
        "FON",
        "master_weight_bits=None",
        "fusedopt 8-bit state, no correction (stochastic rounding)",
        fusedopt_step_bytes(8, None),
    ),
    _fo(
        "FO4N",
        "state_bits=4,master_weight_bits=None",
        "fusedopt 4-bit state, no correction",
        fusedopt_step_bytes(4, None),
    ),
    _fo("FO4NR", "state_bits=4,master_weight_bits=None,fused=True", "fusedopt 4-bit state, no correction, fused=True"),
    _fo("FOROT4R", "state_format='rot4',fused=True", "fusedopt rot4 state, 24-bit master, fused=True"),
    _fo("FONL4R", "state_format='norm2-log4',fused=True", "fusedopt norm2-log4 state, 24-bit master, fused=True"),
    _fo(
        "FONL4NR",
        "state_format='norm2-log4',master_weight_bits=None,fused=True",
        "fusedopt norm2-log4 state, no correction, fused=True",
    ),
    _fo("FONR4R", "state_format='norm2-root4',fused=True", "fusedopt norm2-root4 state, 24-bit master, fused=True"),
    _fo(
        "FONR4NR",
        "state_format='norm2-root4',master_weight_bits=None,fused=True",
        "fusedopt norm2-root4 state, no correction, fused=True",
    ),
    # fusedopt.Adafactor with torch.optim.Adafactor's arguments and defaults (memory and fit only)
    _fo("AFR", "fused=True", "fusedopt Adafactor, no momentum, 24-bit master, fused=True", hparams={}),
    _fo("AFM8R", "beta1=0.9,fused=True", "fusedopt Adafactor, 8-bit momentum, 24-bit master, fused=True", hparams={}),
    _fo(
        "AFM4R",
        "beta1=0.9,state_bits=4,fused=True",
        "fusedopt Adafactor, 4-bit momentum, 24-bit master, fused=True",
        hparams={},
    ),
    _fo(
        "AFNR",
        "master_weight_bits=None,fused=True",
        "fusedopt Adafactor, no momentum, no correction, fused=True",
        hparams={},
    ),
)
BY_KEY: dict[str, Entry] = {e.key: e for e in LINEUP}


def lineup(keys: str | None, default: tuple[str, ...] = tuple(BY_KEY)) -> list[Entry]:
    """Entries by comma-separated keys (``"A,FO,FOR"``), or those of ``default``."""
    from fusedopt.profile.models import UserError

    chosen = []
    for key in keys.split(",") if keys else default:
        key = key.strip()
        if key not in BY_KEY:
            raise UserError(f"unknown line-up key {key!r} (choose from {', '.join(BY_KEY)})")
        chosen.append(BY_KEY[key])
    return chosen


def library_versions() -> dict:
    """Installed versions of fusedopt, torch and every library of the line-up (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    import fusedopt

    out = {}
    dists = ("torch", "triton", "transformers", *dict.fromkeys(c.pip for c in COMPETITORS.values()))
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    out["fusedopt"] = fusedopt.__version__
    return out


def status_lines(device_type: str | None = None) -> list[str]:
    """One line per entry of the line-up: its configuration and whether it can run here."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return [f"{e.key:8s} {e.config:66s} {e.unavailable(device_type) or 'ok'}" for e in LINEUP]
