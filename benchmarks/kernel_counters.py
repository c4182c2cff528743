"""Hardware counters of the update kernel (and its ablation variants) next to torch's fused AdamW.

Usage (CUDA machine with Nsight Compute, repo root; ``run_h200.sh counters`` does all of it):
  ncu --clock-control none --profile-from-start off --set full -o OUT/counters \\
      python3 benchmarks/kernel_counters.py [--variants base,floor] [--elements N]
  python3 benchmarks/kernel_counters.py --summarize OUT/counters.ncu-rep

The script runs each kernel once inside a ``cudaProfilerStart/Stop`` range (after warm-up
steps), so ncu profiles exactly those launches, in the order it prints. ``--summarize`` reads
the report back and prints, per launch: time, DRAM throughput, issue-slot use, executed
instructions per element (the dynamic count, which the static SASS count of
``kernel_sass.py`` only bounds) and the top warp-stall reasons.

Why: the sittings up to the seventh could only time variants (``kernel_ablation.py``); whether
the default step is bound by instruction issue, by latency or by memory decides what can
still bring it towards copy bandwidth.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile

ROWS, COLS = 8192, 16384  # one tensor of 1.34e8 elements (an eighth of step_bandwidth.py's step)


def run_kernels(variants: list[str], elements: int) -> None:
    import torch

    import fusedopt
    from fusedopt.kernels import update as real_update
    from fusedopt.kernels.launcher import DirectLauncher

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_ablation import build_variant

    root = tempfile.mkdtemp(prefix="fusedopt_counters_")
    sys.path.insert(0, root)
    shape = (elements // COLS, COLS)
    order = []

    def profiled(name, fn):
        for _ in range(2):  # warm-up (compiles, allocates state)
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        order.append(name)

    original = real_update._launch_update, real_update._launch_check
    try:
        for name in variants:
            variant = build_variant(root, name)
            real_update._launch_update = DirectLauncher(variant._update_kernel, **real_update.UPDATE_ARGS)
            real_update._launch_check = DirectLauncher(variant._check_kernel, **real_update.CHECK_ARGS)
            p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
            p.grad = torch.randn_like(p)
            opt = fusedopt.AdamW([p], lr=1e-4)
            profiled(f"fusedopt {name}: check, update", opt.step)
            del opt, p
    finally:
        real_update._launch_update, real_update._launch_check = original
        shutil.rmtree(root, ignore_errors=True)
    p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    profiled("torch AdamW fused (bf16 state)", opt.step)
    src = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    profiled("copy (same elements, bf16)", lambda: dst.copy_(src))
    print("profiled launches, in order:")
    for i, name in enumerate(order):
        print(f"  {i}: {name}")
    print(f"elements per launch: {shape[0] * shape[1]}")


# metric name in ncu's raw page -> column of the summary
METRICS = {
    "gpu__time_duration.sum": "time",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "dram__bytes.sum": "dram bytes",
    "sm__inst_executed.sum": "warp instr",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "regs",
}
STALL_PREFIX = "smsp__average_warp_latency_issue_stalled_"
STALL_PREFIX_ALT = "smsp__pcsamp_warps_issue_stalled_"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(report: str, elements: int) -> None:
    ncu = shutil.which("ncu") or "ncu"
    raw = subprocess.run([ncu, "-i", report, "--page", "raw", "--csv"], capture_output=True, text=True, check=True)
    rows = list(csv.reader(io.StringIO(raw.stdout)))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    print(f"{len(data)} kernels in {report}; elements per launch: {elements}")
    for row in data:
        name = row[col["Kernel Name"]][:40]
        values = {label: _number(row[col[m]]) if m in col else None for m, label in METRICS.items()}
        unit = units[col["gpu__time_duration.sum"]]
        t = values["time"]
        t_us = t / 1000 if unit == "nsecond" else (t * 1000 if unit == "msecond" else t)
        per_elem = values["warp instr"] * 32 / elements if values["warp instr"] else float("nan")
        print(
            f"{name:40s} {t_us:9.1f} us  dram {values['dram %']}%  issue {values['issue %']}%  "
            f"occupancy {values['occupancy %']}%  regs {values['regs']}  thread-instr/elem {per_elem:.1f}"
        )
        stalls = []
        for metric, i in col.items():
            for prefix in (STALL_PREFIX_ALT,):
                if metric.startswith(prefix) and metric.endswith(".sum") and "not_issued" not in metric:
                    v = _number(row[i])
                    if v:
                        stalls.append((v, metric[len(prefix) :]))
        total = sum(v for v, _ in stalls) or 1.0
        top = sorted(stalls, reverse=True)[:6]
        print("    stall samples: " + ", ".join(f"{n} {100 * v / total:.0f}%" for v, n in top))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="base,floor", help="kernel_ablation.py variants, comma-separated")
    parser.add_argument("--elements", type=int, default=ROWS * COLS, help="a multiple of 16384")
    parser.add_argument("--summarize", metavar="REPORT", help="print the summary of an ncu report instead")
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.elements)
        return 0
    run_kernels(args.variants.split(","), args.elements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
