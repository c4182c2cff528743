"""Where the update kernel's time goes: time variants that leave one stage out (GPU).

Usage (CUDA machine, repo root):  python benchmarks/kernel_ablation.py [--out ablation.json]

No hardware counters are needed: each variant is a copy of ``kernels/`` with one stage
replaced by a trivial stand-in (the results are wrong, only their time matters), timed on the
default configuration (bf16 params, 8-bit moments, int8 correction) over 1.07e9 elements.
The time a stage costs is the base time minus the variant's. Variants:

  nohash     the per-element hash returns its input (no fmix32)
  noencode   moments stored as a plain byte cast (no absmax, scale, stochastic rounding)
  nodecode   codes read as plain values (no scale, level or sign)
  noscale    block scales computed but not stored
  noround    nearest instead of stochastic rounding of the moments (the draw is not used)
  fastmath   approximate sqrt and division instead of IEEE sqrt_rn / div_rn (RESULTS block 5:
             -0.19 ms, but masters then differ from the reference by up to ~1e-5 relative on
             the H200, beyond one update's fp32 round-off: not taken)
  nomaster   parameter written with stochastic rounding instead of head + correction
  floor      all of the above: loads, fp32 math and stores only
  nobarrier  without the block barrier that makes every load issue before the arithmetic
             (a candidate, not a stand-in: its results are right)

With ``--state-format norm2-log4`` (or another log-grid format) also: lgnogather (levels from
arithmetic instead of the table), lgnorefit (no fresh grid: out-of-grid values are rounded on the
decayed one; slower than the base since each block is rounded once, so it no longer isolates the
refit's cost), lgnofp64 (the stochastic decision and the fresh grid in fp32), nmfast (approximate
division and square root in the normalised first moment), lgcheap (a stand-in for a format whose
code comes from the exponent bits, rounded in the log domain: what a cheaper encode could save),
lgcheapnm (with nmfast too). With ``--state-format norm2-root4``: nmfast, nmnodiv (no division for
the normalised m's q = m / r), nmrawdraw / r4rawdraw (m's / v's draw from the shared word's fields,
without the second hash that spreads them over 24 bits). And launch variants that change only the configuration (results
right): w1 / w4 (warps per program), b256 / b512 / b2048 (elements per program), b512w4.

Variants named twice (e.g. base,nohash,base) are timed twice: the spread is the run's noise.
The RESULTS block 5's candidates are in the kernels now (benchmarks/RESULTS.md): the 1-D scale
store, the sign or-ed into the decoded bits, square levels without fix-up, and 8-bit minifloat
levels (which removed the square root: the nosqrt and sqrtround variants went with it). So is
the masterlean candidate (the bf16 master join on the head's fp32 pattern, branch
kernel-master-lean; SASS 1200 -> 1176): its variant went with it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
import tempfile

import torch

import fusedopt
from fusedopt.kernels import update as real_update
from fusedopt.kernels.launcher import DirectLauncher

KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")

_LOG_DOMAIN_ROUND = """@triton.jit
def _log_domain_round(y, tops, steps, u):
    bits, top_bits = y.to(tl.int32, bitcast=True), tops.to(tl.int32, bitcast=True)
    below_top = (top_bits[:, None] - bits).to(tl.float32) * (2.0**-23 * 32.0)
    t = LEVELS - below_top / tl.maximum(steps, 1).to(tl.float32)[:, None]
    return tl.where(y > 0, tl.minimum(tl.maximum(tl.floor(t + u), 1.0), LEVELS * 1.0).to(tl.int32), 0)


