"""Issue 6, part 5: the largest model of the TinyLlama family (d_model 2048, growing depth) that fully
fine-tunes within a 24 GiB and an 80 GiB memory budget, per optimizer of the line-up.

    python benchmarks/compare_fit.py --budgets 24 --out $OUT/fit.json --budget-s 450
    python benchmarks/compare_fit.py --budgets 80 --out $OUT/fit.json --budget-s 450
    python benchmarks/compare_fit.py --budgets-mib 2 --shape d_model=64,heads=2,kv_heads=2,ffn=192,vocab=256 \
        --seq-len 16 --only B,FO --out fit.json          # CPU smoke test (tensor bytes, no cap)

A trial builds the profiler's embedded Llama-style model (``fusedopt.profile.models``, preset
``1b`` with ``layers`` = L; bf16 parameters, fp32 for key A with bf16 autocast), activation
checkpointing, micro-batch 1 x 1024 random tokens, and runs ``--steps`` full training steps
with the optimizer (default 2: the second runs with the state and the gradients alive); it fits
if none runs out of memory while the CUDA caching allocator is
capped at the budget with ``torch.cuda.set_per_process_memory_fraction`` (the CUDA context and
library handles are outside the cap: a real card of that size has ~0.5 GiB less). The search
starts from the depth the planner's byte model predicts, steps out until it brackets the limit,
then bisects to ``--resolution`` layers. All trials of one optimizer run in one fresh process
(one JIT / torch.compile per library); memory left allocated between trials is recorded. Results
merge into ``--out`` per (key, budget); ``--budget-s`` starts no optimizer whose search would
not finish in time.

``--base PRESET`` searches the depth of another width (``--base 7b``: Llama-2-7B's d_model 4096;
``benchmarks/fit_7b.py`` trains the 7B shape itself on real text). Each result also holds the peak
and the step time (median of the steps after the first) at the largest depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import harness
import torch

from fusedopt.profile.models import PRESETS, TinyLM, parse_shape, random_batch
from fusedopt.profile.planner import byte_model

GIB, MIB = harness.GIB, harness.MIB
BASE = "1b"


def family(layers: int, shape_override: str | None = None, base: str = BASE):
    """The ``base`` preset's shape (with ``shape_override``) at ``layers`` layers."""
    shape = parse_shape(shape_override, PRESETS[base]) if shape_override else PRESETS[base]
    return dataclasses.replace(shape, layers=layers)


def predicted_layers(config, budget: int, shape_override: str | None, activations: int, base: str = BASE) -> int:
    """Depth at which the byte model's peak reaches the budget."""
    dtype = config.param_dtype(torch.bfloat16)
    per = byte_model(config.optimizer, config.kwargs, dtype).at_peak
    one, two = family(1, shape_override, base).num_params(), family(2, shape_override, base).num_params()
    per_layer, fixed = two - one, one - (two - one)
    return max(1, int((budget - activations - fixed * per) / (per_layer * per)))


def largest(fits, guess: int, resolution: int, max_trials: int) -> int:
    """The largest L with fits(L), searching out from ``guess`` (0 if even one layer fails)."""
    seen: dict[int, bool] = {}

    def test(layers: int) -> bool:
        if layers not in seen:
            seen[layers] = fits(layers)
        return seen[layers]

    step = max(1, guess // 8)
    if test(guess):
        lo, hi = guess, None
        while hi is None and len(seen) < max_trials:
            if test(lo + step):
                lo, step = lo + step, step * 2
            else:
                hi = lo + step
    else:
        lo, hi = None, guess
        while lo is None and len(seen) < max_trials:
            cand = max(1, hi - step)
            if test(cand):
                lo = cand
            elif cand == 1:
                return 0
            else:
                hi, step = cand, step * 2
    if lo is None or hi is None:
        return lo or 0
    while hi - lo > resolution and len(seen) < max_trials:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid)
    return lo


def _tensor_bytes(model, opt, device: str) -> int:
    """Parameters, gradients and optimizer state held now (the CPU stand-in for an allocator cap)."""
    from fusedopt.profile.memory import state_storages

    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return held + sum(nbytes for _, nbytes in state_storages(opt, torch.device(device)))


