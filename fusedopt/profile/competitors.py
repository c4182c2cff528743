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

from fusedopt.master import MASTER_CORRECTION

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
    keys = [MASTER_CORRECTION]
    for c in COMPETITORS.values():
        keys += [k for k in c.correction_keys if k not in keys]
    return tuple(keys)


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
