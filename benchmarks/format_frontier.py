"""The state formats' memory-quality frontier: peak memory of a training step on the 1.1B Llama shape
(micro-batch 1 x 1024, activation checkpointing, bf16, gradient release where the optimizer has it)
against the held-out loss difference to fusedopt's 8-bit default on the paired-seed quality
benchmark (``format_quality.py``). Runs anywhere (no GPU): it reads results.

    python benchmarks/format_frontier.py --quality out/quality.json --memory out/memory_a.json [...] \\
        --png out/frontier.png

(The inputs of the published frontier, in git history at commit ``d7917bc``:
``benchmarks/results/format-quality/h200-lr1.5e-3.json`` for quality, and ``issue6/memory_a.json``,
``session-h200/memory_adafactor.json``, ``h200-2026-12-02b/call1/memory_a.json`` and
``h200-2026-12-02d/call2/memory_a.json`` under ``benchmarks/results/`` for the peaks.)

A configuration's peak is the measured one (``compare_memory.py --regime a``) where it was
measured (``MEASURED``), else the planner's prediction (``fusedopt-profile plan --model 1b``; drawn
hollow and marked "predicted" in the table). Its loss is the mean over seeds of the paired
difference to the default, with the per-seed range as the error bar.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import format_quality as fq  # noqa: E402

GIB = 1 << 30
# quality-benchmark key -> compare_memory key of the same optimizer on the 1.1B workload (with
# gradient release where it has it). fp32 AdamW's row is torch's: fp32 parameters and master.
MEASURED = {
    "fp32": "A",
    "bf16-rtn": "C",
    "default": "FOR",
    "block4": "FO4R",
    "block4-nomaster": "FO4NR",
    "rot4": "FOROT4R",
    "norm2-log4": "FONL4R",
    "norm2-log4-nomaster": "FONL4NR",
    "norm2-root4": "FONR4R",
    "norm2-root4-nomaster": "FONR4NR",
    "turboadam": "H",
    "adafactor-m4": "AFM4R",
    "adafactor-m8": "AFM8R",
    "adafactor": "AFR",
}
# fusedopt configurations without a measured peak: the planner's --config for them
PREDICTED = {
    "rot8": "fusedopt:fused=True,state_format='rot8'",
    "rot2": "fusedopt:fused=True,state_format='rot2'",
    "norm4-log4": "fusedopt:fused=True,state_format='norm4-log4'",
    "rot4-log4": "fusedopt:fused=True,state_format='rot4-log4'",
    "nomaster": "fusedopt:fused=True,master_weight_bits=None",
}


def measured_peaks(paths: list[str]) -> dict[str, int]:
    """compare_memory key -> peak bytes, over the given results files (later files win)."""
    peaks = {}
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        for key, row in rows.items() if isinstance(rows, dict) else ((r["key"], r) for r in rows):
            if row.get("ok") and row.get("peak"):
                peaks[key] = int(row["peak"])
    return peaks


def predicted_peak(config: str) -> int:
    from fusedopt.profile.planner import plan

    (row,) = plan(memory_gib=24.0, configs=[config], model="1b")
    return int(row.peak)


def points(quality: dict, peaks: dict[str, int]) -> list[dict]:
    """One point per configuration of the quality run that has a peak (measured or predicted)."""
    runs = quality["runs"]
    seeds = sorted({r["seed"] for r in runs})
    rows = {r["key"]: r for r in fq.summarise(runs, seeds, reference="default")}
    out = []
    for key, row in rows.items():
        if key in MEASURED and MEASURED[key] in peaks:
            peak, how = peaks[MEASURED[key]], "measured"
        elif key in PREDICTED:
            peak, how = predicted_peak(PREDICTED[key]), "predicted"
        else:
            continue
        diffs = row["diff_pct"] if key != "default" else [0.0]
        out.append(
            {
                "key": key,
                "label": row["label"],
                "peak_gib": peak / GIB,
                "peak_from": how,
                "diff_pct": statistics.fmean(diffs),
                "low": min(diffs),
                "high": max(diffs),
                "seeds": len(row["diff_pct"]),
            }
        )
    return sorted(out, key=lambda p: p["peak_gib"])


def table(pts: list[dict]) -> str:
    lines = [
        "| configuration | peak GiB (1.1B, micro-batch 1) | vs the 8-bit default (%), mean [per-seed range] | seeds |",
        "|---|---|---|---|",
    ]
    for p in pts:
        peak = f"{p['peak_gib']:.2f}" + (" (predicted)" if p["peak_from"] == "predicted" else "")
        lines.append(
            f"| {p['label']} | {peak} | {p['diff_pct']:+.2f} [{p['low']:+.2f}, {p['high']:+.2f}] | {p['seeds']} |"
        )
    return "\n".join(lines)


def plot(pts: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p in pts:
        hollow = p["peak_from"] == "predicted"
        ax.errorbar(
            p["peak_gib"],
            p["diff_pct"],
            yerr=[[p["diff_pct"] - p["low"]], [p["high"] - p["diff_pct"]]],
            fmt="o",
            mfc="white" if hollow else None,
            capsize=3,
        )
        ax.annotate(p["key"], (p["peak_gib"], p["diff_pct"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("peak GiB, 1.1B Llama shape, micro-batch 1 x 1024 (hollow: planner prediction)")
    ax.set_ylabel("held-out loss vs fusedopt's 8-bit default (%)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quality", required=True, help="format_quality.py results (JSON)")
    parser.add_argument("--memory", nargs="+", required=True, help="compare_memory.py --regime a results (JSON)")
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    with open(args.quality) as f:
        quality = json.load(f)
    pts = points(quality, measured_peaks(args.memory))
    print(table(pts))
    if args.png:
        s = quality["settings"]
        fewest, most = min(p["seeds"] for p in pts), max(p["seeds"] for p in pts)
        seeds = f"{most}" if fewest == most else f"{fewest}-{most}"
        title = f"{s['steps']} steps, lr {s['lr']:g}, {seeds} paired seeds (bars: range over seeds)"
        plot(pts, args.png, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