def trial(entry, layers: int, args, device: str) -> dict:
    """Build, train ``args.steps`` steps, report whether it ran out of memory and its peak."""
    config = entry.optimizer_config()
    shape = family(layers, args.shape, args.base)
    out = {"layers": layers, "params": shape.num_params(), "step_ms": []}
    cuda = device == "cuda"
    model = opt = batch = loss = None
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model = TinyLM(shape, checkpointing=True, device=device, dtype=config.param_dtype(torch.bfloat16))
        opt = config.build(model.parameters(), model=model, device_type=device)
        gen = torch.Generator(device=device).manual_seed(0)
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = random_batch(shape.vocab, 1, args.seq_len, device, gen)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=config.autocast is not None):
                loss = model(*batch)
            loss.backward()
            loss = None
            held = _tensor_bytes(model, opt, device) if not cuda else 0
            opt.step()
            opt.zero_grad(set_to_none=True)
            if not cuda:
                out["peak"] = max(out.get("peak", 0), held, _tensor_bytes(model, opt, device))
            else:
                torch.cuda.synchronize()
            out["step_ms"].append(1e3 * (time.perf_counter() - t0))
        if cuda:
            torch.cuda.synchronize()
            out["peak"] = torch.cuda.max_memory_allocated() - args._baseline
            out["ok"] = True
        else:  # no cap on CPU: parameters + gradients + optimizer state against the budget (smoke tests)
            out["ok"] = out["peak"] <= args._budget
    except torch.OutOfMemoryError:
        out.update(ok=False, error="out of memory")
    except RuntimeError as exc:
        if "out of memory" not in str(exc).lower():
            raise
        out.update(ok=False, error="out of memory")
    finally:
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
        model = opt = batch = loss = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            out["left_allocated"] = torch.cuda.memory_allocated() - args._baseline
    print(
        f"    L={layers:4d} ({out['params'] / 1e9:.2f}B): {'fits' if out['ok'] else out.get('error', 'over')}",
        flush=True,
    )
    return out


# A failed trial whose memory stays allocated (a library's hooks keep the model alive) would
# make every later trial in the same process fail: the search stops there instead.
LEAK_LIMIT = 256 * MIB


def leak_error(trial_result: dict, own_process: bool = False) -> str | None:
    """Why the search cannot go on after this trial (None: it can). A trial that ran in its own
    process took its leftovers with it (the 2026-11-30 run stopped optimi and FlashOptim there)."""
    left = trial_result.get("left_allocated", 0)
    if own_process or trial_result["ok"] or left <= LEAK_LIMIT:
        return None
    return (
        f"a failed trial at {trial_result['layers']} layers left {left / GIB:.1f} GiB allocated (the library "
        "keeps the model alive), so later trials in this process would not measure the optimizer"
    )


class LeakedTrial(Exception):
    pass


def _cap_memory(args, budget: int, device: str) -> None:
    args._budget = budget
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        args._baseline = torch.cuda.memory_allocated()


def trial_in_own_process(entry, layers: int, args, budget: int) -> dict:
    """One trial in a fresh Python process: a library whose hooks keep a failed model alive
    cannot spoil the next trial (FlashOptim with gradient release did, 2026-11-30)."""
    with tempfile.TemporaryDirectory(prefix="fit-trial-") as tmp:
        path = os.path.join(tmp, "trial.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--trial-out", path, "--trial-layers", str(layers)]
        cmd += _worker_args(entry, args, [budget])
        proc = subprocess.run(cmd)
        if not os.path.exists(path):
            raise RuntimeError(f"[{entry.key}] the trial at {layers} layers exited with code {proc.returncode}")
        with open(path) as f:
            return json.load(f)


