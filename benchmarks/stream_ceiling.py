"""How fast each format's step could run if it were only its memory traffic: the update's streams,
read and written as the update kernel reads and writes them, with no arithmetic, timed in one process
with a device-to-device copy, torch's fused AdamW and fusedopt's steps.

    python benchmarks/stream_ceiling.py                          # GPU: every format, 2 x 8192 x 16384 elements
    python benchmarks/stream_ceiling.py --tiles 1024x2 4096x4 --extra 0 32 64 96
    TRITON_INTERPRET=1 python benchmarks/stream_ceiling.py --device cpu --elements 8192 --rounds 1 --reps 1  # smoke

A format's streams (``STREAMS``) are its gradient (read) and every tensor its update reads and writes:
the parameter, its correction, the moments' codes and their block scales, each at its bytes per element.
``_streams_kernel`` gives each program a tile of elements and, for every stream, loads the tile's part
(as the update does: one contiguous run per stream), flips one bit (the parameter takes the gradient's
bits, so no load is dead) and stores it back. With ``--extra N`` each element also runs a chain of N
fp32 FMAs whose result reaches the parameter's store: the instructions an element can afford before
the traffic stops being the bound. Reported per configuration: the median ms over rounds (each the
median of ``--reps`` launches, configurations interleaved as in ``step_speed.py``), the share of the
copy's bandwidth by the format's bytes, and the ratio to torch's fused AdamW in the same round. With
``--kernels``, each configuration's kernels under torch.profiler: GPU time per step and kernel, the
update's own share of copy (the finite check reads the gradient again, beyond the format's bytes).

A skeleton at copy speed says the layout is not what holds the format back; one well below it says no
kernel with that layout and tile can reach the copy's bandwidth.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import step_speed  # noqa: E402

from fusedopt.profile import parse_config  # noqa: E402

# stream: (name, dtype, elements per stored item); every stream is read and written, the gradient only read
STREAMS = {
    "torch fused AdamW, bf16 state": [
        ("param", torch.int16, 1), ("exp_avg", torch.int16, 1), ("exp_avg_sq", torch.int16, 1),
    ],
    "default": [
        ("param", torch.int16, 1), ("correction", torch.int8, 1), ("m codes", torch.uint8, 1),
        ("m scales", torch.uint8, 16), ("v codes", torch.uint8, 1), ("v scales", torch.uint8, 16),
    ],
    "block4": [
        ("param", torch.int16, 1), ("correction", torch.int8, 1), ("m codes", torch.uint8, 2),
        ("m scales", torch.uint8, 16), ("v codes", torch.uint8, 2), ("v scales", torch.uint8, 16),
    ],
    "norm2-root4": [
        ("param", torch.int16, 1), ("correction", torch.int8, 1), ("m codes", torch.uint8, 4),
        ("m scales", torch.int16, 64), ("v codes", torch.uint8, 2), ("v units", torch.int32, 128),
    ],
    "norm2-root4, no correction": [
        ("param", torch.int16, 1), ("m codes", torch.uint8, 4), ("m scales", torch.int16, 64),
        ("v codes", torch.uint8, 2), ("v units", torch.int32, 128),
    ],
}  # fmt: skip
# the fusedopt step each skeleton is the traffic of (fusedopt-profile --config), and torch's
STEPS = {
    "torch fused AdamW, bf16 state": "torch.AdamW:fused=True",
    "default": "fusedopt.AdamW",
    "block4": "fusedopt.AdamW:state_bits=4",
    "norm2-root4": "fusedopt.AdamW:state_format='norm2-root4'",
    "norm2-root4, no correction": "fusedopt.AdamW:state_format='norm2-root4',master_weight_bits=None",
}
MAX_STREAMS = 6


def bytes_per_element(streams) -> float:
    """Bytes a step moves per element: the gradient read, every stream read and written."""
    return 2 + sum(2 * dtype.itemsize / per for _, dtype, per in streams)


@triton.jit
def _rmw(ptr, tile, n_items, ITEMS: tl.constexpr):
    """Load the tile's ``ITEMS`` items of a stream, flip their lowest bit, store them back."""
    if ITEMS > 0:
        i = tile * ITEMS + tl.arange(0, ITEMS)
        x = tl.load(ptr + i, mask=i < n_items)
        tl.store(ptr + i, x ^ 1, mask=i < n_items)


