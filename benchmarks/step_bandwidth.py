"""Optimizer step time and achieved bandwidth for ~1e9 bf16 elements in large 2-D tensors (GPU).

Usage (on a CUDA machine):  python benchmarks/step_bandwidth.py [--out results.json] [--quick]

For each configuration: median time of a full ``opt.step()`` over 8 tensors of 8192 x 16384
(1.07e9 elements), the bytes it must move by the byte model below, and that over the time,
against a device-to-device copy measured in the same process (bytes read + written).
Also: host time per parameter of a step over many tiny parameters (launch overhead).

Byte models per element (read + write). The basic byte model: gradient 2,
parameter 2 + 2, correction 1 + 1 (int8) or 2 + 2 (int16), each 8-bit moment 1 + 1 and each 4-bit
moment 0.5 + 0.5, block scales (1 byte per 16 elements and moment) read + written: 12.25 B for the
default. "with check": the same plus the finite check's second read of the gradient (+2 B), which
the non-finite rule requires (a parameter with any non-finite gradient element is
left untouched, so the whole gradient is read before the first write). Under the basic model a
step that moved every byte at copy speed, check included, would reach 12.25 / 14.25 = 86% of copy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock

import torch

import fusedopt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from competitors import _fusedopt_bytes  # noqa: E402  (benchmarks/ is not a package)

SHAPE = (8192, 16384)
N_TENSORS = 8


def launch_constants(block: int, warps: int, maxnreg: int | None):
    """The update kernel's tile, warps and register cap for the optimizers built inside the block (a
    prepared update keeps the launch config it was built with; the module's values come back after)."""
    from fusedopt.kernels import update

    return mock.patch.multiple(update, BLOCK=block, NUM_WARPS=warps, MAX_REGISTERS=maxnreg)


