"""The README's figure: peak memory of a training step against optimizer step time, for fusedopt's
settings and the other libraries, read from the tables of benchmarks/RESULTS.md (no number lives here).

    python benchmarks/plot_memory_time.py            # writes docs/memory_vs_step.png

Peak memory: "Peak memory of a training step" (1.1B Llama shape, micro-batch 1 x 1024). Step time, as a
ratio to torch's fused AdamW on bf16: "Every library, one after another in one process" for the other
libraries, "fusedopt formats and competitors, interleaved in one process" for fusedopt.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (label, row of the peak-memory table, (step table's heading, its row), colour, label offset in points);
# rows by the start of their first cell. FlashOptim's step is timed without release (its release row has none).
LIBRARIES, OURS = "tab:blue", "tab:red"
FORMATS = "fusedopt formats"
POINTS = [
    ("torch AdamW, fp32 + autocast", "A torch AdamW fused", ("Every library", "A"), "grey", (7, -3)),
    ("torch AdamW, pure bf16", "B torch AdamW fused", ("Every library", "B"), "grey", (7, -3)),
    ("bitsandbytes AdamW8bit", "D bitsandbytes", ("Every library", "D"), LIBRARIES, (7, 2)),
    ("torchao AdamW4bit", "E4 torchao", ("Every library", "E4"), LIBRARIES, (-40, 7)),
    ("FlashOptim + release", "G FlashOptim", ("Every library", "F"), LIBRARIES, (7, 3)),
    ("TurboAdam", "H TurboAdam", ("Every library", "H"), LIBRARIES, (7, -3)),
    ("fusedopt default", "**fusedopt default, `fused=True`**", (FORMATS, "**fusedopt default**"), OURS, (-20, 8)),
    ("fusedopt state_bits=4", "fusedopt `block4`, `fused=True`", (FORMATS, "fusedopt `block4`"), OURS, (-30, -13)),
    ("fusedopt norm2-root4", "**fusedopt `norm2-root4`, `fused=True`**", (FORMATS, "fusedopt `norm2"), OURS, (7, -3)),
]


def tables(text: str) -> dict[str, list[list[str]]]:
    """Each markdown table of ``text`` under the nearest heading above it: heading -> rows of cells."""
    out: dict[str, list[list[str]]] = {}
    heading = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            out.setdefault(heading, []).append([cell.strip() for cell in line.strip("|").split("|")])
    return out


def row(found: dict, heading: str, first: str) -> list[str]:
    """The row of the table under the heading starting with ``heading`` whose first cell starts with ``first``."""
    for name, rows in found.items():
        if name.startswith(heading):
            for cells in rows[1:]:
                if cells[0].startswith(first):
                    return cells
    raise KeyError(f"RESULTS.md has no row {first!r} under a heading {heading!r}")


def number(cell: str) -> float:
    return float(re.search(r"[\d.]+", cell.replace("*", "")).group())


def points(results: str) -> list[tuple[str, float, float]]:
    """(label, step time relative to torch's fused AdamW on bf16, peak GiB) of each point."""
    found = tables(results)
    out = []
    for label, memory_row, (heading, step_row), *_ in POINTS:
        peak = number(row(found, "Peak memory", memory_row)[1])
        cells = row(found, heading, step_row)
        ratio = number(cells[3] if heading == "Every library" else cells[1])  # "ratio to B" / "ratio to torch fused"
        out.append((label, ratio, peak))
    return out


def plot(data, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    for (label, ratio, peak), (*_, colour, offset) in zip(data, POINTS):
        ax.scatter(ratio, peak, s=46, color=colour, zorder=3)
        ax.annotate(label, (ratio, peak), xytext=offset, textcoords="offset points", fontsize=8.5, va="center")
    ax.set_xscale("log")
    ax.set_xticks([1, 2, 5, 10], ["1", "2", "5", "10"])
    ax.set_xlabel("optimizer step time, relative to torch's fused AdamW on bf16 (log scale; lower is faster)")
    ax.set_ylabel("peak GiB of a training step")
    ax.set_title("1.1B Llama, micro-batch 1 x 1024, H200 (benchmarks/RESULTS.md)", fontsize=10)
    ax.set_ylim(0, max(peak for _, _, peak in data) * 1.12)
    ax.set_xlim(0.7, max(ratio for _, ratio, _ in data) * 2.2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "memory_vs_step.png")
    args = parser.parse_args(argv)
    plot(points(args.results.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
