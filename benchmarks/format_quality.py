"""Quality of the state formats against fp32 AdamW, with paired seeds: a benchmark that can tell them apart.

A byte-level Llama-shaped model (``fusedopt.profile.models.TinyLM``) is trained on Python's
standard-library source (the corpus and evaluation of ``compare_quality.py``) with every
configuration of the line-up. For each seed ``s`` every configuration starts from the same fp32
initialisation and sees the same batches in the same order; only the optimizer differs. The result
is the held-out loss of each run and, per seed, its difference to fp32 AdamW of the same seed
(``fp32``: ``state_bits=32, master_weight_bits=32``, which follows fp32 master weights and fp32
moments exactly: ``torch.optim.AdamW``'s update). Every configuration keeps bf16 parameters and
computes in bf16, so the forward pass is the same kind everywhere and only the optimizer differs
(with fp32 parameters and autocast instead, the difference would also hold autocast's rounding of
activations). Pairing removes the seed-to-seed spread of the loss itself
(initialisation and data), which is larger than most of the effects measured here; what is left is
each configuration's effect plus trajectory noise, which the control ``default~`` (the default
configuration with another optimizer seed, i.e. other stochastic-rounding draws) measures.

The regime is chosen so that rounding matters: AdamW's peak learning rate at the best of a
single-seed GPU sweep (1.5e-3, 3e-3, 6e-3, 1.2e-2: 1.5e-3 ended 19% below 3e-3; lower lrs untried), a
cosine decay to 0, so that late updates are small against a bf16 ulp (round-to-nearest drops them,
and the decoupled weight decay ``lr * 0.1 * p`` is far below half an ulp), and weight decay 0.1. The known-worse
configurations (pure bf16 with round-to-nearest; bf16 without master correction; the 4-bit block
format) must come out worse than fp32 beyond the noise: the report says for each configuration
whether it is worse (or better) on every seed and gives the paired t statistic.

    python benchmarks/format_quality.py --quick                   # CPU, about 3 minutes on one core
    python benchmarks/format_quality.py --out quality.json        # GPU (default settings), ~20 min on an H200

``--only KEY,KEY`` picks configurations (``fp32`` always runs: it is the reference), ``--seeds``
the seeds; ``KEY@LR`` runs a configuration at another peak lr (``--only adafactor-fp32@0.03``:
a sweep). The Adafactor configurations take their own peak lr (``PEAK_LR``: its lr is a relative
step, not AdamW's) and are also paired against fusedopt's AdamW default and, when compressed,
against fp32 Adafactor. Results are appended to ``--out`` run by run, and runs already there (same
settings) are skipped, so an interrupted run resumes. ``--jobs N`` trains N runs at a time in
separate processes (the model is small, so one GPU is far from busy with one run); each run is
still alone in its process, so the results do not depend on N.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_quality import corpus, train_steps, window_losses  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.profile.models import PRESETS, TinyLM, parse_shape  # noqa: E402

HPARAMS = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

# key -> (parameter dtype, optimizer factory(params, lr), label). fp32 is the reference.
CONFIGS = {
    "fp32": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_bits=32, master_weight_bits=32, **HPARAMS),
        "fp32 AdamW (fp32 master weights and moments)",
    ),
    "bf16-rtn": (
        torch.bfloat16,
        lambda ps, lr: torch.optim.AdamW(ps, lr=lr, **HPARAMS),
        "torch AdamW, pure bf16 (round to nearest)",
    ),
    "default": (torch.bfloat16, lambda ps, lr: fusedopt.AdamW(ps, lr=lr, **HPARAMS), "fusedopt default (block8)"),
    "default~": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, seed=1, **HPARAMS),
        "control: default, other rounding draws",
    ),
    "nomaster": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, master_weight_bits=None, **HPARAMS),
        "block8, no correction (bf16 + SR)",
    ),
    "block4": (torch.bfloat16, lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_bits=4, **HPARAMS), "block4, 24-bit"),
    "block4-nomaster": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_bits=4, master_weight_bits=None, **HPARAMS),
        "block4, no correction",
    ),
    "rot8": (torch.bfloat16, lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="rot8", **HPARAMS), "rot8, 24-bit"),
    "rot4": (torch.bfloat16, lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="rot4", **HPARAMS), "rot4, 24-bit"),
    "rot2": (torch.bfloat16, lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="rot2", **HPARAMS), "rot2, 24-bit"),
    "norm2-log4": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="norm2-log4", **HPARAMS),
        "norm2-log4 (0.82 B/param), 24-bit",
    ),
    "norm2-log4-nomaster": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="norm2-log4", master_weight_bits=None, **HPARAMS),
        "norm2-log4, no correction",
    ),
    "norm4-log4": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="norm4-log4", **HPARAMS),
        "norm4-log4 (1.07 B/param), 24-bit",
    ),
    "rot4-log4": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="rot4-log4", **HPARAMS),
        "rot4-log4 (1.05 B/param), 24-bit",
    ),
    "norm2-root4": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="norm2-root4", **HPARAMS),
        "norm2-root4 (0.81 B/param), 24-bit",
    ),
    "norm2-root4-nomaster": (
        torch.bfloat16,
        lambda ps, lr: fusedopt.AdamW(ps, lr=lr, state_format="norm2-root4", master_weight_bits=None, **HPARAMS),
        "norm2-root4, no correction",
    ),
    "turboadam": (
        torch.bfloat16,
        lambda ps, lr: __import__("turboadam").TurboAdam(ps, lr=lr, **HPARAMS),
        "TurboAdam 0.2.0 (its defaults: UState + 1Q, 0.81 B/param; bf16 parameters, no master)",
    ),
}
KNOWN_WORSE = ("bf16-rtn", "nomaster", "block4", "block4-nomaster")

# Adafactor (torch's relative step: the update is max(eps2, RMS(p)) * min(lr, 1/sqrt(t)) times the
# clipped normalised gradient), so its lr is not AdamW's: each configuration here takes its own peak
# lr (PEAK_LR, from single-seed sweeps on the GPU settings: benchmarks/RESULTS.md), under the same
# schedule. Its weight decay is also lr * weight_decay * p per step: weight_decay = ADAMW_DECAY / peak
# lr keeps that decay equal to the AdamW configurations' at the GPU settings' lr.
ADAMW_DECAY = 1.5e-3 * HPARAMS["weight_decay"]


def _adafactor(**options):
    return lambda ps, lr: fusedopt.Adafactor(ps, lr=lr, weight_decay=ADAMW_DECAY / lr, **options)


CONFIGS.update(
    {
        "adafactor-fp32": (
            torch.bfloat16,
            _adafactor(beta1=None, state_bits=32, master_weight_bits=32),
            "Adafactor, no momentum, fp32 master weights (its own reference)",
        ),
        "adafactor": (torch.bfloat16, _adafactor(beta1=None), "Adafactor, no momentum, 24-bit master"),
        "adafactor-m32": (
            torch.bfloat16,
            _adafactor(beta1=0.9, state_bits=32, master_weight_bits=32),
            "Adafactor, fp32 momentum, fp32 master weights (the momentum configurations' reference)",
        ),
        "adafactor-m8": (torch.bfloat16, _adafactor(beta1=0.9), "Adafactor, 8-bit momentum, 24-bit master"),
        "adafactor-m4": (
            torch.bfloat16,
            _adafactor(beta1=0.9, state_bits=4),
            "Adafactor, 4-bit momentum, 24-bit master",
        ),
    }
)
PEAK_LR = {"adafactor-fp32": 0.03, "adafactor": 0.03, "adafactor-m32": 0.03, "adafactor-m8": 0.03, "adafactor-m4": 0.03}
# Also paired against these (configuration -> references besides fp32 AdamW) in the report.
ALSO_AGAINST = {
    "adafactor-fp32": ("default",),
    "adafactor": ("default", "adafactor-fp32"),
    "adafactor-m32": ("default", "adafactor-fp32"),
    "adafactor-m8": ("default", "adafactor-fp32", "adafactor-m32"),
    "adafactor-m4": ("default", "adafactor-fp32", "adafactor-m32"),
    # the state formats' targets are stated against the 8-bit default
    **{key: ("default",) for key in CONFIGS if key not in ("fp32", "default") and not key.startswith("adafactor")},
}


def config_of(key: str, lr: float):
    """(dtype, factory, label, peak lr) of a run key: a CONFIGS key, or ``KEY@LR`` for that
    configuration at another peak lr (a sweep)."""
    base, sep, value = key.partition("@")
    if base not in CONFIGS:
        raise ValueError(f"unknown configuration {base!r} (known: {', '.join(CONFIGS)})")
    peak = PEAK_LR.get(base, lr)
    if sep:
        try:
            peak = float(value)
        except ValueError:
            raise ValueError(f"{key!r}: the peak lr after '@' must be a number, got {value!r}") from None
        if not (math.isfinite(peak) and peak > 0):
            raise ValueError(f"{key!r}: the peak lr after '@' must be positive and finite")
    dtype, make, label = CONFIGS[base]
    return dtype, make, label, peak


# (shape, steps, warmup, batch, seq, lr, eval seqs, seeds, configurations)
GPU = dict(
    shape="vocab=256,d_model=512,layers=6,heads=8,kv_heads=8,ffn=1408",
    steps=1500,
    warmup=100,
    batch=32,
    seq=256,
    lr=1.5e-3,
    eval_seqs=4096,
    seeds="0,1,2",
    only=",".join(CONFIGS),
    corpus_limit=None,
)
QUICK = dict(
    shape="vocab=256,d_model=64,layers=1,heads=4,kv_heads=4,ffn=192",
    steps=400,
    warmup=40,
    batch=16,
    seq=64,
    lr=3e-3,
    eval_seqs=1024,
    seeds="0,1,2",
    only="fp32,bf16-rtn,block4-nomaster,rot4,default~",
    corpus_limit=2_000_000,
)


def train_one(key: str, seed: int, args, device: str, train: torch.Tensor, held: torch.Tensor) -> dict:
    dtype, make, label, lr = config_of(key, args.lr)
    torch.manual_seed(seed)  # the same initialisation for every configuration of a seed
    model = TinyLM(parse_shape(args.shape, PRESETS["tiny"]), checkpointing=False, device=device, dtype=torch.float32)
    model.to(dtype)
    autocast = contextlib.nullcontext
    opt = make(list(model.parameters()), lr)
    total = args.steps
    t0 = time.perf_counter()
    losses = train_steps(model, opt, train, args, seed, device, autocast)  # the same batches for every optimizer
    per_window = window_losses(model, held, autocast, args.seq, args.eval_seqs)
    final = float(per_window.double().mean())
    return {
        "key": key,
        "seed": seed,
        "label": label,
        "lr": lr,
        "final_eval": final,
        "eval_windows": [round(v, 5) for v in per_window.tolist()],
        "final_train": statistics.fmean(losses[-max(1, total // 20) :]),
        "ok": all(math.isfinite(v) for v in losses) and math.isfinite(final),
        "wall_s": time.perf_counter() - t0,
    }


def summarise(runs: list[dict], seeds: list[int], reference: str = "fp32") -> list[dict]:
    """Per configuration: per-seed loss difference to ``reference`` (%), mean, spread, paired t, and verdict."""
    ref = {r["seed"]: r["final_eval"] for r in runs if r["key"] == reference}
    ref_windows = {r["seed"]: r.get("eval_windows") for r in runs if r["key"] == reference}
    rows = []
    for key in dict.fromkeys(r["key"] for r in runs):
        got = {r["seed"]: r["final_eval"] for r in runs if r["key"] == key}
        paired = [s for s in seeds if s in got and s in ref]
        diffs = [100 * (got[s] - ref[s]) / ref[s] for s in paired]
        label = next(r["label"] for r in runs if r["key"] == key)
        row = {"key": key, "label": label, "loss": [got[s] for s in paired], "diff_pct": diffs}
        windows = {r["seed"]: r.get("eval_windows") for r in runs if r["key"] == key}
        errors = [_eval_error(windows[s], ref_windows[s]) for s in paired]
        if key != reference and errors and None not in errors:
            row["eval_se_pct"] = math.sqrt(statistics.fmean(e * e for e in errors))
        if diffs:
            mean = statistics.fmean(diffs)
            sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
            t = mean / (sd / math.sqrt(len(diffs))) if len(diffs) > 1 and sd > 0 else float("nan")
            verdict = "worse on every seed" if min(diffs) > 0 else "better on every seed" if max(diffs) < 0 else "mixed"
            row.update(mean_pct=mean, sd_pct=sd, t=t, verdict=verdict if key != reference else "reference")
        rows.append(row)
    return rows


def _eval_error(windows, ref_windows) -> float | None:
    """Standard error (%) of one paired difference from the finite held-out sample: the spread of
    the per-window differences over the square root of their number (None without windows)."""
    if not windows or not ref_windows or len(windows) != len(ref_windows) or len(windows) < 2:
        return None
    gaps = [a - b for a, b in zip(windows, ref_windows)]
    return 100 * statistics.stdev(gaps) / math.sqrt(len(gaps)) / statistics.fmean(ref_windows)


def also_against(runs: list[dict], seeds: list[int]) -> dict[str, list[dict]]:
    """reference -> the rows of the configurations ``ALSO_AGAINST`` pairs with it (those that ran)."""
    keys = set(r["key"] for r in runs)
    out = {}
    for key, refs in ALSO_AGAINST.items():
        for ref in refs:
            if ref in keys and any(k.partition("@")[0] == key for k in keys):
                out.setdefault(ref, set()).add(key)
    return {
        ref: [r for r in summarise(runs, seeds, ref) if r["key"].partition("@")[0] in wanted and r["diff_pct"]]
        for ref, wanted in out.items()
    }


def _table(rows: list[dict], reference: str) -> list[str]:
    width = max([16] + [len(r["key"]) for r in rows])
    lines = [
        f"{'config':<{width}} {'held-out loss per seed':<30} {'diff vs ' + reference + ' per seed (%)':<28} "
        f"{'mean':>7} {'sd':>6} {'t':>6} {'eval±':>6}  verdict"
    ]
    for r in rows:
        losses = " ".join(f"{v:.4f}" for v in r["loss"])
        diffs = " ".join(f"{v:+.2f}" for v in r["diff_pct"])
        nan = float("nan")
        stats = (
            f"{r.get('mean_pct', nan):+7.2f} {r.get('sd_pct', nan):6.2f} {r.get('t', nan):6.1f} "
            f"{r.get('eval_se_pct', nan):6.2f}"
        )
        lines.append(f"{r['key']:<{width}} {losses:<30} {diffs:<28} {stats}  {r.get('verdict', '')}")
    return lines


def report(rows: list[dict], settings: dict, also: dict[str, list[dict]] | None = None) -> str:
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in settings.items())] + _table(rows, "fp32")
    own = [r["key"] for r in rows if "@" in r["key"] or r["key"] in PEAK_LR]
    if own:
        lr = settings["lr"]
        lines.append("own peak lr (the others: lr): " + ", ".join(f"{k} {config_of(k, lr)[3]:g}" for k in own))
    ref = [r for r in rows if r["key"] == "fp32"]
    if ref and len(ref[0]["loss"]) > 1:
        spread = 100 * (max(ref[0]["loss"]) - min(ref[0]["loss"])) / min(ref[0]["loss"])
        lines.append(f"fp32's own seed-to-seed range: {spread:.2f}% (what unpaired comparisons would be up against)")
    noise = _noise(rows)
    if noise is not None:
        lines.append(
            f"trajectory noise: the same configuration with other rounding draws moves the loss by {noise:.2f}% "
            "(rms over seeds of default~ against default, or against fp32 when default did not run)"
        )
    evals = [r["eval_se_pct"] for r in rows if "eval_se_pct" in r]
    if evals:
        lines.append(
            f"of which the held-out sample's part (eval±: standard error of a paired difference over the "
            f"{settings['eval_seqs']} held-out windows, rms over seeds): {min(evals):.3f}-{max(evals):.3f}%"
        )
    worse = [r for r in rows if r["key"] in KNOWN_WORSE]
    seen = [r["key"] for r in worse if r.get("verdict") == "worse on every seed"]
    beyond = [r["key"] for r in worse if r["key"] in seen and (noise is None or r["mean_pct"] > 2 * noise)]
    lines.append(
        f"known-worse configurations worse than fp32 on every seed: {len(seen)} of {len(worse)} ({', '.join(seen)}); "
        f"of those by more than twice the trajectory noise: {', '.join(beyond) or 'none'}"
    )
    for reference, paired in (also or {}).items():
        lines += ["", f"paired against {reference} ({next(r['label'] for r in rows if r['key'] == reference)}):"]
        lines += _table(paired, reference)
    return "\n".join(lines)


def _noise(rows: list[dict]) -> float | None:
    """rms over seeds of the control's difference to the same configuration (in %), or None."""
    by_key = {r["key"]: r for r in rows}
    control = by_key.get("default~")
    if control is None or not control["diff_pct"]:
        return None
    base = by_key.get("default")
    if base is not None and len(base["diff_pct"]) == len(control["diff_pct"]):
        gaps = [a - b for a, b in zip(control["diff_pct"], base["diff_pct"])]
    else:
        gaps = control["diff_pct"]
    return math.sqrt(statistics.fmean(g * g for g in gaps))


