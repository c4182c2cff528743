"""Host time of one parameter's update, and where it goes (CUDA only; not a test).

    python benchmarks/launch_overhead.py [--params 200] [--numel 4096]

Times ``optimizer.step()`` over ``--params`` parameters per parameter, with small tensors so
the GPU is never the bottleneck: bucketed (the default, ``fusedopt/dispatch.py``), then with one
launch pair per parameter (``FUSEDOPT_BUCKET_MB=0``) with the kernels' direct launch
(``kernels/launcher.py``) and through Triton's own ``kernel[grid](...)``. Then a cProfile of the
bucketed ``step()``: which functions the host time goes to.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

import fusedopt
from fusedopt.kernels import update as kernel_update


def _per_call_us(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / reps * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=200)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shape, dtype = (args.numel,), torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=dtype)) for _ in range(args.params)]
    os.environ["FUSEDOPT_BUCKET_MB"] = "0"
    opt = fusedopt.AdamW(params, lr=1e-4)  # one launch pair per parameter
    del os.environ["FUSEDOPT_BUCKET_MB"]
    bucketed = fusedopt.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-4)
    for p, q in zip(params, bucketed.param_groups[0]["params"]):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    for o in (opt, bucketed):
        o.step()  # compile + state
        o.step()  # prepared launches, buckets
    results = {}
    results["bucketed_step_us_per_param"] = _per_call_us(bucketed.step, args.reps) / args.params
    results["step_us_per_param"] = _per_call_us(opt.step, args.reps) / args.params

    # the same through Triton's own launch path (kernel[grid](...)) for comparison
    launchers = kernel_update._launch_check, kernel_update._launch_update
    usable = [launcher.usable for launcher in launchers]
    try:
        for launcher in launchers:
            launcher.usable = False
        results["step_us_per_param_through_triton"] = _per_call_us(opt.step, args.reps) / args.params
    finally:
        for launcher, was in zip(launchers, usable):
            launcher.usable = was

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        bucketed.step()
    torch.cuda.synchronize()
    profiler.disable()
    print(json.dumps(results, indent=2))
    print("cProfile of 3 x step() over", args.params, "parameters (tottime)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, **vars(args), **results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
