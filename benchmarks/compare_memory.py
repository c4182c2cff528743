"""Issue 6, parts 1 and 3: peak and persistent memory, and step time, of a full training step of
the 1.1B TinyLlama shape for every optimizer of the line-up (each in a fresh process).

    python benchmarks/compare_memory.py --regime a --out $OUT/memory_a.json   # low-VRAM fine-tuning
    python benchmarks/compare_memory.py --regime b --out $OUT/memory_b.json   # batch 4, no checkpointing
    python benchmarks/compare_memory.py --regime a --model tiny --seq-len 64 --only A,B,FO   # CPU smoke

Regime a: activation checkpointing (non-reentrant), micro-batch 1 x 1024. Regime b: batch
4 x 1024, no checkpointing. The model is ``transformers.LlamaForCausalLM`` built with random
weights from ``benchmarks/tinyllama_1b.json`` (its HF loss, output dropped before backward),
or the profiler's embedded model with ``--model PRESET``. Each configuration runs ``--steps``
training steps on random tokens in its own process through ``fusedopt.profile``: two warm-up
steps, one tracked step (peak, persistent, breakdown of the peak, phase holding it), then
timed steps whose median is the step time of part 3. Ratios are to torch AdamW with fp32
parameters and bf16 autocast (key A). Results merge into ``--out`` by key, so a part can run
in slices (``--only``) and a killed run keeps what it finished. Each row also holds what the
planner (``fusedopt-profile plan``) predicts for it without a measurement, reported beside it.
The keys are those of the line-up (``fusedopt/profile/lineup.py``); its AF* keys are
fusedopt.Adafactor:

    python benchmarks/compare_memory.py --regime a --only A,FOR,FO4R,AFR,AFM8R,AFM4R --out $OUT/memory_af.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import harness
import torch

from fusedopt.profile import ModelSpec, plan, run_profile
from fusedopt.profile.lineup import REFERENCE

HERE = os.path.dirname(os.path.abspath(__file__))
HF_CONFIG = os.path.join(HERE, "tinyllama_1b.json")
REGIMES = {
    "a": dict(checkpointing=True, batch=1, seq_len=1024, steps=12),
    "b": dict(checkpointing=False, batch=4, seq_len=1024, steps=8),
}
GIB = 1 << 30


def model_spec(args, checkpointing: bool) -> ModelSpec:
    if args.model in (None, "hf"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: using the embedded 1b preset (same shapes)", file=sys.stderr)
            return ModelSpec.from_args("1b", args.shape, None, checkpointing)
        return ModelSpec.from_args(None, None, args.hf_config or HF_CONFIG, checkpointing)
    return ModelSpec.from_args(args.model, args.shape, None, checkpointing)


def summarize(key: str, entry, result: dict) -> dict:
    row = {"key": key, "label": entry.label, "config": entry.config, "ok": bool(result.get("ok"))}
    if not result.get("ok"):
        row.update(error=result.get("error"), error_kind=result.get("error_kind"))
        return row
    m = result["memory"]
    ms = result.get("median_step_ms")
    tokens = result["batch"] * result["seq_len"] * result.get("grad_accum", 1)
    row.update(
        peak=m["peak"],
        persistent=m["persistent"],
        peak_phase=m["peak_phase"],
        peak_op=m["peak_op"],
        dominant=m["dominant"],
        peak_breakdown=m["peak_breakdown"]["categories"],
        phase_peaks={k: v["peak"] for k, v in m["phases"].items()},
        state_bytes=result.get("state_bytes"),
        correction_bytes=result.get("correction_bytes"),
        num_params=result["num_params"],
        median_step_ms=ms,
        step_ms=result.get("step_ms"),
        tokens_per_s=tokens / ms * 1e3 if ms else None,
        losses=result.get("losses"),
        seconds=result.get("seconds"),
    )
    return row


def planned(config, spec, regime: dict) -> dict:
    """What ``fusedopt-profile plan`` predicts for this configuration and workload without a
    measurement (state layout or byte model, activations estimated from the shape): held next to
    the measurement so that the planner's figures can be checked at size."""
    row = plan(None, 1 << 20, [config], model=spec, dtype="bf16", batch=regime["batch"], seq_len=regime["seq_len"])[0]
    per = row.per_param
    return {
        "source": per.source,
        "state_corr_per_param": per.state + per.corrections,
        "persistent": row.persistent,
        "grads": row.grads,
        "activations": row.activations,
        "peak": row.peak,
    }


