"""Host time of one parameter's update, and where it goes (CUDA only; not a test).

    python benchmarks/launch_overhead.py [--params 200] [--numel 4096]

Times, per parameter, with small tensors so the GPU is never the bottleneck:
  * ``optimizer.step()`` over ``--params`` parameters (the whole Python path);
  * the two Triton launches alone through ``JITFunction`` (``kernel[grid](...)``);
  * the same two kernels through their compiled launcher (``CompiledKernel.run``), skipping
    Triton's per-call argument binding and cache lookup: the floor a launch plan could reach.
Then a cProfile of ``step()``: which functions the rest goes to.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import torch

import fusedopt
from fusedopt.kernels import update as kernel_update


class _Recorder:
    """Stands in for a JITFunction for one call: records (grid, args, kwargs), then launches."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.fn, grid, args, kwargs))
            return self.fn[grid](*args, **kwargs)

        return launch


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
    opt = fusedopt.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # compile + state
    results = {}
    results["step_us_per_param"] = _per_call_us(opt.step, args.reps) / args.params

    # record the two launches of one parameter, then replay them
    calls = []
    saved = kernel_update._check_kernel, kernel_update._update_kernel
    kernel_update._check_kernel = _Recorder(saved[0], calls)
    kernel_update._update_kernel = _Recorder(saved[1], calls)
    try:
        opt.update_param(params[0], params[0].grad)
    finally:
        kernel_update._check_kernel, kernel_update._update_kernel = saved

    def jit_launches():
        for fn, grid, a, kw in calls:
            fn[grid](*a, **kw)

    results["jit_two_launches_us"] = _per_call_us(jit_launches, 2000)

    try:  # Triton internals (3.x): the compiled kernel and the bound arguments
        compiled = []
        for fn, grid, a, kw in calls:
            kernel = fn.run(*a, grid=grid, warmup=True, **kw)
            device = torch.cuda.current_device()
            binder = fn.device_caches[device][-1]
            bound = binder(*a, **kw)[0]
            compiled.append((kernel, grid, tuple(bound.values())))
        stream = torch.cuda.current_stream().cuda_stream

        def direct_launches():
            for kernel, grid, values in compiled:
                kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)

        results["direct_two_launches_us"] = _per_call_us(direct_launches, 2000)
    except Exception as exc:  # report, do not hide: this is the probe's question
        results["direct_error"] = f"{type(exc).__name__}: {exc}"

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        opt.step()
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
