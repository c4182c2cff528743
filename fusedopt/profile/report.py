"""Terminal table and memory-over-time plot of a ``fusedopt.profile`` report."""

from __future__ import annotations

from fusedopt.profile.memory import CATEGORIES, CATEGORY_LABELS, PHASES

MIB = 1 << 20
GIB = 1 << 30
COLORS = {
    "parameters": "#4C72B0",
    "corrections": "#8172B2",
    "optimizer_state": "#C44E52",
    "gradients": "#DD8452",
    "activations": "#55A868",
    "rest": "#BBBBBB",
}
REST_LABELS = {
    "inputs_buffers": "inputs/buffers",
    "backward_temporaries": "backward temporaries",
    "update_temporaries": "update temporaries",
    "other_temporaries": "other temporaries",
    "untracked": "allocator beyond tensors",
}


def _unit(report) -> tuple[str, int]:
    peaks = [r["memory"]["peak"] for r in report.results if r.get("ok")]
    return ("GiB", GIB) if peaks and max(peaks) >= 2 * GIB else ("MiB", MIB)


def _fmt(value, scale) -> str:
    return "-" if value is None else f"{value / scale:.2f}" if scale == GIB else f"{value / scale:.1f}"


def _grid(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Columns: the first ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i]) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    head = line(header)
    return [head, "-" * len(head)] + [line(r) for r in rows]