def _merge_parts(out: str, data: dict) -> None:
    """Move the runs of worker part files (``OUT.partN``, same settings) into ``data`` and ``out``."""
    import glob

    for part in sorted(glob.glob(glob.escape(out) + ".part*")):
        with open(part) as f:
            saved = json.load(f)
        if saved.get("settings") == data["settings"]:
            have = {(r["key"], r["seed"]) for r in data["runs"]}
            data["runs"] += [r for r in saved["runs"] if (r["key"], r["seed"]) not in have]
        os.remove(part)
    with open(out, "w") as f:
        json.dump(data, f, indent=1)


def _run_workers(argv: list[str], todo: list[tuple[str, int]], args, data: dict) -> None:
    """Train ``todo`` in ``args.jobs`` worker processes, each with its own part file, then merge."""
    import subprocess
    import tempfile

    out = args.out or os.path.join(tempfile.mkdtemp(), "quality.json")
    passthrough, skip = [], False
    for a in argv:  # drop the parent's --jobs and --out (each worker writes its own part file)
        if skip:
            skip = False
        elif a in ("--jobs", "--out"):
            skip = True
        elif not a.startswith(("--jobs=", "--out=")):
            passthrough.append(a)
    procs = []
    for j in range(args.jobs):
        mine = todo[j :: args.jobs]
        if not mine:
            continue
        part = f"{out}.part{j}"
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--out", part]
        cmd += ["--pairs", ",".join(f"{k}:{s}" for k, s in mine)]
        procs.append((part, subprocess.Popen(cmd)))
    # a SIGTERM (e.g. from `timeout`) must not leave workers training on: stop them, keep their runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        failed = [p.wait() for _, p in procs]
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        _merge_parts(out, data)
    if any(failed):
        raise SystemExit(f"a worker failed (exit codes {failed}); finished runs are kept in {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small CPU settings (about 3 minutes)")
    for name, value in GPU.items():
        kind = int if isinstance(value, int) and name != "corpus_limit" else str
        parser.add_argument("--" + name.replace("_", "-"), type=float if name == "lr" else kind, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="JSON file: runs are appended, finished ones skipped")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at a time, one process each")
    parser.add_argument("--pairs", default=None, help=argparse.SUPPRESS)  # a worker's KEY:SEED list
    parser.add_argument("--report-only", action="store_true", help="merge part files and report; train nothing")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else GPU
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.corpus_limit = int(args.corpus_limit) if args.corpus_limit not in (None, "None") else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # small tensors: more threads only add synchronisation
    seeds = [int(s) for s in str(args.seeds).split(",")]
    keys = ["fp32"] + [k for k in str(args.only).split(",") if k and k != "fp32"]
    for key in keys:
        try:
            config_of(key, args.lr)
        except ValueError as exc:
            parser.error(str(exc))
    settings = {k: getattr(args, k) for k in ("shape", "steps", "warmup", "batch", "seq", "lr", "eval_seqs")}
    settings["corpus_limit"] = args.corpus_limit
    data = {"settings": settings, "runs": []}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            saved = json.load(f)
        if saved.get("settings") == settings:
            data = saved
    if args.out and args.pairs is None:
        _merge_parts(args.out, data)  # parts left by an interrupted --jobs run
    train, held, digest = corpus(args.corpus_limit)
    train, held = train.to(device), held.to(device)
    data["corpus"] = digest
    known = [r for r in data["runs"] if r["key"].partition("@")[0] in CONFIGS]
    # a run at another peak lr than its configuration's now (PEAK_LR changed) is measured again
    data["runs"] = [r for r in known if r.get("lr", args.lr) == config_of(r["key"], args.lr)[3]]
    done = {(r["key"], r["seed"]) for r in data["runs"]}
    t_start = time.perf_counter()
    # seed order: an interrupted run has whole seeds first
    todo = [(key, seed) for seed in seeds for key in keys if (key, seed) not in done]
    if args.report_only:
        todo = []
    elif args.pairs is not None:
        todo = [(k, int(s)) for k, s in (p.split(":") for p in args.pairs.split(",")) if (k, int(s)) not in done]
    elif args.jobs > 1 and todo:
        _run_workers(argv if argv is not None else sys.argv[1:], todo, args, data)
        todo = []
    for key, seed in todo:
        run = train_one(key, seed, args, device, train, held)
        data["runs"].append(run)
        print(f"{key:<16} seed {seed}: held-out {run['final_eval']:.4f} ({run['wall_s']:.1f} s)", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(data, f, indent=1)
    rows = summarise(data["runs"], seeds)
    also = also_against(data["runs"], seeds)
    data["summary"], data["also_against"] = rows, also
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(report(rows, settings, also))
    print(f"total {time.perf_counter() - t_start:.0f} s on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
