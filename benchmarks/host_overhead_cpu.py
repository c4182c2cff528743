"""Python host time of one parameter update, on any machine (no GPU): fusedopt's own code with
the two kernel launches stubbed out, and the direct launcher's per-launch work with a stand-in
compiled kernel. Complements benchmarks/launch_overhead.py (the real thing, CUDA only).

    python benchmarks/host_overhead_cpu.py [--params 200] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("FUSEDOPT_BACKEND", "triton")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.kernels import update  # noqa: E402
from fusedopt.kernels.launcher import DirectLauncher, LaunchConfig  # noqa: E402


def fusedopt_python_us(n_params: int, reps: int, bucket_mb: str) -> float:
    """us per parameter of step() with both launches stubbed (after a first, unstubbed-like step),
    with ``FUSEDOPT_BUCKET_MB=bucket_mb`` (0: one launch pair per parameter)."""
    saved = update._launch_check, update._launch_update
    update._launch_check = update._launch_update = _NoLaunch()
    os.environ["FUSEDOPT_BUCKET_MB"] = bucket_mb
    try:
        params = [torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)) for _ in range(n_params)]
        opt = fusedopt.AdamW(params, lr=1e-4, min_compress_numel=0)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # builds the prepared launches
        opt.step()  # builds the buckets
        t0 = time.perf_counter()
        for _ in range(reps):
            opt.step()
        return (time.perf_counter() - t0) / reps / n_params * 1e6
    finally:
        update._launch_check, update._launch_update = saved


class _NoLaunch:
    """A launcher that launches nothing (and has no direct launch to remember)."""

    def __call__(self, grid, runtime_args, config):
        pass

    def resolve(self, runtime_args, config):
        return None


class _StandIn:
    """A @triton.jit function and its compiled kernel, as far as DirectLauncher sees them."""

    def __init__(self, names, constexprs):
        self.params = [SimpleNamespace(name=n, is_constexpr=n in constexprs) for n in names]
        self.device_caches = {}
        self.kernel = SimpleNamespace(run=lambda *args: None, function=0, packed_metadata=0)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel


def launcher_us(reps: int) -> float:
    """us per launch of the update kernel's argument layout (``update.UPDATE_ARGS``: its tensors, keyed
    and unkeyed ints, 8 floats, 26 constexprs): building the key each time, and a resolved launch
    (``launch_resolved``)."""
    tensors, ints, unkeyed = (update.UPDATE_ARGS[k] for k in ("tensors", "ints", "unkeyed_ints"))
    names = [f"t{i}" for i in range(tensors)] + [f"i{i}" for i in range(ints)] + [f"f{i}" for i in range(8)]
    constexprs = [f"C{i}" for i in range(26)]
    launch = DirectLauncher(_StandIn(names + constexprs, constexprs), **update.UPDATE_ARGS)
    launch._device = lambda first: 0  # CPU tensors as if on CUDA device 0
    launch._stream = lambda device: 0
    torch.cuda.current_device = lambda: 0
    config = LaunchConfig({c: i for i, c in enumerate(constexprs)}, {"num_warps": 4})
    keyed = (4096, 2048, 123456789, 3000000000, 7, 11, 13)[: ints - unkeyed]  # int32 and int64 values
    args = tuple(torch.randn(64) for _ in range(tensors)) + keyed + update.NO_GRAD_DELTAS[:unkeyed]
    args += tuple(float(i) for i in range(8))
    launch(1, args, config)  # the first launch goes "through Triton" and fills the cache
    t0 = time.perf_counter()
    for _ in range(reps * 1000):
        launch(1, args, config)
    keyed = (time.perf_counter() - t0) / (reps * 1000) * 1e6
    resolved = launch.resolve(args, config)
    t0 = time.perf_counter()
    for _ in range(reps * 1000):
        launch.launch_resolved(resolved, 1, args)
    return keyed, (time.perf_counter() - t0) / (reps * 1000) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=200)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    python_us = fusedopt_python_us(args.params, args.reps, "0")
    bucketed_us = fusedopt_python_us(args.params, args.reps, "32")
    keyed_us, launch_us = launcher_us(args.reps)
    print(f"fusedopt Python per update (launches stubbed): {python_us:.1f} us")
    print(f"  the same, bucketed (16 per launch pair):     {bucketed_us:.1f} us")
    print(f"direct launcher per launch (stand-in kernel):  {keyed_us:.1f} us with the key, {launch_us:.1f} us resolved")
    print(f"per parameter (two resolved launches):        {python_us + 2 * launch_us:.1f} us")
    print(f"per parameter, bucketed:                      {bucketed_us + 2 * launch_us / 16:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