def _worker_args(entry, args, budgets: list[int]) -> list[str]:
    """Command-line arguments that give a worker or trial process this run's settings."""
    cmd = ["--only", entry.key, "--device", args.device, "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    cmd += ["--max-trials", str(args.max_trials), "--activations-gib", str(args.activations_gib)]
    cmd += ["--process-per-trial", args.process_per_trial, "--base", args.base]
    if args.budgets_mib:
        cmd += ["--budgets-mib", ",".join(str(b / MIB) for b in budgets)]
    else:
        cmd += ["--budgets", ",".join(str(b / GIB) for b in budgets)]
    for flag, value in (("--shape", args.shape), ("--resolution", args.resolution)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def one_trial(args) -> int:
    """``--trial-out``: one trial at ``--trial-layers`` under the single budget; writes its JSON."""
    entry = harness.select(args.only, "fit")[0]
    _cap_memory(args, args._budgets[0], args.device)
    result = trial(entry, args.trial_layers, args, args.device)
    with open(args.trial_out, "w") as f:
        json.dump(result, f)
    return 0


def worker(args) -> int:
    """All budgets for one line-up key, in this process; writes JSON to args.worker_out."""
    entry = harness.select(args.only, "fit")[0]
    device = args.device
    own_process = args.process_per_trial == "all" or (args.process_per_trial == "release" and entry.release)
    results = {}
    for budget in args._budgets:
        _cap_memory(args, budget, device)
        config = entry.optimizer_config()
        activations = args.activations_gib * GIB if device == "cuda" else 0
        guess = predicted_layers(config, budget, args.shape, activations, args.base)
        resolution = args.resolution or max(1, guess // 50)
        trials: list[dict] = []
        t0 = time.perf_counter()

        def fits(layers: int, trials=trials, budget=budget) -> bool:
            if own_process:
                trials.append(trial_in_own_process(entry, layers, args, budget))
            else:
                trials.append(trial(entry, layers, args, device))
            error = leak_error(trials[-1], own_process)
            if error:
                raise LeakedTrial(error)
            return trials[-1]["ok"]

        try:
            best = largest(fits, guess, resolution, args.max_trials)
        except LeakedTrial as exc:
            with open(args.worker_out, "w") as f:
                json.dump({"error": str(exc)}, f)
            return 0
        fitting = [t for t in trials if t["ok"] and t["layers"] == best]
        results[str(budget)] = {
            "budget_bytes": budget,
            "layers": best,
            "params": family(best, args.shape, args.base).num_params() if best else 0,
            "peak_at_largest": fitting[0]["peak"] if fitting else None,
            "step_ms_at_largest": _median_step_ms(fitting[0]) if fitting else None,
            "predicted_layers": guess,
            "resolution": resolution,
            "trials": trials,
            "seconds": time.perf_counter() - t0,
        }
    with open(args.worker_out, "w") as f:
        json.dump(results, f)
    return 0


def _median_step_ms(trial_result: dict) -> float | None:
    """Median time of a trial's steps after its first (allocation, compilation), or None."""
    times = trial_result.get("step_ms") or []
    later = times[1:] or times
    return statistics.median(later) if later else None


def _cell(x: dict | None, unit: int) -> str:
    if x is None:
        return "-"
    if not x["layers"]:
        return "not even 1 layer"
    text = f"{x['layers']} layers, {x['params'] / 1e9:.2f}B"
    extra = []
    if x.get("peak_at_largest") is not None:
        extra.append(f"peak {x['peak_at_largest'] / unit:.2f} {'GiB' if unit == GIB else 'MiB'}")
    if x.get("step_ms_at_largest") is not None:
        extra.append(f"{x['step_ms_at_largest']:.0f} ms/step")
    return text + (f" ({', '.join(extra)})" if extra else "")


def report(data: dict) -> str:
    budgets = sorted({b for r in data["rows"].values() for b in r.get("budgets", {})}, key=int)
    s = data["settings"]
    unit = GIB if s["device"] == "cuda" else MIB
    headers = ["key", "optimizer"] + [f"{int(b) / unit:.0f} {'GiB' if unit == GIB else 'MiB'}" for b in budgets]
    rows = []
    for key, r in data["rows"].items():
        if not r.get("ok"):
            continue
        rows.append([key, r["label"]] + [_cell(r["budgets"].get(b), unit) for b in budgets])
    lines = [f"largest depth that trains (d_model {family(1, s['shape'], s.get('base', BASE)).d_model})", ""]
    lines.append(harness.table(headers, rows))
    return "\n".join(lines + harness.not_measured(data))


def plot(plt, data: dict):
    """The figure, or why there is none."""
    rows = harness.ok_rows(data)
    budgets = sorted({b for _, r in rows for b in r["budgets"]}, key=int)
    if not rows or not budgets:
        return "no results"
    fig, ax = plt.subplots(figsize=(max(7, 0.7 * len(rows) + 2), 4.5))
    width = 0.8 / len(budgets)
    unit = GIB if data["settings"]["device"] == "cuda" else MIB
    for j, b in enumerate(budgets):
        xs = [i + (j - (len(budgets) - 1) / 2) * width for i in range(len(rows))]
        ys = [r["budgets"].get(b, {}).get("params", 0) / 1e9 for _, r in rows]
        ax.bar(xs, ys, width, label=f"{int(b) / unit:.0f} {'GiB' if unit == GIB else 'MiB'} budget")
    ax.set_xticks(range(len(rows)), [k for k, _ in rows])
    ax.set_ylabel("largest trainable model, billion parameters")
    ax.set_title("full fine-tuning, activation checkpointing, micro-batch 1 x 1024")
    ax.legend()
    return fig


def budgets_to_measure(row: dict, budgets: list[int], redo: bool) -> list[int]:
    """The budgets a run searches for one key: those not in its results file yet (all with --redo)."""
    return list(budgets) if redo else [b for b in budgets if str(b) not in row.get("budgets", {})]


def merge(data: dict, other: dict) -> dict:
    """Add ``other``'s measured budgets to ``data`` (two GPUs searching halves of a line-up)."""
    for key, row in other.get("rows", {}).items():
        if not row.get("budgets"):
            data.setdefault("rows", {}).setdefault(key, row)
            continue
        mine = data.setdefault("rows", {}).setdefault(key, {"key": key, "label": row["label"], "budgets": {}})
        mine.setdefault("budgets", {}).update(row["budgets"])
        mine.pop("error", None)
        mine["ok"] = True
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated line-up keys (default: the part's line-up)")
    parser.add_argument("--budgets", default="24,80", help="memory budgets in GiB (CUDA)")
    parser.add_argument("--budgets-mib", help="memory budgets in MiB (CPU smoke tests: tensor bytes, no cap)")
    parser.add_argument("--base", default=BASE, choices=sorted(PRESETS), help=f"the family's preset (default {BASE})")
    parser.add_argument("--shape", help="override of the base shape (depth is searched), e.g. for CPU smoke tests")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="steps a trial must complete (default 2)")
    parser.add_argument("--resolution", type=int, help="stop bisecting at this many layers (default 2%% of guess)")
    parser.add_argument("--max-trials", type=int, default=10)
    parser.add_argument("--activations-gib", type=float, default=1.0, help="assumed non-parameter memory")
    parser.add_argument("--budget-s", type=float, help="start no optimizer that would end after this many seconds")
    parser.add_argument("--device", default=None)
    harness.output_args(parser, "out/compare/fit.json", "bar chart")
    parser.add_argument(
        "--process-per-trial",
        choices=("release", "all", "none"),
        default="release",
        help="run each trial in a fresh process: for gradient-release configurations (default), all, none",
    )
    parser.add_argument("--redo", action="store_true", help="search keys already in --out again (e.g. after a change)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only add these runs' budgets to --out, then report")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--trial-out", help=argparse.SUPPRESS)
    parser.add_argument("--trial-layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.merge:
        data = harness.load(args.out)
        for path in args.merge:
            data = merge(data, harness.load(path))
        harness.save(args.out, data)
        args.report = True
    if harness.report_only(args, report, plot):
        return 0
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.budgets_mib:
        args._budgets = [int(float(b) * MIB) for b in args.budgets_mib.split(",")]
    else:
        args._budgets = [int(float(b) * GIB) for b in args.budgets.split(",")]
    args._baseline = 0
    if args.trial_out:
        return one_trial(args)
    if args.worker_out:
        return worker(args)
    t_start = time.perf_counter()
    data = harness.load(args.out)
    settings = {"device": args.device, "shape": args.shape, "seq_len": args.seq_len, "steps": args.steps}
    if args.base != BASE:  # only then: results files of the default family stay valid
        settings["base"] = args.base
    if data.get("settings") != settings:
        data = {"settings": settings, "rows": {}}
    data["env"] = harness.environment()
    times = [r["seconds"] for r in data["rows"].values() if r.get("seconds")]
    for entry in harness.select(args.only, "fit"):
        row = data["rows"].setdefault(entry.key, {"key": entry.key, "label": entry.label, "budgets": {}})
        todo = budgets_to_measure(row, args._budgets, args.redo)
        if not todo:
            continue
        why = entry.unavailable(args.device)
        if why:
            row.update(ok=False, error=why)
            print(f"[{entry.key}] skipped: {why}", flush=True)
            continue
        guess = (max(times) if times else 0) * len(todo) / max(1, len(args._budgets))
        if args.budget_s and time.perf_counter() - t_start + guess > args.budget_s:
            print(f"[{entry.key}] not started: about {guess:.0f} s would pass --budget-s", flush=True)
            continue
        print(f"[{entry.key}] {entry.label}", flush=True)
        with tempfile.TemporaryDirectory(prefix="fit-") as tmp:
            path = os.path.join(tmp, "out.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker-out", path]
            cmd += _worker_args(entry, args, todo)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd)
            seconds = time.perf_counter() - t0
            if os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
                if "error" in result:
                    row.update(ok=False, error=result["error"])
                else:
                    row["budgets"].update(result)
                    row.update(ok=True, seconds=seconds)
            else:
                row.update(ok=False, error=f"worker exit code {proc.returncode}")
        times.append(seconds)
        harness.save(args.out, data)
    harness.save(args.out, data)
    harness.finish(report(data), plot, data, args.out, args.plot)
    return 0 if all(math.isfinite(t) for t in times) else 1


if __name__ == "__main__":
    sys.exit(main())
