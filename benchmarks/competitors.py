"""The line-up of issue 6: every optimizer configuration the head-to-head benchmarks compare.

Each entry is a ``fusedopt-profile --config`` string (see ``fusedopt/profile/competitors.py``
for how each library is built, as its own documentation recommends) plus what the benchmarks
need to know about it. The keys A..I are the other libraries' configurations; the FO*
keys are fusedopt's AdamW, the AF* keys fusedopt's Adafactor. Every AdamW-like entry gets the same
hyperparameters (:data:`HPARAMS`, overriding the libraries' own defaults) unless a benchmark sets
its own schedule; an entry with its own ``hparams`` (Adafactor: torch's defaults) gets those.

    python benchmarks/competitors.py            # the line-up and what is installed here
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from fusedopt.profile import OptimizerConfig, parse_config

# Identical for every optimizer: decoupled weight decay scaled by lr, on
# every parameter. The libraries' defaults differ (optimi eps 1e-6, betas (0.9, 0.99); TurboAdam
# weight decay 0): all are overridden.
HPARAMS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@dataclass(frozen=True)
class Entry:
    key: str
    config: str  # profiler configuration string, without HPARAMS
    label: str
    # bytes moved per element by one optimizer step on bf16 parameters (fp32 for autocast),
    # each tensor read and written once: the byte model of part 2 (None: not in part 2)
    step_bytes: float | None = None
    # the entry's own hyperparameters instead of HPARAMS (an optimizer whose arguments are not AdamW's)
    hparams: dict | None = None

    def optimizer_config(self, hparams: dict | None = None) -> OptimizerConfig:
        config = parse_config(self.config)
        if self.hparams is not None and hparams is not None:
            raise SystemExit(
                f"line-up key {self.key} ({config.optimizer}) takes its own hyperparameters, not AdamW's: "
                "this benchmark cannot run it"
            )
        own = self.hparams if self.hparams is not None else HPARAMS
        kwargs = {**(own if hparams is None else hparams), **config.kwargs}
        return OptimizerConfig(config.optimizer, kwargs)

    @property
    def release(self) -> bool:
        return parse_config(self.config).release

    def unavailable(self, device_type: str) -> str | None:
        return parse_config(self.config).unavailable(device_type)


def _fusedopt_bytes(state_bits: int, master) -> float:
    """Per element: gradient 2 (read), parameter 2 + 2, correction, moments and block scales (one
    byte per 16 elements and moment), each read and written; the finite check's second read of
    the gradient is not counted (benchmarks/step_bandwidth.py counts it)."""
    corr = {None: 0, 24: 2, 32: 4}[master]
    moments = {8: 4, 4: 2, 16: 8, 32: 16}[state_bits]
    scales = 2 * 2 / 16 if state_bits in (8, 4) else 0
    return 2 + 4 + corr + moments + scales


LINEUP: tuple[Entry, ...] = (
    Entry("A", "torch.AdamW:fused=True,autocast='bf16'", "torch AdamW fused, fp32 params + bf16 autocast", 28.0),
    Entry("B", "torch.AdamW:fused=True", "torch AdamW fused, pure bf16 (bf16 state)", 14.0),
    Entry("C", "torch.AdamW:fused=True,release=True", "torch AdamW per parameter in backward hooks, bf16"),
    Entry("D", "bnb.AdamW8bit", "bitsandbytes AdamW8bit, bf16", 2 + 4 + 4 + 2 * 2 * 4 / 256),
    Entry("E", "torchao.AdamW8bit", "torchao AdamW8bit, bf16, stochastic rounding", 2 + 4 + 4 + 2 * 2 * 4 / 256),
    Entry("E4", "torchao.AdamW4bit", "torchao AdamW4bit, bf16, stochastic rounding", 2 + 4 + 2 + 2 * 2 * 4 / 128),
    Entry("F", "flashoptim.FlashAdamW", "FlashOptim FlashAdamW (8-bit state, 24-bit master), bf16", 12.25),
    Entry("G", "flashoptim.FlashAdamW:release=True", "FlashOptim FlashAdamW + gradient release, bf16"),
    Entry("H", "turboadam.TurboAdam", "TurboAdam defaults (UState m, 4-bit v), bf16", 2 + 4 + 2 * 0.8125),
    Entry("I0", "optimi.AdamW", "optimi AdamW, Kahan summation, bf16", 18.0),
    Entry("I", "optimi.AdamW:release=True", "optimi AdamW, Kahan summation + gradient release, bf16"),
    Entry("FO", "fusedopt.AdamW", "fusedopt default (8-bit state, 24-bit master)", _fusedopt_bytes(8, 24)),
    Entry("FOR", "fusedopt.AdamW:fused=True", "fusedopt default + gradient release (fused=True)"),
    Entry("FO4", "fusedopt.AdamW:state_bits=4", "fusedopt 4-bit state, 24-bit master", _fusedopt_bytes(4, 24)),
    Entry("FO4R", "fusedopt.AdamW:state_bits=4,fused=True", "fusedopt 4-bit state, 24-bit master, fused=True"),
    Entry(
        "FON",
        "fusedopt.AdamW:master_weight_bits=None",
        "fusedopt 8-bit state, no correction (stochastic rounding)",
        _fusedopt_bytes(8, None),
    ),
    Entry(
        "FO4N",
        "fusedopt.AdamW:state_bits=4,master_weight_bits=None",
        "fusedopt 4-bit state, no correction",
        _fusedopt_bytes(4, None),
    ),
    Entry(
        "FO4NR",
        "fusedopt.AdamW:state_bits=4,master_weight_bits=None,fused=True",
        "fusedopt 4-bit state, no correction, fused=True",
    ),
    Entry("FOROT4R", "fusedopt.AdamW:state_format='rot4',fused=True", "fusedopt rot4 state, 24-bit master, fused=True"),
    Entry(
        "FONL4R",
        "fusedopt.AdamW:state_format='norm2-log4',fused=True",
        "fusedopt norm2-log4 state, 24-bit master, fused=True",
    ),
    Entry(
        "FONL4NR",
        "fusedopt.AdamW:state_format='norm2-log4',master_weight_bits=None,fused=True",
        "fusedopt norm2-log4 state, no correction, fused=True",
    ),
    Entry(
        "FONR4R",
        "fusedopt.AdamW:state_format='norm2-root4',fused=True",
        "fusedopt norm2-root4 state, 24-bit master, fused=True",
    ),
    Entry(
        "FONR4NR",
        "fusedopt.AdamW:state_format='norm2-root4',master_weight_bits=None,fused=True",
        "fusedopt norm2-root4 state, no correction, fused=True",
    ),
    # fusedopt.Adafactor (torch.optim.Adafactor's arguments and defaults; memory and fit only)
    Entry(
        "AFR", "fusedopt.Adafactor:fused=True", "fusedopt Adafactor, no momentum, 24-bit master, fused=True", None, {}
    ),
    Entry(
        "AFM8R",
        "fusedopt.Adafactor:beta1=0.9,fused=True",
        "fusedopt Adafactor, 8-bit momentum, 24-bit master, fused=True",
        None,
        {},
    ),
    Entry(
        "AFM4R",
        "fusedopt.Adafactor:beta1=0.9,state_bits=4,fused=True",
        "fusedopt Adafactor, 4-bit momentum, 24-bit master, fused=True",
        None,
        {},
    ),
    Entry(
        "AFNR",
        "fusedopt.Adafactor:master_weight_bits=None,fused=True",
        "fusedopt Adafactor, no momentum, no correction, fused=True",
        None,
        {},
    ),
)
BY_KEY = {e.key: e for e in LINEUP}
REFERENCE = "A"  # ratios and gaps are to torch AdamW with fp32 parameters and bf16 autocast

# What each part runs by default (a part's --only narrows it).
PARTS = {
    "memory": tuple(BY_KEY),
    "step": tuple(e.key for e in LINEUP if e.step_bytes is not None),
    "quality": ("A", "B", "C", "D", "E", "E4", "F", "G", "H", "I", "FO", "FO4", "FON", "FO4N"),
    "fit": ("A", "B", "C", "D", "E4", "F", "G", "H", "I", "FO", "FOR", "FO4R", "FO4NR"),
}


def select(keys: str | None, part: str) -> list[Entry]:
    """Entries by comma-separated keys (``"A,FO,FOR"``), or the part's default line-up."""
    if not keys:
        return [BY_KEY[k] for k in PARTS[part]]
    chosen = []
    for key in keys.split(","):
        key = key.strip()
        if key not in BY_KEY:
            raise SystemExit(f"unknown line-up key {key!r} (choose from {', '.join(BY_KEY)})")
        chosen.append(BY_KEY[key])
    return chosen


def status_lines(device_type: str | None = None) -> list[str]:
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    lines = []
    for e in LINEUP:
        why = e.unavailable(device_type)
        lines.append(f"{e.key:6s} {e.config:62s} {'ok' if why is None else why}")
    return lines


def library_versions() -> dict:
    """Installed versions of every library of the line-up (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "triton", "transformers", "bitsandbytes", "torchao", "flashoptim", "turboadam"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    try:
        out["torch-optimi"] = version("torch-optimi")
    except PackageNotFoundError:
        out["torch-optimi"] = None
    import fusedopt

    out["fusedopt"] = fusedopt.__version__
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = parser.parse_args(argv)
    print("\n".join(status_lines(args.device)))
    print(library_versions())
    from fusedopt.profile.competitors import COMPETITORS

    print("\nHow each library is used (fusedopt/profile/competitors.py):")
    for name, c in COMPETITORS.items():
        print(f"  {name}: {c.how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
