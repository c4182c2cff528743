"""Interleaved step timing: the default fusedopt step against torch's fused AdamW (and variants).

Usage (CUDA machine, repo root):
  python benchmarks/step_ab.py [--rounds 30] [--reps 5] [--variants [WORD ...]] [--formats NAME ...]
      [--model 1b] [--out ab.json]

``step_bandwidth.py`` times one configuration after another, and on the H200 the same
configuration moved by 2-3% between positions in one run (2026-11-30, RESULTS block 8: the
default took 5.615 ms in one run and 5.795 ms in the next, torch 5.777 and 5.761), which is as
large as the margin being measured. Here every configuration is built once (same shapes as
``step_bandwidth.py``: 8 tensors of 8192 x 16384 bf16), and each round times every
configuration (median of ``--reps`` steps), in an order that reverses every round so drift
hits all alike. Reported: per configuration the median step time over rounds, and per round
the ratio to torch's fused AdamW, with its median, min and max.

``--variants`` adds the default configuration with other tile shapes or register caps (built
with the module constants set, then restored: a prepared update keeps its launch config), and
with the 8 tensors in one bucketed launch pair (``kernels/bucket.py`` launches tensors this large
alone since the RESULTS block 9; a prepared update decides once, at its first step, whether it
can join a bucket).

``--model 1b`` times the parameters of a Llama-style model instead (``fusedopt.profile.models``:
201 bf16 tensors, 1.1e9 elements, most of them joining bucketed launches); the variant
``unbucketed`` shows what the buckets do there.

``--formats rot8 rot4 rot2`` adds fusedopt AdamW with those ``state_format`` values (the default's
24-bit master weights; kernels that run on CUDA only under ``FUSEDOPT_BACKEND=triton`` are built
under it): the same A/B method, per-element speed against the default.

``--lineup H E4`` adds other libraries' optimizers from ``benchmarks/competitors.py``'s line-up (built
as the profiler builds them, with its shared hyperparameters; installed packages only): the
seeds' own packages timed beside fusedopt's formats on the same tensors.

``--kernels`` then profiles 3 steps of each configuration (``torch.profiler``) and prints, per
kernel, launches and GPU time per step against the event-timed step: what of the step is kernel
time, and what is between kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
from unittest import mock

import torch

import fusedopt
from fusedopt.kernels import bucket

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_bandwidth import N_TENSORS, SHAPE, _time_ms, launch_constants  # noqa: E402  (benchmarks/ is not a package)

VARIANTS = {  # (elements per program, warps, register cap); the default is 1024, 2, None
    "tile 1024 / 4 warps (default until 2026-11-30)": (1024, 4, None),
    "tile 2048 / 4 warps": (2048, 4, None),
    "bucketed (one launch pair for the 8 tensors, the default until the RESULTS block 9)": "bucketed",
    "unbucketed (FUSEDOPT_BUCKET_MB=0: one launch pair per tensor)": "unbucketed",
}


def kernel_times(opt, steps: int = 3) -> tuple[list[tuple[str, int, float]], float]:
    """Per kernel (name, launches per step, GPU us per step) of ``opt.step()`` under torch.profiler,
    and the event-timed step (ms) of the same steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ms = _time_ms(opt.step, steps)
    rows = [
        (e.key, e.count // steps, e.device_time_total / steps) for e in prof.key_averages() if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda row: -row[2]), ms


def model_shapes(preset: str) -> list[tuple[int, ...]]:
    """The parameter shapes of ``fusedopt.profile.models``' Llama-style model ``preset`` (built on the meta device)."""
    from fusedopt.profile.models import PRESETS, TinyLM

    return [tuple(p.shape) for p in TinyLM(PRESETS[preset], device="meta").parameters()]


def _params(shapes):
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _build(make, shapes, launch=None):
    """An optimizer over fresh parameters of ``shapes``, warmed up (compiled, state allocated, launches
    prepared). ``launch``: (tile, warps, register cap), "bucketed" or "unbucketed"."""
    if launch == "bucketed":
        context = mock.patch.object(bucket, "MAX_MEMBER_NUMEL", 1 << 62)  # any size joins a bucket
    elif launch == "unbucketed":
        context = mock.patch.dict(os.environ, {"FUSEDOPT_BUCKET_MB": "0"})  # read when the optimizer is built
    else:
        context = launch_constants(*launch) if launch is not None else contextlib.nullcontext()
    with context:
        opt = make(_params(shapes))
        for _ in range(2):
            opt.step()
        torch.cuda.synchronize()
    return opt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--variants",
        nargs="*",
        default=None,
        help="also the default's variants (all, or those whose name has a word given)",
    )
    parser.add_argument("--formats", nargs="*", default=(), help="also fusedopt AdamW with these state formats")
    parser.add_argument("--lineup", nargs="*", default=(), help="also these line-up keys (competitors.py)")
    parser.add_argument("--kernels", action="store_true", help="then each configuration's kernel times per step")
    parser.add_argument(
        "--model", help="the parameters of this fusedopt.profile.models preset (e.g. 1b) instead of 8 large tensors"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    shapes = model_shapes(args.model) if args.model else [SHAPE] * N_TENSORS
    print(f"{len(shapes)} bf16 tensors, {sum(math.prod(s) for s in shapes) / 1e9:.3f}e9 elements", flush=True)
    configs = {
        "torch AdamW fused (bf16 state)": _build(lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), shapes),
        "fusedopt default (8-bit / 24)": _build(lambda ps: fusedopt.AdamW(ps, lr=1e-4), shapes),
    }
    if args.variants is not None:
        for name, launch in VARIANTS.items():
            if args.variants and not any(word in name for word in args.variants):
                continue
            configs[f"fusedopt default, {name}"] = _build(lambda ps: fusedopt.AdamW(ps, lr=1e-4), shapes, launch)
    for fmt in args.formats:
        with mock.patch.dict(os.environ, {"FUSEDOPT_BACKEND": "triton"}):  # the first step prepares the launch
            make = functools.partial(fusedopt.AdamW, lr=1e-4, state_format=fmt)
            configs[f"fusedopt {fmt} (24)"] = _build(make, shapes)
    if args.lineup:
        from competitors import select

        for key, entry in zip(args.lineup, select(",".join(args.lineup), "step")):
            if entry.release:
                raise SystemExit(f"line-up key {key}: a release configuration has no optimizer step to time")
            config = entry.optimizer_config()
            configs[f"{entry.label} [{key}]"] = _build(functools.partial(config.build, device_type="cuda"), shapes)
    names = list(configs)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(_time_ms(configs[name].step, args.reps))
    baseline = times[names[0]]
    print(f"{args.rounds} rounds, median of {args.reps} steps per configuration and round")
    print("| configuration | median ms | ratio to torch fused: median | min | max |\n|---|---|---|---|---|")
    summary = {}
    for name in names:
        ratios = [t / b for t, b in zip(times[name], baseline)]
        summary[name] = dict(ms=times[name], ratios=ratios)
        cells = [f"{statistics.median(times[name]):.3f}", f"{statistics.median(ratios):.4f}"]
        cells += [f"{min(ratios):.4f}", f"{max(ratios):.4f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    kernels = {}
    if args.kernels:
        for name in names:
            rows, ms = kernel_times(configs[name])
            kernels[name] = dict(step_ms=ms, kernels=rows)
            busy = sum(us for _, _, us in rows) / 1e3
            print(f"\n{name}: step {ms:.3f} ms (event-timed, under the profiler), kernels {busy:.3f} ms")
            for key, count, us in rows[:6]:
                print(f"  {count:3d} x {key[:70]:70s} {us / 1e3:8.3f} ms per step")
    if args.out:
        env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), fusedopt=fusedopt.__version__)
        env.update(model=args.model, tensors=len(shapes))
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rounds=args.rounds, reps=args.reps, results=summary, kernels=kernels), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