"""

EDITS = {
    "nohash": [
        ("hashing.py", "    return fmix32(x)\n", "    return x\n"),
        ("hashing.py", "    x *= 0x85EBCA6B\n    x ^= x >> 13\n    x *= 0xC2B2AE35\n    x ^= x >> 16\n    return x\n",
         "    return x\n"),  # tile_bits (the update kernel's hash)
    ],
    "noencode": [
        (
            "moments.py",
            "    elif FMT != 0:\n        # No tl.where",
            "    elif FMT != 0:\n        tl.store(ptr + offs, x.to(tl.uint8), mask=mask)\n"
            "    elif FMT == 99:\n        # No tl.where",
        )
    ],
    "nodecode": [
        ("moments.py", "tl.fma(shifted.to(tl.float32, bitcast=True), unit, -(2.0**M) * unit)", "codes.to(tl.float32)"),
        ("moments.py", "if SIGNED:\n            # the sign", "if FMT == 99:\n            # the sign"),
        ("moments.py", "if SIGNED and FMT == 8:\n            # the sign", "if FMT == 99:\n            # the sign"),
    ],
    "noscale": [("moments.py", "tl.store(scale_ptr + blocks, (e + 127).to(tl.uint8), mask=", "tl.where(True, 0, ")],
    "noround": [
        ("moments.py", "fraction_draw = (rbits >> (9 + M)).to(tl.int32)", "fraction_draw = 1 << (22 - M)"),
        ("moments.py", "(rbits >> 8).to(tl.int32)", "(1 << 23)"),  # the signed 8-bit encode's draw, top-aligned
    ],
    "fastmath": [("update.py", "tl.sqrt_rn(v)", "tl.sqrt(v)"), ("update.py", "tl.div_rn(m, denom)", "(m / denom)")],
    "nomaster": [("update.py", "QBLOCK),\n        MASTER,", "QBLOCK),\n        1,")],
    "nobarrier": [("update.py", "    tl.debug_barrier()\n", "")],
    # the log-grid second moment (--state-format norm2-log4 and the like)
    "lgnogather": [("loggrid.py", "tl.load(fractions_ptr + (j & 31))", "(1.0 - (j & 31).to(tl.float32) * 0.0216)")],
    "lgnorefit": [("loggrid.py", "if tl.min(fits.to(tl.int32), axis=0) == 0:", "if False:")],
    "lgnofp64": [
        ("loggrid.py", "u.to(tl.float64) * gap.to(tl.float64) < (y - low).to(tl.float64)", "u * gap < (y - low)"),
        ("loggrid.py", "tl.log2(tops.to(tl.float64) / smallest.to(tl.float64))", "tl.log2(tops / smallest)"),
    ],
    # a stand-in for a cheaper log-grid format: the code from the exponent bits, rounded stochastically
    # in the log domain (biased in value: a different format, not a faster kernel of this one)
    "lgcheap": [
        ("loggrid.py", "@triton.jit\ndef _fresh_grid(y):", _LOG_DOMAIN_ROUND + "@triton.jit\ndef _fresh_grid(y):"),
        ("loggrid.py", "rounded = _round_to_grid(y, new_tops, new_steps, u, fractions_ptr)",
         "rounded = _log_domain_round(y, new_tops, new_steps, u)"),
    ],
    "nmfast": [
        ("normalised.py", "tl.div_rn(x, r)", "(x / r)"),
        ("normalised.py", "tl.div_rn(1.0, tl.maximum(unit, _TINY))", "(1.0 / tl.maximum(unit, _TINY))"),
        ("update.py", "root = tl.where(mask, tl.sqrt_rn(frame), 0.0)", "root = tl.where(mask, tl.sqrt(frame), 0.0)"),
        ("update.py", "tl.where(mask, tl.sqrt_rn(v), 0.0), [NORM_ROWS", "tl.where(mask, tl.sqrt(v), 0.0), [NORM_ROWS"),
    ],
    # the normalised first moment and the root grid (--state-format norm2-root4)
    "nmnodiv": [("normalised.py", "tl.div_rn(x, r)", "(x * r)")],  # no division for q = m / r
    "nmrawdraw": [  # m's draw: its raw 12-bit field of the shared word, not remixed with the index
        ("update.py", "m_u = tl.where(mask, spread_uniform((shared >> 20) << 20, offs), 0.0)",
         "m_u = tl.where(mask, (shared >> 20).to(tl.float32) * (1.0 / 4096), 0.0)"),
    ],
    "r4rawdraw": [  # v's draw: the two moments' fields of the shared word (24 bits), not remixed
        ("update.py", "v_draws = tl.where(mask, spread_bits(((shared << 12) >> 20) << 20, offs), 0)",
         "v_draws = tl.where(mask, (shared >> 8).to(tl.int32), 0)"),
    ],
}  # fmt: skip
# variants of the launch configuration, not of the source: update.py's module constants, set while timed
RUNTIME = {
    "w1": dict(NUM_WARPS=1), "w4": dict(NUM_WARPS=4), "b512": dict(BLOCK=512), "b2048": dict(BLOCK=2048),
    "b256": dict(BLOCK=256), "b512w4": dict(BLOCK=512, NUM_WARPS=4),
}  # fmt: skip
EDITS["floor"] = [e for name in ("nohash", "noencode", "nodecode", "fastmath", "nomaster") for e in EDITS[name]]
EDITS["lgcheapnm"] = EDITS["lgcheap"] + EDITS["nmfast"]  # both stand-ins: a bound on what they could save


def build_variant(root: str, name: str):
    """A copy of kernels/ as package ``<name>_kernels`` with the variant's edits applied."""
    package = f"ablation_{name}"
    target = os.path.join(root, package)
    if os.path.exists(target):  # a variant named twice (a repeat of the base, for noise): same module
        return importlib.import_module(f"{package}.update")
    shutil.copytree(KERNELS_DIR, target)
    for filename in os.listdir(target):
        if filename.endswith(".py"):
            path = os.path.join(target, filename)
            with open(path) as f:
                text = f.read().replace("fusedopt.kernels", package)
            with open(path, "w") as f:
                f.write(text)
    for filename, old, new in EDITS.get(name.split("+")[0], []):
        path = os.path.join(target, filename)
        with open(path) as f:
            text = f.read()
        if old not in text:
            raise RuntimeError(f"variant {name}: the kernel source changed, edit not applicable in {filename}")
        with open(path, "w") as f:
            f.write(text.replace(old, new))
    return importlib.import_module(f"{package}.update")


