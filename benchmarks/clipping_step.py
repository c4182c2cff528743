"""What clipping adds to an optimizer step without gradient release (``fused=False``): one
``step()`` over large bf16 tensors with and without ``max_grad_norm``, in one process, in
alternating rounds, as a ratio; torch's fused AdamW with and without ``clip_grad_norm_`` beside it.

    python benchmarks/clipping_step.py                   # GPU: 64 x 4096 x 4096 bf16 (1.07e9 elements)
    python benchmarks/clipping_step.py --tensors 2 --shape 256x512 --device cpu   # smoke test

Each configuration has its own parameters and gradients (random, kept across steps); a step is
timed with CUDA events, median of ``--reps`` per round; the ratio per round is clipped / unclipped
of the same optimizer. ``max_grad_norm`` is small enough that every step clips.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import fusedopt  # noqa: E402


def _torch_clipped(params, max_norm):
    opt = torch.optim.AdamW(params, lr=1e-5, fused=params[0].is_cuda)

    class Clipped:
        def step(self):
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()

    return Clipped()


CONFIGS = {
    "fusedopt default": lambda ps: fusedopt.AdamW(ps, lr=1e-5),
    "fusedopt default, max_grad_norm": lambda ps: fusedopt.AdamW(ps, lr=1e-5, max_grad_norm=1e-3),
    "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=ps[0].is_cuda),
    "torch AdamW (fused) + clip_grad_norm_": lambda ps: _torch_clipped(ps, 1e-3),
}
PAIRS = (
    ("fusedopt default, max_grad_norm", "fusedopt default"),
    ("torch AdamW (fused) + clip_grad_norm_", "torch AdamW (fused)"),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", nargs="+", help="configurations whose name contains one of these")
    parser.add_argument("--profile", action="store_true", help="then one step of each under torch.profiler")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    shape = tuple(int(x) for x in args.shape.split("x"))
    gen = torch.Generator(device=args.device).manual_seed(0)
    configs = {k: v for k, v in CONFIGS.items() if not args.only or any(w in k for w in args.only)}
    trials = {}
    for name, make in configs.items():
        params = [
            torch.nn.Parameter(torch.randn(shape, device=args.device, generator=gen).to(torch.bfloat16))
            for _ in range(args.tensors)
        ]
        for p in params:
            p.grad = torch.randn(shape, device=args.device, generator=gen).to(torch.bfloat16)
        opt = make(params)
        opt.step()  # first step: state, compilation
        trials[name] = opt
    # in turns, the order rotated every round; each round's time is the median of --reps steps
    times = harness.interleave({n: o.step for n, o in trials.items()}, args.rounds, args.reps, args.device, "rotate")
    trials = {name: (opt, times[name]) for name, opt in trials.items()}
    elements = args.tensors * shape[0] * shape[1]
    print(f"{args.tensors} x {args.shape} bf16 ({elements:.3g} elements), {args.rounds} rounds x {args.reps} steps")
    print("| configuration | step ms (median of rounds) | per round |")
    print("|---|---|---|")
    for name, (_, times) in trials.items():
        print(f"| {name} | {statistics.median(times):.3f} | {' / '.join(f'{t:.2f}' for t in times)} |")
    ratios = {}
    for a, b in PAIRS:
        if a in trials and b in trials:
            per_round = [x / y for x, y in zip(trials[a][1], trials[b][1])]
            ratios[f"{a} / {b}"] = statistics.median(per_round)
            print(
                f"{a} / {b}: {statistics.median(per_round):.3f} (per round {' / '.join(f'{x:.3f}' for x in per_round)})"
            )
    if args.profile:  # where a step's GPU time goes: one more step of each under torch.profiler
        from torch.profiler import ProfilerActivity, profile

        for name, (opt, _) in trials.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                opt.step()
                torch.cuda.synchronize()
            print(f"{name}: GPU time per kernel")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, elements=elements, times={k: v[1] for k, v in trials.items()},
                           ratios=ratios), f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
