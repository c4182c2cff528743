"""Optimizer step time of fusedopt.Adafactor against torch.optim.Adafactor on the same tensors (CUDA).

The parameters are the matrices and vectors of Llama-style decoder layers (TinyLlama 1.1B's sizes by
default), with fixed random gradients; each configuration steps ``--warmup`` times, then ``--iters``
timed steps (CUDA events around the whole loop, which includes the host work). torch.optim.Adafactor
runs its single-tensor loop (its default) and, as a second baseline, ``foreach=True``. Printed: ms per
step and the ratio to torch's default; ``--json PATH`` also writes them.

    python benchmarks/adafactor_step.py            # 4 layers of the 1.1B shapes
    python benchmarks/adafactor_step.py --quick    # 1 layer, few iterations: a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import fusedopt

HIDDEN, FFN, VOCAB = 2048, 5632, 32000


def layer_shapes(layers: int, embedding: bool) -> list[tuple[int, ...]]:
    per_layer = [(HIDDEN, HIDDEN)] * 2 + [(HIDDEN // 8, HIDDEN)] * 2 + [(FFN, HIDDEN)] * 2 + [(HIDDEN, FFN)]
    per_layer += [(HIDDEN,)] * 2
    shapes = per_layer * layers + [(HIDDEN,)]
    return ([(VOCAB, HIDDEN)] if embedding else []) + shapes


CONFIGS = {
    "torch.Adafactor": lambda ps: torch.optim.Adafactor(ps),
    "torch.Adafactor(foreach)": lambda ps: torch.optim.Adafactor(ps, foreach=True),
    "fusedopt.Adafactor(state_bits=32)": lambda ps: fusedopt.Adafactor(ps, state_bits=32),
    "fusedopt.Adafactor": lambda ps: fusedopt.Adafactor(ps),
    "fusedopt.Adafactor(beta1=0.9)": lambda ps: fusedopt.Adafactor(ps, beta1=0.9),
    "fusedopt.Adafactor(beta1=0.9,state_bits=4)": lambda ps: fusedopt.Adafactor(ps, beta1=0.9, state_bits=4),
    "fusedopt.Adafactor(beta1=0.9,growth_limit=1.01)": lambda ps: fusedopt.Adafactor(ps, beta1=0.9, growth_limit=1.01),
}


def time_steps(make, shapes, dtype, warmup: int, iters: int) -> float:
    """ms per ``step()`` of a fresh optimizer over fresh parameters (same seed: the same tensors)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).to(dtype).requires_grad_() for s in shapes]
    grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) * 1e-2 for s in shapes]
    opt = make(params)
    for p, g in zip(params, grads):
        p.grad = g
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one layer, few iterations")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embedding", action="store_true", help="include the 32000 x 2048 embedding")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtypes", default="fp32,bf16", help="parameter dtypes, comma-separated")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("adafactor_step.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.quick:
        args.layers, args.iters, args.warmup = 1, 3, 2
    shapes = layer_shapes(args.layers, args.embedding)
    numel = sum(torch.Size(s).numel() for s in shapes)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    print(f"{len(shapes)} tensors, {numel / 1e6:.1f}M parameters, {torch.cuda.get_device_name()}")
    results = {}
    for name in args.dtypes.split(","):
        dtype = dtypes[name]
        rows = {}
        for label, make in CONFIGS.items():
            rows[label] = time_steps(make, shapes, dtype, args.warmup, args.iters)
            torch.cuda.empty_cache()
        base = rows["torch.Adafactor"]
        print(f"\n{name} parameters")
        print(f"{'optimizer':50s} {'ms/step':>9s} {'vs torch':>9s}")
        for label, ms in rows.items():
            print(f"{label:50s} {ms:9.3f} {ms / base:9.3f}")
        results[name] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shapes": shapes, "iters": args.iters, "ms_per_step": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