def _time_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy (bytes read + written)."""
    src = torch.empty(2**31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = _time_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 2 / ms / 1e6


def fusedopt_bytes(state_bits: int, master_weight_bits, check_read: bool = True) -> float:
    """Bytes per element of a step; ``check_read=False``: the basic byte model."""
    return _fusedopt_bytes(state_bits, master_weight_bits) + (2 if check_read else 0)


def bench_config(name, make_opt, bytes_per_element, reps) -> dict:
    params = [torch.nn.Parameter(torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)) for _ in range(N_TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_opt(params)
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    ms = _time_ms(opt.step, reps)
    n = N_TENSORS * SHAPE[0] * SHAPE[1]
    result = dict(name=name, ms=ms, elements=n, bytes_per_element=bytes_per_element)
    result["GBps"] = bytes_per_element * n / ms / 1e6
    del opt, params
    torch.cuda.empty_cache()
    return result


def check_only_ms(reps: int) -> float:
    """The finite-check kernel alone over the same gradients (its share of a step)."""
    from fusedopt.kernels import update

    grads = [torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(N_TENSORS)]
    scratch = torch.zeros(update.SCRATCH_WORDS, dtype=torch.int32, device="cuda")
    step = torch.zeros((), device="cuda")
    skipped = torch.zeros((), dtype=torch.int64, device="cuda")
    n = grads[0].numel()
    _, check_args = update.pack_scalars(
        fusedopt.AdamW.kernel_scalars(dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01))
    )
    programs = -(-n // (update.CHECK_TILE * update.CHECK_TILES))

    config = update._check_config(False, True, False)

    def run():
        for g in grads:
            args = (g, g, scratch, step, skipped, g, g, n, *update.NO_GRAD_DELTAS, *check_args)  # g: no table, no scale
            update._launch_check(programs, args, config)

    run()
    torch.cuda.synchronize()
    return _time_ms(run, reps)


def host_overhead_us(n_params: int = 2000) -> dict:
    params = [torch.nn.Parameter(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = fusedopt.AdamW(params, lr=1e-3, min_compress_numel=0)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        opt.step()
    host = (time.perf_counter() - t0) / 5
    torch.cuda.synchronize()
    return dict(params=n_params, host_us_per_param=host / n_params * 1e6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time other tile sizes, warps and register caps")
    parser.add_argument("--host-only", action="store_true", help="only the host time per parameter")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    env = dict(
        torch=torch.__version__,
        triton=triton.__version__,
        device=torch.cuda.get_device_name(),
        fusedopt=fusedopt.__version__,
    )
    if args.host_only:
        print(f"host time per parameter {host_overhead_us()['host_us_per_param']:.1f} us", flush=True)
        return 0
    copy_gbps = copy_bandwidth()
    configs = [
        ("fusedopt 8-bit / 24 (default)", 8, 24),
        ("fusedopt 8-bit / None", 8, None),
        ("fusedopt 4-bit / 24", 4, 24),
        ("fusedopt 8-bit / 32", 8, 32),
        ("fusedopt 16-bit / None", 16, None),
        ("fusedopt 32-bit / 32", 32, 32),
    ]
    results = []
    for name, bits, master in configs:
        results.append(
            bench_config(
                name,
                lambda ps, b=bits, m=master: fusedopt.AdamW(ps, lr=1e-4, state_bits=b, master_weight_bits=m),
                fusedopt_bytes(bits, master),
                args.reps,
            )
        )
        results[-1]["design_bytes_per_element"] = fusedopt_bytes(bits, master, check_read=False)
        print(f"{name:34s} {results[-1]['ms']:8.3f} ms  {results[-1]['GBps']:7.0f} GB/s", flush=True)
    for name, kw in [("torch AdamW fused (bf16 state)", dict(fused=True)), ("torch AdamW foreach", dict(foreach=True))]:
        results.append(bench_config(name, lambda ps, kw=kw: torch.optim.AdamW(ps, lr=1e-4, **kw), 14, args.reps))
        print(f"{name:34s} {results[-1]['ms']:8.3f} ms  {results[-1]['GBps']:7.0f} GB/s", flush=True)
    # tile size and warps of the update kernel, on the default configuration
    sweep = []
    # (elements per program, warps, register cap); the default is 1024, 2, None (16 elements per thread)
    variants = ((1024, 4, None), (2048, 4, None), (512, 1, None), (2048, 8, None))
    variants = variants if args.sweep else ()
    for block, warps, maxnreg in variants:
        name = f"default, BLOCK={block}, warps={warps}, maxnreg={maxnreg}"
        try:
            with launch_constants(block, warps, maxnreg):
                r = bench_config(name, lambda ps: fusedopt.AdamW(ps, lr=1e-4), fusedopt_bytes(8, 24), args.reps)
        except Exception as error:  # an option this Triton does not take: report, go on
            print(f"{name}: failed: {type(error).__name__}: {error}", flush=True)
            continue
        r["design_bytes_per_element"] = fusedopt_bytes(8, 24, check_read=False)
        sweep.append(r)
        print(f"{r['name']:34s} {r['ms']:8.3f} ms  {r['GBps']:7.0f} GB/s", flush=True)
    results.extend(sweep)
    check_ms = check_only_ms(args.reps)
    print(f"finite check alone (reads the gradient once): {check_ms:.3f} ms", flush=True)
    overhead = host_overhead_us()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; host time per parameter {overhead['host_us_per_param']:.1f} us")
    print(
        "\n| configuration | ms / step | bytes/elem: basic, with check | GB/s (with check) "
        "| % of copy: basic model | % of copy: with check |\n|---|---|---|---|---|---|"
    )
    for r in results:
        r["fraction_of_copy"] = r["GBps"] / copy_gbps
        design_bytes = r.get("design_bytes_per_element", r["bytes_per_element"])  # torch: no check pass
        r["design_fraction_of_copy"] = design_bytes * r["elements"] / r["ms"] / 1e6 / copy_gbps
        cells = [r["name"], f"{r['ms']:.3f}", f"{design_bytes:.2f}, {r['bytes_per_element']:.2f}", f"{r['GBps']:.0f}"]
        cells += [f"{100 * r['design_fraction_of_copy']:.0f}%", f"{100 * r['fraction_of_copy']:.0f}%"]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            summary = dict(env=env, copy_GBps=copy_gbps, results=results, host_overhead=overhead, check_ms=check_ms)
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