def report(data: dict) -> str:
    rows = data.get("rows", {})
    ref = rows.get(REFERENCE) if rows.get(REFERENCE, {}).get("ok") else None
    unit, scale = ("GiB", GIB) if data["settings"]["device"].startswith("cuda") else ("MiB", 1 << 20)
    mem, speed, planner = [], [], []
    for key, r in rows.items():
        if not r.get("ok"):
            continue
        if r.get("planned"):
            p, n = r["planned"], r["num_params"]
            measured = ((r["state_bytes"] or 0) + (r["correction_bytes"] or 0)) / n
            planner.append(
                [key, f"{p['state_corr_per_param']:.3f}", f"{measured:.3f}"]
                + [f"{p['persistent'] / scale:.2f}", f"{r['persistent'] / scale:.2f}"]
                + [f"{p['peak'] / scale:.2f}" + ("+" if p["activations"] is None else ""), f"{r['peak'] / scale:.2f}"]
                + [p["source"]]
            )
        ratio = {k: f"{r[k] / ref[k]:.2f}" if ref else "-" for k in ("peak", "persistent")}
        n = r["num_params"]
        state = ((r["state_bytes"] or 0) + (r["correction_bytes"] or 0)) / n
        mem.append(
            [key, r["label"], f"{r['peak'] / scale:.2f}", r["peak_phase"], f"{r['persistent'] / scale:.2f}"]
            + [ratio["peak"], ratio["persistent"], f"{state:.3f}", r["dominant"]]
        )
        ms, tps = harness.fmt(r["median_step_ms"], ".0f"), harness.fmt(r["tokens_per_s"], ".0f")
        speed.append([key, r["label"], ms, tps])
    s = data["settings"]
    lines = [
        f"{s['model']}; {s['num_params']:,} params; batch {s['batch']} x {s['seq_len']}; {s['device']}",
        "",
        harness.table(
            ["key", "optimizer", f"peak {unit}", "peak in", f"persistent {unit}", "peak / A", "persistent / A"]
            + ["state+corr B/param", "peak dominated by"],
            mem,
        ),
        "",
        "Step time (part 3): median of the timed steps after 2 warm-up steps and the tracked step",
        harness.table(["key", "optimizer", "step ms", "tokens/s"], speed),
    ]
    if planner:
        lines += [
            "",
            "The planner's prediction (fusedopt-profile plan, no measurement; activations estimated from the "
            "model's shape, '+': not included, a non-Llama Hugging Face config) against the measurement",
            harness.table(
                ["key", "state+corr B/param: plan", "measured", f"persistent {unit}: plan", "measured"]
                + [f"peak {unit}: plan", "measured", "plan from"],
                planner,
            ),
        ]
    return "\n".join(lines + harness.not_measured(data))


