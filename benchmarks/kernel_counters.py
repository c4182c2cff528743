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

Why: the work up to RESULTS block 7 could only time variants (``kernel_ablation.py``); whether
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
    from fusedopt.kernels import update

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_ablation import build_variant, variant_kernels
    from step_bandwidth import launch_constants

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

    try:
        for name in variants:
            source, _, cap = name.partition("@")  # base@64: the base kernel with at most 64 registers
            limits = launch_constants(update.BLOCK, update.NUM_WARPS, int(cap) if cap else None)
            with variant_kernels(build_variant(root, source)), limits:
                p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
                p.grad = torch.randn_like(p)
                opt = fusedopt.AdamW([p], lr=1e-4)
                profiled(f"fusedopt {name}: check, update", opt.step)
                del opt, p
    finally:
        shutil.rmtree(root, ignore_errors=True)
    p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    profiled("torch AdamW fused (bf16 state; several launches over chunks of the tensor)", opt.step)
    print("profiled launches, in order:")
    for i, name in enumerate(order):
        print(f"  {i}: {name}")
    print(f"elements per launch: {shape[0] * shape[1]}")


# metrics of ncu's raw page (Nsight Compute 2025.3 on the H200; names differ between versions)
TIME = "gpu__time_duration.sum"
DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
INSTRUCTIONS = "smsp__inst_executed.sum"  # warp instructions
PERCENTS = {
    "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "alu": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "fma": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "xu": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
_SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def summarize_csv(text: str, elements: int) -> list[str]:
    """One line per profiled kernel of ncu's ``--page raw --csv`` output, plus its stall samples."""
    rows = list(csv.reader(io.StringIO(text)))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}

    def value(row, metric):
        return _number(row[col[metric]]) * _SCALE.get(units[col[metric]], 1.0)

    lines = [f"{len(data)} kernels; elements per launch: {elements}; per element: DRAM bytes, thread instructions"]
    for row in data:
        t_us = value(row, TIME)
        dram = sum(value(row, m) for m in DRAM)
        instructions = _number(row[col[INSTRUCTIONS]]) * 32 / elements
        shares = "  ".join(f"{k} {_number(row[col[m]]):.0f}%" for k, m in PERCENTS.items() if m in col)
        lines.append(
            f"{row[col['Kernel Name']][:28]:28s} {t_us:8.1f} us  {dram / t_us / 1e6:5.2f} TB/s  "
            f"{dram / elements:5.2f} B/elem  {instructions:6.1f} instr/elem  {shares}"
        )
        stalls = [
            (_number(row[i]), name[len(STALL_PREFIX) :])
            for name, i in col.items()
            if name.startswith(STALL_PREFIX) and not name.endswith("_not_issued")
        ]
        stalls = [(v, name) for v, name in stalls if v == v and v > 0]
        total = sum(v for v, _ in stalls) or 1.0
        top = sorted(stalls, reverse=True)[:6]
        lines.append("    stall samples: " + ", ".join(f"{name} {100 * v / total:.0f}%" for v, name in top))
    return lines


def summarize(report: str, elements: int) -> None:
    if report.endswith(".csv"):  # an exported raw page
        with open(report) as f:
            text = f.read()
    else:
        ncu = shutil.which("ncu") or "ncu"
        text = subprocess.run([ncu, "-i", report, "--page", "raw", "--csv"], capture_output=True, text=True, check=True)
        text = text.stdout
    print("\n".join(summarize_csv(text, elements)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="base,floor", help="ablation variants; NAME@N: N registers")
    parser.add_argument("--elements", type=int, default=ROWS * COLS, help="a multiple of 16384")
    parser.add_argument("--summarize", metavar="REPORT", help="summarize an ncu report or its raw-page CSV")
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.elements)
        return 0
    run_kernels(args.variants.split(","), args.elements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