@triton.jit
def _streams_kernel(
    grad_ptr, param_ptr, s1, s2, s3, s4, s5, n_elements, n1, n2, n3, n4, n5,
    I1: tl.constexpr, I2: tl.constexpr, I3: tl.constexpr, I4: tl.constexpr, I5: tl.constexpr,
    TILE: tl.constexpr, EXTRA: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    offs = tile * TILE + tl.arange(0, TILE)
    mask = offs < n_elements
    g = tl.load(grad_ptr + offs, mask=mask, other=0)
    p = tl.load(param_ptr + offs, mask=mask)
    x = p ^ g
    if EXTRA > 0:  # a dependent FMA chain per element; its sign bit (always 0) reaches the store
        y = tl.abs(g.to(tl.bfloat16, bitcast=True).to(tl.float32))
        for _ in tl.static_range(EXTRA):
            y = tl.fma(y, 0.9990234375, 0.0009765625)
        x = x ^ (y.to(tl.int32, bitcast=True) >> 31).to(tl.int16)
    tl.store(param_ptr + offs, x, mask=mask)
    _rmw(s1, tile, n1, I1)
    _rmw(s2, tile, n2, I2)
    _rmw(s3, tile, n3, I3)
    _rmw(s4, tile, n4, I4)
    _rmw(s5, tile, n5, I5)


class Skeleton:
    """One format's streams over ``n`` elements, stepped by ``_streams_kernel`` on tiles of ``tile``."""

    def __init__(self, streams, n: int, device, tile: int, warps: int, extra: int = 0):
        if len(streams) > MAX_STREAMS or streams[0][0] != "param":
            raise ValueError("a skeleton takes the parameter first and at most 6 streams")
        if any(tile % per for _, _, per in streams):
            raise ValueError(f"a tile of {tile} elements does not hold whole items of every stream")
        self.grad = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device=device)
        self.tensors = [torch.zeros(math.ceil(n / per), dtype=dtype, device=device) for _, dtype, per in streams]
        # the launch's arguments, built once (the step is timed): unused slots point at the parameter, 0 items
        unused = MAX_STREAMS - len(streams)
        rest = self.tensors[1:] + [self.tensors[0]] * unused
        counts = [t.numel() for t in self.tensors[1:]] + [0] * unused
        items = [tile // per for _, _, per in streams[1:]] + [0] * unused
        self.args = (self.grad, self.tensors[0], *rest, n, *counts, *items)
        self.grid = (triton.cdiv(n, tile),)
        self.options = dict(TILE=tile, EXTRA=extra, num_warps=warps)

    def step(self):
        _streams_kernel[self.grid](*self.args, **self.options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=2 * 8192 * 16384)
    parser.add_argument("--formats", nargs="*", default=list(STREAMS), choices=list(STREAMS))
    parser.add_argument("--tiles", nargs="*", default=["1024x2"], help="ELEMENTSxWARPS of the skeleton's programs")
    parser.add_argument("--extra", nargs="*", type=int, default=[0], help="FMAs per element in the default's skeleton")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-steps", action="store_true", help="skeletons only (no optimizer steps)")
    parser.add_argument("--kernels", action="store_true", help="then each configuration's GPU time by kernel")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    copy = harness.copy_gbps(device, args.elements)
    print(f"{args.elements:.4g} elements, {device}; copy {copy:.0f} GB/s", flush=True)
    steppers, nbytes = {}, {}
    baseline = "torch fused AdamW, bf16 state"
    if not args.no_steps:
        rows = 2 if args.elements % (2 * 16384) == 0 else 1
        shapes = [(args.elements // (rows * 16384) or 1, 16384 if args.elements >= 16384 else args.elements)] * rows
        for name in [baseline] + [f for f in args.formats if f != baseline]:
            config = parse_config(STEPS[name])
            steppers[f"step: {name}"] = step_speed.build(config, shapes, torch.bfloat16, device, 1.0, 1e-4)
            nbytes[f"step: {name}"] = bytes_per_element(STREAMS[name])
    for name in args.formats:
        for tile in args.tiles:
            elements, warps = (int(x) for x in tile.split("x"))
            for extra in args.extra if name == "default" else [0]:
                label = f"streams: {name}, {tile}" + (f", {extra} FMAs" if extra else "")
                steppers[label] = Skeleton(STREAMS[name], args.elements, device, elements, warps, extra)
                nbytes[label] = bytes_per_element(STREAMS[name])
    for stepper in steppers.values():  # compiled, state built
        stepper.step()
        stepper.step()
    harness.sync(device)
    times = harness.interleave({name: s.step for name, s in steppers.items()}, args.rounds, args.reps, device)
    ref = f"step: {baseline}" if f"step: {baseline}" in steppers else next(iter(steppers))
    summary = harness.ratios(times, ref)
    rows = []
    for name, r in summary.items():
        share = nbytes[name] * args.elements / (r["ms"] * 1e6) / copy
        r.update(bytes_per_element=nbytes[name], share_of_copy=share)
        rows.append([name, f"{nbytes[name]:.4g}", f"{r['ms']:.3f}", f"{100 * share:.0f}%", f"{r['ratio']:.3f}"])
    print(harness.table(["configuration", "B/element", "median ms", "% of copy", f"ratio to {ref}"], rows))
    kernels = {}
    if args.kernels and device == "cuda":
        rows = []
        for name, stepper in steppers.items():
            per_kernel, _ = step_speed.kernel_times(stepper, device)
            kernels[name] = per_kernel
            for key, count, us in per_kernel:
                share = nbytes[name] * args.elements / (us * 1e3) / copy
                rows.append([name, key[:60], str(count), f"{us:.1f}", f"{100 * share:.0f}%"])
        print(harness.table(["configuration", "kernel", "launches", "GPU us per step", "format bytes / copy"], rows))
    if args.out:
        settings = dict(device=device, elements=args.elements, tiles=args.tiles, extra=args.extra)
        settings.update(rounds=args.rounds, reps=args.reps)
        data = dict(settings=settings, env=harness.environment(), copy_GBps=copy, results=summary, kernels=kernels)
        harness.save(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
