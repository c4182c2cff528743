"""Optimizer step speed: fusedopt's formats and settings against torch's fused AdamW and other
libraries, timed in one process as ratios.

    python benchmarks/step_speed.py                          # GPU: the default against torch, 8 x 8192 x 16384 bf16
    python benchmarks/step_speed.py --formats norm2-root4 block4 --lineup H E4 --rounds 6 --reps 5
    python benchmarks/step_speed.py --configs "fusedopt:master_weight_bits=None" "fusedopt:state_bits=16"
    python benchmarks/step_speed.py --configs fusedopt --constants APPROXIMATE_DENOMINATOR=True  # kernel A/B
    python benchmarks/step_speed.py --model 1b               # the 1.1B Llama's 201 tensors (host-bound)
    python benchmarks/step_speed.py --adafactor --layers 4 --dtype fp32   # Adafactor against torch.optim.Adafactor
    python benchmarks/step_speed.py --device cpu --shape 256x512 --tensors 2 --rounds 2 --reps 2 --lineup B  # smoke

Every configuration is built once over its own parameters (random, with random gradients kept across
steps; bf16 unless ``--dtype``, fp32 for a line-up entry with autocast) and stepped twice (compilation,
state, prepared launches). Then each round times every configuration, the median of ``--reps``
steps each bracketed by CUDA events, in an order reversed every round so that drift hits all alike
(``harness.interleave``); per round, the ratio to the baseline in the same round (the first
configuration: torch's fused AdamW, or ``torch.optim.Adafactor`` with ``--adafactor``). Reported:
the median ratio over rounds with its min and max, the median ms, and where the configuration's bytes
per element are known (each tensor read and written once), the share of a device-to-device copy's
bandwidth measured in the same process. fusedopt's finite check reads the gradient a second time
(+2 B per element, not counted), which caps its share at 86% of copy with the default.

Configurations: the baseline, fusedopt's default, then ``--formats`` (``state_format``, built under
``FUSEDOPT_BACKEND=triton`` on CUDA: a format the kernel cannot run is an error, not a reference-path
time), ``--configs`` (``fusedopt-profile --config`` strings) and ``--lineup`` (keys of
``fusedopt/profile/lineup.py``'s line-up, with its hyperparameters; plain steps only: release
configurations have no step to time). ``--model PRESET`` times the parameters of the profiler's
Llama-style model instead of the large tensors (most of them join bucketed launches: the step is
bound by host time). ``--adafactor``: the tensors of ``--layers`` decoder layers of the 1.1B shape
(``--embedding`` adds its embedding), gradients scaled by 1e-2, torch's Adafactor (single-tensor and
``foreach``) against fusedopt's. ``--kernels`` then profiles 3 steps of each configuration: per
kernel, launches and GPU time per step, against the event-timed step.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SHAPE, TENSORS = (8192, 16384), 8  # 1.07e9 elements
HIDDEN, FFN, VOCAB = 2048, 5632, 32000  # the 1.1B Llama's decoder layer (--adafactor)
ADAFACTOR = (
    "torch.Adafactor:foreach=True",
    "fusedopt.Adafactor:state_bits=32",
    "fusedopt.Adafactor:beta1=0.9",
    "fusedopt.Adafactor:beta1=0.9,state_bits=4",
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def layer_shapes(layers: int, embedding: bool) -> list[tuple[int, ...]]:
    """The parameters of ``layers`` decoder layers of the 1.1B Llama shape, a final norm, and its embedding."""
    per_layer = [(HIDDEN, HIDDEN)] * 2 + [(HIDDEN // 8, HIDDEN)] * 2 + [(FFN, HIDDEN)] * 2 + [(HIDDEN, FFN)]
    per_layer += [(HIDDEN,)] * 2
    shapes = per_layer * layers + [(HIDDEN,)]
    return ([(VOCAB, HIDDEN)] if embedding else []) + shapes


def step_bytes(config, dtype) -> float | None:
    """Bytes per element of one step by the byte model (each tensor read and written once), or None."""
    from fusedopt.profile.lineup import fusedopt_step_bytes
    from fusedopt.profile.planner import options_of

    kwargs = config.constructor_kwargs
    if config.optimizer == "torch.AdamW" and not kwargs.get("amsgrad"):
        return 7 * torch.finfo(dtype).bits / 8  # gradient, parameter, two moments in the parameter dtype
    if config.optimizer == "fusedopt.AdamW" and dtype == torch.bfloat16 and "state_format" not in kwargs:
        options = options_of(config.optimizer, kwargs)  # the constructor's defaults for options not given
        try:
            return fusedopt_step_bytes(options["state_bits"], options["master_weight_bits"])
        except (KeyError, ValueError):  # an option the optimizer refuses
            return None
    return None


def build(config, shapes, dtype, device, grad_scale: float, lr: float | None):
    """An optimizer over fresh parameters of ``shapes``, stepped twice (compiled, state allocated,
    launches prepared); a fusedopt configuration with a state format is built under the kernel backend."""
    if lr is not None and "lr" not in config.kwargs:
        config.kwargs["lr"] = lr
    triton = device == "cuda" and config.is_fusedopt and "state_format" in config.kwargs
    context = mock.patch.dict(os.environ, {"FUSEDOPT_BACKEND": "triton"}) if triton else contextlib.nullcontext()
    torch.manual_seed(0)
    with context:
        opt = config.build(harness.params_with_grads(shapes, device, dtype, grad_scale), device_type=device)
        for _ in range(2):
            opt.step()
    harness.sync(device)
    return opt


def kernel_times(opt, device, steps: int = 3) -> tuple[list[tuple[str, int, float]], float]:
    """Per kernel (name, launches per step, GPU us per step) of ``opt.step()`` under torch.profiler,
    and the event-timed step (ms) of the same steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ms = harness.time_ms(opt.step, steps, device)
    rows = [
        (e.key, e.count // steps, e.device_time_total / steps) for e in prof.key_averages() if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda row: -row[2]), ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5, help="timed steps per configuration and round (median)")
    parser.add_argument("--formats", nargs="*", default=(), help="also fusedopt AdamW with these state formats")
    parser.add_argument("--configs", nargs="*", default=(), help="also these fusedopt-profile --config strings")
    parser.add_argument(
        "--root-grid-tiles",
        nargs="*",
        default=(),
        help="also --formats, --configs built with these ELEMENTSxWARPS tiles (update.ROOT_GRID_TILE and "
        "ROOT_GRID_UNCORRECTED_TILE)",
    )
    parser.add_argument(
        "--block-tiles",
        nargs="*",
        default=(),
        help="also --formats, --configs built with these ELEMENTSxWARPS tiles of every block format "
        "(update.BLOCK and NUM_WARPS, update.NIBBLE_MASTER_TILE)",
    )
    parser.add_argument(
        "--constants",
        nargs="*",
        default=(),
        help="also --formats, --configs built with these kernels/update.py constants, each NAME=VALUE[,NAME=VALUE] "
        "(e.g. APPROXIMATE_DENOMINATOR=True)",
    )
    parser.add_argument("--lineup", nargs="*", default=(), help="also these line-up keys (plain steps)")
    parser.add_argument("--baseline", help="the configuration ratios are to (default: torch's fused AdamW)")
    parser.add_argument("--model", help="the parameters of this fusedopt.profile.models preset (e.g. 1b)")
    parser.add_argument("--shape", help=f"tensor shape ROWSxCOLS (default {SHAPE[0]}x{SHAPE[1]})")
    parser.add_argument("--tensors", type=int, default=TENSORS)
    parser.add_argument("--adafactor", action="store_true", help="Adafactor: fusedopt's against torch's")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 1.1B shape (--adafactor)")
    parser.add_argument("--embedding", action="store_true", help="with the 32000 x 2048 embedding (--adafactor)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    parser.add_argument("--lr", type=float, default=1e-4, help="lr of configurations without one (not Adafactor)")
    parser.add_argument("--kernels", action="store_true", help="then each configuration's kernel times per step")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu for a smoke test")
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args(argv)
    from fusedopt.kernels import update
    from fusedopt.profile import parse_config

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    if args.adafactor:
        shapes = layer_shapes(args.layers, args.embedding)
    elif args.model:
        shapes = harness.model_shapes(args.model)
    else:
        shapes = [tuple(int(x) for x in args.shape.lower().split("x")) if args.shape else SHAPE] * args.tensors
    elements = sum(math.prod(s) for s in shapes)
    print(f"{len(shapes)} {args.dtype} tensors, {elements:.4g} elements, {device}", flush=True)
    copy = harness.copy_gbps(device, elements)
    print(f"copy: {copy:.0f} GB/s", flush=True)
    names = {}  # name -> (OptimizerConfig, dtype, bytes per element)
    baseline = args.baseline or ("torch.Adafactor" if args.adafactor else "torch.AdamW:fused=True")
    default = "fusedopt.Adafactor" if args.adafactor else "fusedopt.AdamW"
    texts = [baseline, default, *(ADAFACTOR if args.adafactor else ())]
    texts += [f"fusedopt.AdamW:state_format='{f}'" for f in args.formats] + list(args.configs)
    for text in dict.fromkeys(texts):
        config = parse_config(text)
        names[config.label] = (config, dtype, step_bytes(config, dtype))
    variants = []  # (name suffix, the kernels/update.py constants a configuration is built under)
    for tile in args.root_grid_tiles:
        shape = tuple(int(x) for x in tile.split("x"))
        variants.append((f"tile {tile}", dict(ROOT_GRID_TILE=shape, ROOT_GRID_UNCORRECTED_TILE=shape)))
    for tile in args.block_tiles:
        elements, warps = (int(x) for x in tile.split("x"))
        variants.append(
            (f"block tile {tile}", dict(BLOCK=elements, NUM_WARPS=warps, NIBBLE_MASTER_TILE=(elements, warps)))
        )
    for text in args.constants:
        variants.append((text, {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in text.split(","))}))
    constants_of = {}  # name -> its variant's constants
    for suffix, constants in variants:
        for text in [f"fusedopt.AdamW:state_format='{f}'" for f in args.formats] + list(args.configs):
            config = parse_config(text)
            constants_of[f"{config.label} {suffix}"] = constants
            names[f"{config.label} {suffix}"] = (config, dtype, step_bytes(config, dtype))
    for entry in harness.select(",".join(args.lineup), "step") if args.lineup else ():
        if entry.release:
            raise SystemExit(f"line-up key {entry.key}: a release configuration has no optimizer step to time")
        config = entry.optimizer_config()
        names[f"{entry.label} [{entry.key}]"] = (config, config.param_dtype(dtype), entry.step_bytes)
    optimizers, failed = {}, {}
    for name, (config, param_dtype, _) in names.items():
        why = config.unavailable(device)
        try:
            if why:
                raise RuntimeError(why)
            lr = None if config.optimizer.endswith("Adafactor") else args.lr
            constants = constants_of.get(name)  # an older fusedopt may lack them
            with mock.patch.multiple(update, **constants, create=True) if constants else contextlib.nullcontext():
                optimizers[name] = build(config, shapes, param_dtype, device, 1e-2 if args.adafactor else 1.0, lr)
        except Exception as exc:  # one configuration failing must not end the run
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"{name}: not timed ({failed[name]})", flush=True)
    if not optimizers or next(iter(names)) not in optimizers:
        print("the baseline did not build: nothing to compare", file=sys.stderr)
        return 1
    times = harness.interleave({n: o.step for n, o in optimizers.items()}, args.rounds, args.reps, device)
    summary = harness.ratios(times, next(iter(optimizers)))
    print(f"{args.rounds} rounds, median of {args.reps} steps per configuration and round")
    rows = []
    for name, r in summary.items():
        nbytes = names[name][2]
        share = None if nbytes is None else nbytes * elements / (r["ms"] * 1e6) / copy
        r.update(bytes_per_element=nbytes, share_of_copy=share)
        rows.append([name, f"{r['ms']:.3f}", f"{r['ratio']:.4f}", f"{r['min']:.4f}", f"{r['max']:.4f}"])
        rows[-1].append(harness.fmt(share and 100 * share, ".0f") + ("%" if share else ""))
    headers = ["configuration", "median ms", f"ratio to {next(iter(optimizers))}: median", "min", "max", "% of copy"]
    print(harness.table(headers, rows))
    kernels = {}
    if args.kernels and device == "cuda":
        for name, opt in optimizers.items():
            rows, ms = kernel_times(opt, device)
            kernels[name] = dict(step_ms=ms, kernels=rows)
            busy = sum(us for _, _, us in rows) / 1e3
            print(f"\n{name}: step {ms:.3f} ms (event-timed, under the profiler), kernels {busy:.3f} ms")
            for key, count, us in rows[:6]:
                print(f"  {count:3d} x {key[:70]:70s} {us / 1e3:8.3f} ms per step")
    if args.out:
        settings = dict(device=device, tensors=len(shapes), elements=elements, dtype=args.dtype, model=args.model)
        settings.update(rounds=args.rounds, reps=args.reps, adafactor=args.adafactor)
        data = dict(settings=settings, env=harness.environment(), copy_GBps=copy, results=summary)
        data.update(failed=failed, kernels=kernels)
        harness.save(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