def plot(plt, data: dict):
    """The figure, or why there is none."""
    rows = harness.ok_rows(data)
    if not rows:
        return "no successful configuration"
    ref = data["rows"].get(REFERENCE)
    scale = GIB if data["settings"]["device"].startswith("cuda") else 1 << 20
    unit = "GiB" if scale == GIB else "MiB"
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows) + 2), 4.8))
    x = range(len(rows))
    peaks = [r["peak"] / scale for _, r in rows]
    ax.bar([i - 0.2 for i in x], peaks, 0.4, label="peak of the step", color="#c44e52")
    ax.bar([i + 0.2 for i in x], [r["persistent"] / scale for _, r in rows], 0.4, label="persistent", color="#4c72b0")
    if ref and ref.get("ok"):
        for i, (_, r) in zip(x, rows):
            ax.text(i - 0.2, r["peak"] / scale, f"{r['peak'] / ref['peak']:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [k for k, _ in rows])
    ax.set_ylabel(unit)
    s = data["settings"]
    ax.set_title(f"{s['num_params'] / 1e9:.2f}B params, batch {s['batch']} x {s['seq_len']}, {s['regime_desc']}")
    ax.legend()
    fig.text(0.01, 0.01, "numbers above bars: peak / peak of A (torch AdamW, fp32 params + bf16 autocast)", fontsize=7)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="a")
    parser.add_argument("--only", help="comma-separated line-up keys (default: all)")
    parser.add_argument("--model", help="'hf' (default: LlamaForCausalLM from --hf-config) or a profiler preset")
    parser.add_argument("--hf-config", help=f"transformers config.json (default {os.path.relpath(HF_CONFIG)})")
    parser.add_argument("--shape", help="profiler shape override, e.g. layers=2 (with --model PRESET)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--steps", type=int, help="steps per configuration (default: 12 in regime a, 8 in b)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--redo", action="store_true", help="measure keys already in --out again")
    parser.add_argument("--budget-s", type=float, help="start no configuration that would end after this many seconds")
    harness.output_args(parser, "out/compare/memory.json", "bar chart")
    args = parser.parse_args(argv)
    if harness.report_only(args, report, plot):
        return 0
    regime = dict(REGIMES[args.regime])
    for name in ("batch", "seq_len", "steps"):
        if getattr(args, name) is not None:
            regime[name] = getattr(args, name)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = model_spec(args, regime["checkpointing"])
    entries = harness.select(args.only, "memory")
    data = harness.load(args.out)
    settings = {
        "regime": args.regime,
        "regime_desc": "activation checkpointing" if regime["checkpointing"] else "no checkpointing",
        "model": spec.describe(),
        "num_params": spec.num_params(),
        "device": device,
        "batch": regime["batch"],
        "seq_len": regime["seq_len"],
        "steps": regime["steps"],
    }
    same = ("regime", "num_params", "batch", "seq_len")  # not the model's path: it differs between machines
    if any(data.get("settings", {}).get(k) != settings[k] for k in same):
        data = {"settings": settings, "rows": {}}  # another model or regime: start over
    data["settings"] = settings
    data["env"] = harness.environment()
    rows = data.setdefault("rows", {})
    t_start, spent = time.perf_counter(), []
    for entry in entries:
        if entry.key in rows and rows[entry.key]["ok"] and not args.redo:
            print(f"[{entry.key}] already measured in {args.out}", file=sys.stderr)
            continue
        why = entry.unavailable(device.split(":")[0])
        if why:
            print(f"[{entry.key}] skipped: {why}", file=sys.stderr)
            rows[entry.key] = {"key": entry.key, "label": entry.label, "ok": False, "error": why}
            harness.save(args.out, data)
            continue
        guess = 1.2 * max(spent or [0.0])
        if args.budget_s and time.perf_counter() - t_start + guess > args.budget_s:
            print(f"[{entry.key}] not started: about {guess:.0f} s would pass --budget-s", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        config = entry.optimizer_config()
        profile = run_profile(
            spec,
            [config],
            device=device,
            dtype="bf16",
            batch=regime["batch"],
            seq_len=regime["seq_len"],
            steps=regime["steps"],
            allocator_pass=False,
            timeline=False,
            progress=True,
        )
        rows[entry.key] = summarize(entry.key, entry, profile.results[0])
        rows[entry.key]["raw"] = profile.results[0]
        rows[entry.key]["planned"] = planned(config, spec, regime)
        harness.save(args.out, data)
        spent.append(time.perf_counter() - t0)
    harness.finish(report(data), plot, data, args.out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
