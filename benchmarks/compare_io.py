"""Shared plumbing of the issue-6 comparison scripts: results files that grow slice by slice,
the environment record, plain-text tables and an optional matplotlib import."""

from __future__ import annotations

import json
import os
import platform
import time


def load(path: str | None) -> dict:
    """The results file at ``path`` ({} when absent): runs are resumable and may come in slices."""
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def save(path: str | None, data: dict) -> None:
    """Write atomically, so a run killed at its time limit never leaves a truncated file."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def environment() -> dict:
    import torch
    from competitors import library_versions

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version()}
    env["versions"] = library_versions()
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    from fusedopt.profile.competitors import COMPETITORS

    env["usage"] = {name: c.how for name, c in COMPETITORS.items()}  # how each library was used
    return env


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table (readable in a terminal, pasteable into RESULTS.md)."""
    cells = [[str(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot with a file backend, or None (then no plot, said once by the caller)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def ok_rows(data: dict) -> list[tuple[str, dict]]:
    return [(k, r) for k, r in data.get("rows", {}).items() if r.get("ok")]


def not_measured(data: dict) -> list[str]:
    bad = [(k, r) for k, r in data.get("rows", {}).items() if not r.get("ok")]
    return ["", "Not measured:"] + [f"  {k} ({r['label']}): {r.get('error')}" for k, r in bad] if bad else []


def finish(text: str, plot, data: dict, out: str, plot_path: str | None) -> None:
    """Print the report, then save ``plot(plt, data)`` (a figure, or why there is none) next to ``out``."""
    print(text)
    path = plot_path or os.path.splitext(out)[0] + ".png"
    plt = pyplot()
    fig = "matplotlib not installed" if plt is None else plot(plt, data)
    if isinstance(fig, str):
        print(f"plot: not written ({fig})")
        return
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def output_args(parser, out: str, what: str) -> None:
    parser.add_argument("--out", default=out, help=f"results JSON (default {out})")
    parser.add_argument("--plot", help=f"{what} PNG (default: --out with .png)")
    parser.add_argument("--report", action="store_true", help="only print the table and plot of --out")


def report_only(args, report, plot) -> bool:
    """With --report: table and plot from an earlier run's JSON (e.g. where matplotlib is installed)."""
    if args.report:
        data = load(args.out)
        finish(report(data), plot, data, args.out, args.plot)
    return args.report