def format_table(report) -> str:
    s = report.settings
    unit, scale = _unit(report)
    cpu = s["device"] == "cpu"
    lines = [
        f"fusedopt profile: {s['model']}",
        f"{s['num_params']:,} parameters, {s['dtype']}, batch {s['batch']} x {s['seq_len']}"
        + (f" x {s['grad_accum']} micro-batches" if s["grad_accum"] > 1 else "")
        + f", device {s['device']}, {s['steps']} steps per configuration ({s['isolation']})",
        "",
    ]
    header = ["config", f"peak {unit}", "peak in", "dominated by", f"persistent {unit}", "peak vs first"]
    header += ["state B/param", "step ms"]
    if cpu:
        header += [f"alloc peak {unit}", f"RSS rise {unit}"]
    rows, first = [], None
    ok = [r for r in report.results if r.get("ok")]
    for r in report.results:
        if not r.get("ok"):
            rows.append([r["label"], "n/a", "", "", "", "", "", ""] + (["", ""] if cpu else []))
            continue
        m = r["memory"]
        if first is None:
            first = m["peak"]
        delta = "" if m["peak"] == first else f"{(m['peak'] - first) / first * 100:+.0f}%"
        per_param = (r["state_bytes"] + r["correction_bytes"]) / r["num_params"]
        release = r.get("release") and m["peak_phase"] == "backward"
        phase = m["peak_phase"] + (" (release)" if release else "")
        step = f"{r['median_step_ms']:.0f}" if r.get("median_step_ms") is not None else "-"
        row = [r["label"], _fmt(m["peak"], scale), phase, CATEGORY_LABELS[m["dominant"]], _fmt(m["persistent"], scale)]
        row += [delta or "-", f"{per_param:.2f}", step]
        if cpu:
            alloc = r.get("allocator_pass")
            alloc_peak = m["persistent"] + alloc["peak"] if alloc else None
            rss_peak = m["rss"]["peak"] - m["rss"]["before"] if m.get("rss") else None
            row += [_fmt(alloc_peak, scale), _fmt(rss_peak, scale)]
        rows.append(row)
    lines += _grid(header, rows)
    lines += ["", f"Breakdown of each peak ({unit}):"]
    header = ["config"] + [CATEGORY_LABELS[c] for c in CATEGORIES] + ["= peak", "rest is mostly"]
    rows = []
    for r in ok:
        bd = r["memory"]["peak_breakdown"]
        cats = bd["categories"]
        parts = bd["rest_parts"]
        top = max(parts, key=parts.get) if cats["rest"] else None
        rest_note = f"{REST_LABELS.get(top, top)} {_fmt(parts[top], scale)}" if top and parts[top] else "-"
        rows.append([r["label"]] + [_fmt(cats[c], scale) for c in CATEGORIES] + [_fmt(bd["total"], scale), rest_note])
    lines += _grid(header, rows)
    lines += ["", f"Per phase ({unit}: peak / at end):"]
    header = ["config", "forward", "backward", "update"]
    rows = []
    for r in ok:
        ph = r["memory"]["phases"]
        cells = [f"{_fmt(ph[n]['peak'], scale)} / {_fmt(ph[n]['end'], scale)}" if n in ph else "-" for n in PHASES]
        rows.append([r["label"], *cells])
    lines += _grid(header, rows)
    failed = [r for r in report.results if not r.get("ok")]
    if failed:
        lines += ["", "Not measured:"] + [f"  {r['label']}: {r.get('error')}" for r in failed]
    lines += ["", "How each figure was measured:"]
    if ok:
        method = ok[0]["memory"]["method"]
        lines.append(f"  peak: {method['peak']}")
        lines.append(f"  persistent: {method['persistent']}")
        lines.append(f"  breakdown: {method['breakdown']}")
        if cpu:
            lines.append(
                "  alloc peak: c10 CPU allocator running total under torch.profiler (a separate step): "
                "also counts op-internal scratch; persistent + the step's allocations"
            )
            lines.append(
                f"  RSS rise: {method.get('rss', 'process RSS')}; its peak during the step minus RSS at the start "
                "(compare with peak - persistent; the C allocator may reuse or keep freed pages)"
            )
        lines.append(
            "  state B/param: distinct optimizer-state storages (corrections included) / parameters; "
            "step ms: median of untracked steps"
        )
        lines.append(
            "  categories: activations = tensors allocated in forward or recomputed in backward; rest = inputs, "
            "buffers, autograd and optimizer temporaries" + ("" if cpu else ", allocator bytes beyond tensors")
        )
        notes = []
        if cpu and any(r["config"]["optimizer"].startswith("fusedopt") for r in ok):
            notes.append(
                "fusedopt on CPU runs its PyTorch reference update: its fp32 temporaries (rest, update phase or, with "
                "fused=True, backward) are absent with the Triton kernel on CUDA"
            )
        if cpu:
            notes.append("CPU figures are for comparison between configurations; a GPU run gives the real budget")
        untimed = any(r.get("median_step_ms") is None for r in ok)
        replay = cpu and report.settings.get("allocator_pass", True)
        unreplayed = replay and any(not r.get("allocator_pass") for r in ok)
        if untimed or unreplayed:
            missing = " and ".join(name for name, gone in (("step ms", untimed), ("alloc peak", unreplayed)) if gone)
            notes.append(
                f"{missing} '-': --steps {s['steps']} left no step for it after the warm-up and tracked steps "
                "(the first warm up, then one is tracked, on CPU one replayed for the allocator); give more --steps"
            )
        if notes:
            lines += ["", "Notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines)


def plot_timelines(report, path: str) -> str | None:
    """Write a PNG with one memory-over-time panel per configuration; return why not, or None."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed; pip install matplotlib"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report.results if r.get("ok") and r["memory"]["timeline"]]
    if not ok:
        return "no configuration has a timeline"
    unit, scale = _unit(report)
    # One time axis for every panel: the same length on the page is the same time.
    end = max(r["memory"]["timeline"][-1][0] for r in ok) or 1.0
    fig, axes = plt.subplots(len(ok), 1, figsize=(11, 2.6 * len(ok) + 1.4), sharex=True, sharey=True, squeeze=False)
    for ax, r in zip(axes[:, 0], ok):
        m = r["memory"]
        tl = m["timeline"]
        ms = [s[0] for s in tl]
        stacks = [[s[3 + i] / scale for s in tl] for i in range(len(CATEGORIES))]
        labels = [CATEGORY_LABELS[c] for c in CATEGORIES]
        ax.stackplot(ms, *stacks, labels=labels, colors=[COLORS[c] for c in CATEGORIES], step="post", alpha=0.9)
        if r["device"] == "cpu" and m.get("rss"):
            base = m["rss"]["before"] - m["start"]
            rss = [(s[-1] - base) / scale if s[-1] else None for s in tl]
            ax.plot(ms, rss, color="black", lw=0.8, label="process RSS (aligned at step start)")
            alloc = r.get("allocator_pass")
            if alloc:
                level = (m["persistent"] + alloc["peak"]) / scale
                ax.axhline(level, color="black", ls=":", lw=0.8, label="CPU allocator peak (profiler pass)")
        _phase_labels(ax, tl, end)
        peak_sample = max(tl, key=lambda s: s[2])
        ax.plot([peak_sample[0]], [peak_sample[2] / scale], "kv", ms=5)
        ax.set_title(
            f"{r['label']}: peak {_fmt(m['peak'], scale)} {unit} in {m['peak_phase']} "
            f"({CATEGORY_LABELS[m['dominant']]} largest), persistent {_fmt(m['persistent'], scale)} {unit}",
            fontsize=9,
        )
        ax.set_ylabel(unit)
        ax.set_xlim(0, end)
        ax.set_ylim(0, None)
    ax = axes[0, 0]
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # headroom for the phase labels (the y-axis is shared)
    axes[-1, 0].set_xlabel("ms into the tracked step (op-level tracking slows it down)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    s = report.settings
    fig.suptitle(
        f"{s['model']}\n{s['num_params']:,} params, {s['dtype']}, batch {s['batch']} x {s['seq_len']}, {s['device']}",
        fontsize=9,
    )
    # The legend below the panels, where it covers no data and no phase label.
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _phase_labels(ax, timeline, end: float) -> None:
    """A dashed line where each phase starts, its name at the top inside the axes: right-aligned
    near the right edge, one row lower when it would run into the previous name."""
    starts, previous = [], None
    for sample in timeline:
        if sample[1] != previous:
            starts.append((sample[0], sample[1]))
            previous = sample[1]
    last_x, row = None, 0
    for x, name in starts:
        ax.axvline(x, color="grey", lw=0.6, ls="--")
        row = row + 1 if last_x is not None and (x - last_x) < 0.09 * end and row < 2 else 0
        right = x > 0.9 * end
        ax.text(
            x,
            0.98 - 0.1 * row,
            f" {name} " if not right else f"{name} ",
            transform=ax.get_xaxis_transform(),
            ha="right" if right else "left",
            va="top",
            fontsize=7,
            color="dimgrey",
            clip_on=True,
        )
        last_x = x
