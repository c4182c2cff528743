"""The line-up of the head-to-head benchmarks (``benchmarks/``): every configuration they compare
(memory, step time, quality, fit), by key, as a ``--config`` string of this profiler plus what the
benchmarks need to know of it. Apart from ``competitors.py`` (the libraries themselves), which the
profiler's configurations import: the line-up is built from those configurations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedopt.profile.configs import OptimizerConfig, parse_config
from fusedopt.profile.models import UserError
from fusedopt.profile.planner import byte_model

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
    written once: the gradient read, the parameter, its correction and its moments (block scales
    included) read and written, their sizes from the planner's byte model. The finite check's second
    read of the gradient (+2) is not counted."""
    options = {"state_bits": state_bits, "master_weight_bits": master_weight_bits}
    per = byte_model("fusedopt.AdamW", options, torch.bfloat16)
    return per.params + 2 * per.persistent


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
        return parse_config(self.config).release

    def unavailable(self, device_type: str) -> str | None:
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
    chosen = []
    for key in keys.split(",") if keys else default:
        key = key.strip()
        if key not in BY_KEY:
            raise UserError(f"unknown line-up key {key!r} (choose from {', '.join(BY_KEY)})")
        chosen.append(BY_KEY[key])
    return chosen


def status_lines(device_type: str | None = None) -> list[str]:
    """One line per entry of the line-up: its configuration and whether it can run here."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return [f"{e.key:8s} {e.config:66s} {e.unavailable(device_type) or 'ok'}" for e in LINEUP]
