"""Issue 6, part 2: time of one optimizer step over ~1e9 elements in large 2-D tensors, for every
optimizer of the line-up with a plain ``step()``, against a device-to-device copy in the same run.

    python benchmarks/compare_step.py --out $OUT/step.json             # GPU: 8 x 8192 x 16384 bf16
    python benchmarks/compare_step.py --shape 256x512 --tensors 2      # CPU smoke test

Built on ``benchmarks/step_bandwidth.py`` (same tensors, copy measurement and CUDA-event timer).
Each configuration gets fresh parameters (bf16; fp32 for key A, whose step is fp32 AdamW on the
fp32 master) with random gradients kept across steps, ``--warmup`` steps (JIT, autotune,
torch.compile), then the median of ``--reps`` steps, each bracketed by CUDA events. Reported:
ms per step, bytes moved by the byte model (``competitors.Entry.step_bytes``: every tensor read
and written once, the minimum traffic), that over the time in GB/s, as a share of the copy's
GB/s (bytes read + written), and the step's transient memory above the persistent. Gradient
release configurations (C, G, I, FOR, ...) have no separate step and are not in this part.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import compare_io
import torch
from competitors import select
from step_bandwidth import N_TENSORS, SHAPE, _time_ms, copy_bandwidth


def _timer(device: str):
    if device == "cuda":
        return _time_ms

    def time_ms(fn, reps):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return time_ms


def copy_gbps(device: str, numel: int) -> float:
    """GB/s of a copy (bytes read + written): step_bandwidth's 4 GiB copy on CUDA, else ``numel`` fp32."""
    if device == "cuda":
        return copy_bandwidth()
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    ms = _timer(device)(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / ms / 1e6


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(entry, device: str, shape, n_tensors: int, warmup: int, reps: int) -> dict:
    config = entry.optimizer_config()
    dtype = config.param_dtype(torch.bfloat16)
    n = n_tensors * shape[0] * shape[1]
    row = {"key": entry.key, "label": entry.label, "dtype": str(dtype).replace("torch.", ""), "elements": n}
    params = [torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype)) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt = config.build(params, device_type=device)
        t0 = time.perf_counter()
        for _ in range(warmup):
            opt.step()
        _sync(device)
        row["warmup_s"] = time.perf_counter() - t0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        ms = _timer(device)(opt.step, reps)
        if device == "cuda":
            row["transient_bytes"] = torch.cuda.max_memory_allocated() - before
        row.update(ok=True, ms=ms, bytes_per_element=entry.step_bytes, GBps=entry.step_bytes * n / ms / 1e6)
    except Exception as exc:  # one library failing must not end the run
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        opt = params = None
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def report(data: dict) -> str:
    rows, copy = data["rows"], data["copy_GBps"]
    body = []
    for key, r in rows.items():
        if not r.get("ok"):
            continue
        ideal = r["bytes_per_element"] * r["elements"] / copy / 1e6
        transient = compare_io.fmt(r.get("transient_bytes", None) and r["transient_bytes"] / (1 << 30), ".2f")
        body.append(
            [key, r["label"], r["dtype"], f"{r['ms']:.3f}", f"{r['bytes_per_element']:.2f}", f"{r['GBps']:.0f}"]
            + [f"{100 * r['GBps'] / copy:.0f}%", f"{ideal:.3f}", transient]
        )
    s = data["settings"]
    head = f"{s['elements']:,} elements ({s['tensors']} x {s['shape']}), {s['device']}; copy {copy:.0f} GB/s"
    headers = ["key", "optimizer", "params", "ms / step", "bytes/elem", "GB/s", "% of copy", "ms at copy BW"]
    lines = [head, "", compare_io.table(headers + ["transient GiB"], body)]
    return "\n".join(lines + compare_io.not_measured(data))


def plot(plt, data: dict):
    """The figure, or why there is none."""
    rows = compare_io.ok_rows(data)
    if not rows:
        return "no successful configuration"
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(rows) + 2), 4.5))
    share = [100 * r["GBps"] / data["copy_GBps"] for _, r in rows]
    bars = ax.bar([k for k, _ in rows], share, color=["#55a868" if k.startswith("FO") else "#8172b2" for k, _ in rows])
    for bar, (_, r) in zip(bars, rows):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['ms']:.1f} ms", ha="center", fontsize=7)
    ax.axhline(90, color="black", ls=":", lw=0.8, label="target: 90% of copy")
    ax.set_ylabel("% of copy bandwidth (byte model / time)")
    ax.set_title(
        f"optimizer step, {data['settings']['elements'] / 1e9:.2f}e9 elements, copy {data['copy_GBps']:.0f} GB/s"
    )
    ax.legend()
    return fig


def _shape(text: str) -> tuple[int, int]:
    a, _, b = text.lower().partition("x")
    return int(a), int(b)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated line-up keys (default: every entry with a plain step)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--shape", type=_shape, help="tensor shape ROWSxCOLS (default 8192x16384 on CUDA)")
    parser.add_argument("--tensors", type=int, help="number of tensors (default 8 on CUDA)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    compare_io.output_args(parser, "out/compare/step.json", "bar chart")
    args = parser.parse_args(argv)
    if compare_io.report_only(args, report, plot):
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    small = device != "cuda"
    shape = args.shape or ((256, 512) if small else SHAPE)
    tensors = args.tensors or (2 if small else N_TENSORS)
    entries = [e for e in select(args.only, "step") if e.step_bytes is not None]
    elements = tensors * shape[0] * shape[1]
    settings = {"device": device, "shape": list(shape), "tensors": tensors, "elements": elements, "reps": args.reps}
    data = {"settings": settings, "env": compare_io.environment(), "rows": {}}
    data["copy_GBps"] = copy_gbps(device, elements)
    print(f"copy: {data['copy_GBps']:.0f} GB/s", flush=True)
    for entry in entries:
        why = entry.unavailable(device)
        if why:
            data["rows"][entry.key] = {"key": entry.key, "label": entry.label, "ok": False, "error": why}
        else:
            data["rows"][entry.key] = bench(entry, device, shape, tensors, args.warmup, args.reps)
        r = data["rows"][entry.key]
        print(f"[{entry.key}] " + (f"{r['ms']:.3f} ms, {r['GBps']:.0f} GB/s" if r["ok"] else r["error"]), flush=True)
        compare_io.save(args.out, data)
    compare_io.finish(report(data), plot, data, args.out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