@contextlib.contextmanager
def variant_kernels(variant):
    """Launch ``variant``'s check and update kernels (a module from :func:`build_variant`) inside the block."""
    original = real_update._launch_update, real_update._launch_check
    real_update._launch_update = DirectLauncher(variant._update_kernel, **real_update.UPDATE_ARGS)
    real_update._launch_check = DirectLauncher(variant._check_kernel, **real_update.CHECK_ARGS)
    try:
        yield
    finally:
        real_update._launch_update, real_update._launch_check = original


@contextlib.contextmanager
def launch_constants(values: dict):
    """Set ``fusedopt.kernels.update``'s launch constants (``NUM_WARPS``, ``BLOCK``) inside the block."""
    original = {name: getattr(real_update, name) for name in values}
    for name, value in values.items():
        setattr(real_update, name, value)
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(real_update, name, value)


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_bandwidth import bench_config, copy_bandwidth, fusedopt_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=10)
    default_variants = "base,nohash,noencode,nodecode,noscale,noround,fastmath,nomaster,floor"
    parser.add_argument("--variants", default=default_variants)
    parser.add_argument("--state-format", help="time fusedopt.AdamW with this state_format (default: state_bits=8)")
    args = parser.parse_args(argv)
    kwargs = {"state_format": args.state_format} if args.state_format else {}
    per_element = None if args.state_format else fusedopt_bytes(8, 24)  # the byte model knows the default only
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    copy_gbps = copy_bandwidth()
    root = tempfile.mkdtemp(prefix="fusedopt_ablation_")
    sys.path.insert(0, root)
    results = []
    try:
        for name in args.variants.split(","):
            source = name if name in EDITS else "base"
            with variant_kernels(build_variant(root, source)), launch_constants(RUNTIME.get(name, {})):
                r = bench_config(name, lambda ps: fusedopt.AdamW(ps, lr=1e-4, **kwargs), per_element or 0.0, args.reps)
            r["fraction_of_copy"] = r["GBps"] / copy_gbps
            results.append(r)
            share = f"{r['GBps']:7.0f} GB/s  {100 * r['fraction_of_copy']:4.0f}% of copy"
            print(f"{name:10s} {r['ms']:8.3f} ms  {share}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = next((r["ms"] for r in results if r["name"] == "base"), None)
    if base is not None:
        print("\n| variant | ms | saved vs base (ms) | % of copy |\n|---|---|---|---|")
        for r in results:
            print(f"| {r['name']} | {r['ms']:.3f} | {base - r['ms']:.3f} | {100 * r['fraction_of_copy']:.0f}% |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_GBps=copy_gbps, results=results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
