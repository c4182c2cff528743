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

The regime is chosen so that rounding matters: a high peak learning rate and a cosine decay to 0,
so that late updates are small against a bf16 ulp (round-to-nearest drops them, and the decoupled
weight decay ``lr * 0.1 * p`` is far below half an ulp), and weight decay 0.1. The known-worse
configurations (pure bf16 with round-to-nearest; bf16 without master correction; the 4-bit block
format) must come out worse than fp32 beyond the noise: the report says for each configuration
whether it is worse (or better) on every seed and gives the paired t statistic.

    python benchmarks/format_quality.py --quick                   # CPU, about 3 minutes on one core
    python benchmarks/format_quality.py --out quality.json        # GPU (default settings), ~20 min on an H200

``--only KEY,KEY`` picks configurations (``fp32`` always runs: it is the reference), ``--seeds``
the seeds. Results are appended to ``--out`` run by run, and runs already there (same settings) are
skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_quality import corpus, evaluate, next_token_loss, warmup_cosine, windows  # noqa: E402

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
    "turboadam": (
        torch.bfloat16,
        lambda ps, lr: __import__("turboadam").TurboAdam(ps, lr=lr, **HPARAMS),
        "TurboAdam 0.2.0 (its defaults: UState + 1Q, 0.81 B/param; bf16 parameters, no master)",
    ),
}
KNOWN_WORSE = ("bf16-rtn", "nomaster", "block4", "block4-nomaster")

# (shape, steps, warmup, batch, seq, lr, eval seqs, seeds, configurations)
GPU = dict(
    shape="vocab=256,d_model=512,layers=6,heads=8,kv_heads=8,ffn=1408",
    steps=1500,
    warmup=100,
    batch=32,
    seq=256,
    lr=3e-3,
    eval_seqs=256,
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
    eval_seqs=64,
    seeds="0,1,2",
    only="fp32,bf16-rtn,block4-nomaster,rot4,default~",
    corpus_limit=2_000_000,
)


def train_one(key: str, seed: int, args, device: str, train: torch.Tensor, held: torch.Tensor) -> dict:
    dtype, make, label = CONFIGS[key]
    torch.manual_seed(seed)  # the same initialisation for every configuration of a seed
    model = TinyLM(parse_shape(args.shape, PRESETS["tiny"]), checkpointing=False, device=device, dtype=torch.float32)
    model.to(dtype)
    autocast = contextlib.nullcontext
    opt = make(list(model.parameters()), args.lr)
    warm, total = args.warmup, args.steps

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warm, total))
    gen = torch.Generator().manual_seed(10_000 + seed)  # the same batches, in the same order
    losses = []
    t0 = time.perf_counter()
    for _ in range(total):
        starts = torch.randint(0, train.numel() - args.seq - 2, (args.batch,), generator=gen).to(device)
        x, y = windows(train, starts, args.seq)
        with autocast():
            loss = next_token_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.detach())
    final = evaluate(model, held, autocast, args.seq, args.eval_seqs)
    losses = [float(v) for v in torch.stack(losses).cpu()]
    return {
        "key": key,
        "seed": seed,
        "label": label,
        "final_eval": final,
        "final_train": statistics.fmean(losses[-max(1, total // 20) :]),
        "ok": all(math.isfinite(v) for v in losses) and math.isfinite(final),
        "wall_s": time.perf_counter() - t0,
    }


def summarise(runs: list[dict], seeds: list[int]) -> list[dict]:
    """Per configuration: per-seed loss difference to fp32 (%), mean, spread, paired t, and verdict."""
    ref = {r["seed"]: r["final_eval"] for r in runs if r["key"] == "fp32"}
    rows = []
    for key in dict.fromkeys(r["key"] for r in runs):
        got = {r["seed"]: r["final_eval"] for r in runs if r["key"] == key}
        paired = [s for s in seeds if s in got and s in ref]
        diffs = [100 * (got[s] - ref[s]) / ref[s] for s in paired]
        row = {"key": key, "label": CONFIGS[key][2], "loss": [got[s] for s in paired], "diff_pct": diffs}
        if diffs:
            mean = statistics.fmean(diffs)
            sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
            t = mean / (sd / math.sqrt(len(diffs))) if len(diffs) > 1 and sd > 0 else float("nan")
            verdict = "worse on every seed" if min(diffs) > 0 else "better on every seed" if max(diffs) < 0 else "mixed"
            row.update(mean_pct=mean, sd_pct=sd, t=t, verdict=verdict if key != "fp32" else "reference")
        rows.append(row)
    return rows


def report(rows: list[dict], settings: dict) -> str:
    lines = [
        "settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        f"{'config':<16} {'held-out loss per seed':<30} {'diff vs fp32 per seed (%)':<28} "
        f"{'mean':>7} {'sd':>6} {'t':>6}  verdict",
    ]
    for r in rows:
        losses = " ".join(f"{v:.4f}" for v in r["loss"])
        diffs = " ".join(f"{v:+.2f}" for v in r["diff_pct"])
        nan = float("nan")
        stats = f"{r.get('mean_pct', nan):+7.2f} {r.get('sd_pct', nan):6.2f} {r.get('t', nan):6.1f}"
        lines.append(f"{r['key']:<16} {losses:<30} {diffs:<28} {stats}  {r.get('verdict', '')}")
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
    worse = [r for r in rows if r["key"] in KNOWN_WORSE]
    seen = [r["key"] for r in worse if r.get("verdict") == "worse on every seed"]
    beyond = [r["key"] for r in worse if r["key"] in seen and (noise is None or r["mean_pct"] > 2 * noise)]
    lines.append(
        f"known-worse configurations worse than fp32 on every seed: {len(seen)} of {len(worse)} ({', '.join(seen)}); "
        f"of those by more than twice the trajectory noise: {', '.join(beyond) or 'none'}"
    )
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small CPU settings (about 3 minutes)")
    for name, value in GPU.items():
        kind = int if isinstance(value, int) and name != "corpus_limit" else str
        parser.add_argument("--" + name.replace("_", "-"), type=float if name == "lr" else kind, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="JSON file: runs are appended, finished ones skipped")
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
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown} (known: {', '.join(CONFIGS)})")
    settings = {k: getattr(args, k) for k in ("shape", "steps", "warmup", "batch", "seq", "lr", "eval_seqs")}
    settings["corpus_limit"] = args.corpus_limit
    data = {"settings": settings, "runs": []}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            saved = json.load(f)
        if saved.get("settings") == settings:
            data = saved
    train, held, digest = corpus(args.corpus_limit)
    train, held = train.to(device), held.to(device)
    data["corpus"] = digest
    done = {(r["key"], r["seed"]) for r in data["runs"]}
    t_start = time.perf_counter()
    for seed in seeds:  # seed order: an interrupted run has whole seeds first
        for key in keys:
            if (key, seed) in done:
                continue
            run = train_one(key, seed, args, device, train, held)
            data["runs"].append(run)
            print(f"{key:<16} seed {seed}: held-out {run['final_eval']:.4f} ({run['wall_s']:.1f} s)", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(data, f, indent=1)
    rows = summarise(data["runs"], seeds)
    data["summary"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(report(rows, settings))
    print(f"total {time.perf_counter() - t_start:.0f} s on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
