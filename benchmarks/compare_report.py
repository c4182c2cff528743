"""Issue 6, the targets: the memory/quality frontier (peak of part 1a against held-out loss of
part 4) and a check of each target against the measured results. Runs anywhere (no GPU):

    python benchmarks/compare_report.py --dir out     # memory_a.json, quality.json, step.json (run_compare.sh's $OUT)

Gradient release does not change an optimizer's arithmetic (fusedopt's fused=True is bit-identical
to fused=False, FlashOptim and optimi run the same kernel in hooks, torch's in-backward pattern
is the same AdamW), so a release configuration takes the loss of its plain twin
(:data:`SAME_UPDATE`) on the frontier.
"""

from __future__ import annotations

import argparse
import os
import sys

import compare_io
from compare_quality import summary
from competitors import BY_KEY, REFERENCE

# release configuration -> the configuration with the same update (its loss in part 4)
SAME_UPDATE = {"C": "B", "G": "F", "I0": "I", "FOR": "FO", "FO4R": "FO4", "FO4NR": "FO4N"}
DEFAULT = "FO"


def frontier_points(memory: dict, quality: dict) -> dict[str, tuple[float, float]]:
    """key -> (peak bytes in part 1a, mean held-out loss in part 4)."""
    losses = {k: r["mean"] for k, r in summary(quality).items()}
    points = {}
    for key, row in compare_io.ok_rows(memory):
        loss = losses.get(key, losses.get(SAME_UPDATE.get(key, "")))
        if loss is not None:
            points[key] = (row["peak"], loss)
    return points


def check_targets(memory: dict | None, quality: dict | None, step: dict | None) -> list[str]:
    lines = []
    q = summary(quality) if quality else {}
    spread = None
    if REFERENCE in q and q[REFERENCE]["n"] > 1:
        spread = q[REFERENCE]["max"] - q[REFERENCE]["min"]
    if memory and quality:
        points = frontier_points(memory, quality)
        tol = spread or 0.0
        ours = {k: v for k, v in points.items() if k.startswith("FO")}
        for key, (peak, loss) in sorted(points.items()):
            if key.startswith("FO"):
                continue
            better = [k for k, (p, x) in ours.items() if p <= peak and x <= loss + tol]
            verdict = f"dominated by {', '.join(better)}" if better else "NOT dominated by any fusedopt configuration"
            lines.append(f"frontier: {key} (peak {peak / 2**30:.2f} GiB, loss {loss:.4f}): {verdict}")
        if DEFAULT in points and REFERENCE in q and spread is not None:
            ref = q[REFERENCE]["mean"]
            matching = [k for k, (_, x) in points.items() if not k.startswith("FO") and abs(x - ref) <= spread]
            for name in (DEFAULT, "FOR"):
                if name in points:
                    lowest = all(points[name][0] <= points[k][0] for k in matching)
                    lines.append(
                        f"default {name}: peak {points[name][0] / 2**30:.2f} GiB "
                        + ("is" if lowest else "is NOT")
                        + f" the lowest among the competitors matching A within its spread ({', '.join(matching)})"
                    )
    if DEFAULT in q and REFERENCE in q:
        gap = q[DEFAULT].get("gap_pct")
        inside = q[DEFAULT].get("within_ref_spread")
        lines.append(
            f"quality: default {gap:+.2f}% vs fp32 AdamW (target within 0.5%, inside A's seed range: {inside})"
        )
    if step:
        rows = dict(compare_io.ok_rows(step))
        if DEFAULT in rows:
            ours = rows[DEFAULT]
            others = {k: r for k, r in rows.items() if not k.startswith("FO")}
            faster = [k for k, r in others.items() if r["ms"] <= ours["ms"]]
            share = 100 * ours["GBps"] / step["copy_GBps"]
            lines.append(
                f"step: default {ours['ms']:.2f} ms, {share:.0f}% of copy (target >= 90%); "
                + ("faster than every competitor" if not faster else f"NOT faster than {', '.join(faster)}")
            )
    return lines or ["nothing to check yet (no results)"]


def plot(plt, data: dict):
    """The figure, or why there is none."""
    points = frontier_points(data["memory"], data["quality"])
    if not points:
        return "no configuration has both a part-1a peak and a part-4 loss"
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for key, (peak, loss) in points.items():
        ours = key.startswith("FO")
        ax.scatter(peak / 2**30, loss, color="#55a868" if ours else "#8172b2", marker="o" if ours else "s")
        ax.annotate(key, (peak / 2**30, loss), textcoords="offset points", xytext=(4, 3), fontsize=8)
    q = summary(data["quality"]).get(REFERENCE)
    if q and q["n"] > 1:
        ax.axhspan(q["min"], q["max"], color="grey", alpha=0.2, label="fp32 AdamW (A): seed range")
        ax.legend(fontsize=8)
    ax.set_xlabel("peak memory of a training step, part 1a (GiB)")
    ax.set_ylabel("held-out loss, part 4 (mean over seeds)")
    ax.set_title("memory / quality frontier (lower left is better; green: fusedopt)")
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="out", help="folder with the parts' JSON files")
    parser.add_argument("--plot", help="frontier PNG (default DIR/frontier.png)")
    args = parser.parse_args(argv)
    load = lambda name: compare_io.load(os.path.join(args.dir, name)) or None  # noqa: E731
    memory, quality, step = load("memory_a.json"), load("quality.json"), load("step.json")
    text = "\n".join(check_targets(memory, quality, step))
    if memory and quality:
        data = {"memory": memory, "quality": quality}
        compare_io.finish(text, plot, data, os.path.join(args.dir, "frontier.json"), args.plot)
    else:
        print(text)
    unknown = [k for k in SAME_UPDATE if k not in BY_KEY]
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main())
