"""Executed instructions, time and DRAM bytes per element of each configuration's step kernels, under ncu.

    bash benchmarks/kernel_counters.sh          # each configuration of CONFIGS in its own ncu process
    python3 benchmarks/kernel_counters.py --summarize out/counters_*.csv

Under ncu (``--profile-from-start off --csv``, one process per configuration: ``kernel_counters.sh``)
this script steps each configuration (``fusedopt-profile --config`` strings; one bf16 tensor of
8192 x 16384) twice unprofiled, then once between ``cudaProfilerStart`` and ``cudaProfilerStop``, so
ncu profiles exactly that step's launches; it prints the order. ``--summarize`` reads ncu's CSV and
prints per configuration and kernel: launches, GPU time, executed thread instructions per element
and DRAM bytes per element (the dynamic counts that ``kernel_instructions.py``'s static ones
approximate). With ``STALLS=1`` the shell script also collects ``STALL_METRICS`` and the summary adds
per kernel (averaged over its launches by their time) how busy the issue slots were, the warps
active and eligible per scheduler and cycle, and why active warps did not issue (each reason as a
share of the warp-active cycles, largest first): what limits a kernel that is not memory-bound. With
``PIPES=1`` it collects ``PIPE_METRICS``: how busy each execution pipe was (instructions issued to it as a share of
its peak, over active cycles), so an issue-bound kernel's instruction cuts can aim at its busiest pipe.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

CONFIGS = (
    "torch.AdamW:fused=True",
    "fusedopt.AdamW",
    "fusedopt.AdamW:state_bits=4",
    "fusedopt.AdamW:state_format='norm2-root4'",
    "fusedopt.AdamW:state_format='norm2-root4',master_weight_bits=None",
    "fusedopt.AdamW:max_grad_norm=1.0",
    "fusedopt.Adafactor",
)
SHAPE = (8192, 16384)
MARK = "profiled configuration:"
STALL_REASONS = (
    "barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
    "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
    "short_scoreboard", "sleeping", "tex_throttle", "wait",
)  # fmt: skip
ISSUE_METRICS = (
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__warps_active.avg.per_cycle_active",
    "smsp__warps_eligible.avg.per_cycle_active",
)
STALL_METRICS = ISSUE_METRICS + tuple(f"smsp__warp_issue_stalled_{r}_per_warp_active.pct" for r in STALL_REASONS)
PIPES = ("alu", "fma", "xu", "lsu", "adu", "cbu", "uniform")
PIPE_METRICS = tuple(f"sm__inst_executed_pipe_{p}.avg.pct_of_peak_sustained_active" for p in PIPES)
RATES = STALL_METRICS + PIPE_METRICS  # per-launch rates: a kernel's is their average weighted by the launches' time


def run(configs) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness
    from step_speed import build

    from fusedopt.profile import parse_config

    for text in configs:
        config = parse_config(text)
        lr = None if config.optimizer.endswith("Adafactor") else 1e-4
        opt = build(config, [SHAPE], torch.bfloat16, "cuda", 1e-2 if "Adafactor" in text else 1.0, lr)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        opt.step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"{MARK} {text}", flush=True)
        del opt
        harness.sync("cuda")
        torch.cuda.empty_cache()


def summarize(paths: list[str]) -> None:
    """ncu's --csv outputs, one per configuration (run with ``--configs`` one at a time), as one table."""
    elements = SHAPE[0] * SHAPE[1]
    print("| configuration | kernel | launches | us | instructions per element | DRAM B per element |")
    print("|---|---|---|---|---|---|")
    stalls, pipes = [], []
    for path in paths:
        with open(path) as f:
            lines = f.read().splitlines()
        config = next((line.split(MARK, 1)[1].strip() for line in lines if MARK in line), path)
        launches = collections.OrderedDict()  # ncu's launch ID -> {metric: value}, and the kernel's name
        for r in csv.DictReader(line for line in lines if line.startswith('"')):
            entry = launches.setdefault(r["ID"], {"name": r["Kernel Name"].split("(")[0]})
            entry[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
        grouped = collections.OrderedDict()
        for entry in launches.values():
            g = grouped.setdefault(entry["name"], collections.Counter())
            g["launches"] += 1
            time = entry.get("gpu__time_duration.sum", 0.0)
            for k, v in entry.items():
                if k != "name":  # sums add up; a rate is weighted by the launch's time
                    g[k] += v * time if k in RATES else v
        for name, g in grouped.items():
            dram = g["dram__bytes_read.sum"] + g["dram__bytes_write.sum"]
            print(
                f"| {config} | {name[:48]} | {g['launches']} | {g['gpu__time_duration.sum'] / 1e3:.1f} | "
                f"{g['smsp__thread_inst_executed.sum'] / elements:.1f} | {dram / elements:.2f} |"
            )
            if any(m in g for m in STALL_METRICS) and g["gpu__time_duration.sum"] > 0:
                stalls.append((config, name, {m: g[m] / g["gpu__time_duration.sum"] for m in STALL_METRICS if m in g}))
            if any(m in g for m in PIPE_METRICS) and g["gpu__time_duration.sum"] > 0:
                time = g["gpu__time_duration.sum"]
                pipes.append((config, name, [g[m] / time if m in g else None for m in PIPE_METRICS]))
    if stalls:
        print("\n| configuration | kernel | issue active % | warps active / eligible per cycle | stalls, % |")
        print("|---|---|---|---|---|")
        for config, name, rates in stalls:
            issue, active, eligible = (rates.get(m, float("nan")) for m in ISSUE_METRICS)
            reasons = sorted(
                ((r, rates[f"smsp__warp_issue_stalled_{r}_per_warp_active.pct"]) for r in STALL_REASONS
                 if f"smsp__warp_issue_stalled_{r}_per_warp_active.pct" in rates),
                key=lambda kv: -kv[1],
            )  # fmt: skip
            top = ", ".join(f"{r} {v:.0f}" for r, v in reasons if v >= 1)
            print(f"| {config} | {name[:48]} | {issue:.0f} | {active:.2f} / {eligible:.2f} | {top} |")
    if pipes:
        print("\n| configuration | kernel | " + " | ".join(PIPES) + " |")
        print("|---|---|" + "---|" * len(PIPES))
        for config, name, shares in pipes:
            cells = " | ".join("-" if v is None else f"{v:.0f}" for v in shares)
            print(f"| {config} | {name[:48]} | {cells} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--summarize", nargs="+", metavar="CSV", help="read ncu's CSV outputs instead of running")
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args.configs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
