"""Clipping under gradient release: each one-pass method against exact global clipping, with and
without gradient spikes, on paired seeds.

    python benchmarks/clipping_quality.py --out $OUT/clipping.json --parallel 8        # GPU, ~2-3 min
    python benchmarks/clipping_quality.py --quick --out /tmp/clipping.json             # CPU smoke test

A byte-level Llama-shaped model (``fusedopt.profile.models.TinyLM``, bf16 parameters) trained on
the standard library's source (``compare_quality.corpus``) with fusedopt's AdamW default
(8-bit state, 24-bit master), betas (0.9, 0.95), weight decay 0.1, ``--lr`` with linear warm-up
then cosine to 0, ``max_grad_norm=1.0``. Configurations: ``exact`` (``fused=False``: torch's
``clip_grad_norm_`` in ``step()``), each ``release_clipping`` method with ``fused=True``, and
``none`` (``fused=True`` without clipping). Paired: for a seed, every configuration starts from the
same initialisation and sees the same batches; with ``--spikes``, the same steps (1% of them,
after warm-up) have their loss multiplied by ``--spike-factor`` (a bad batch: every gradient grows
by that factor). Reported per configuration: the final held-out loss (mean over seeds and the
per-seed difference to ``exact``), and the recovery after spikes: the mean training loss over the
50 steps after each spike minus the same steps of the same configuration's run without spikes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_quality import corpus, evaluate, next_token_loss, warmup_cosine, windows  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.clipping import CLIP_METHODS  # noqa: E402
from fusedopt.profile.models import TinyLM, parse_shape  # noqa: E402

CONFIGS = ("exact", *CLIP_METHODS, "none")
SHAPE = "vocab=256,d_model=256,layers=4,heads=4,kv_heads=4,ffn=704"
QUICK_SHAPE = "vocab=256,d_model=64,layers=2,heads=2,kv_heads=2,ffn=176"
RECOVERY = 50  # steps after a spike over which its cost is measured


def spike_steps(seed: int, steps: int, warmup: int) -> list[int]:
    gen = torch.Generator().manual_seed(20_000 + seed)
    count = max(1, steps // 100)
    return sorted((warmup + torch.randperm(steps - warmup - RECOVERY, generator=gen)[:count]).tolist())


def train_one(config: str, seed: int, spiky: bool, args) -> dict:
    torch.set_num_threads(2)
    device = args.device
    train, held, _ = corpus(args.corpus_limit)
    train, held = train.to(device), held.to(device)
    torch.manual_seed(seed)
    model = TinyLM(parse_shape(args.shape), checkpointing=False, device=device, dtype=torch.float32)
    model.to(torch.bfloat16)
    options = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if config == "exact":
        opt = fusedopt.AdamW(model.parameters(), **options, max_grad_norm=1.0)
    elif config == "none":
        opt = fusedopt.AdamW(model.parameters(), **options, fused=True, max_grad_norm=None)
    else:
        opt = fusedopt.AdamW(model.parameters(), **options, fused=True, max_grad_norm=1.0, release_clipping=config)
    warm, total = args.warmup, args.steps

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warm, total))
    spikes = set(spike_steps(seed, total, warm)) if spiky else set()
    gen = torch.Generator().manual_seed(10_000 + seed)
    losses, norms = [], []
    t0 = time.perf_counter()
    for step in range(total):
        starts = torch.randint(0, train.numel() - args.seq - 2, (args.batch,), generator=gen).to(device)
        x, y = windows(train, starts, args.seq)
        loss = next_token_loss(model, x, y)
        (loss * args.spike_factor if step in spikes else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.detach())
        if opt.grad_norm is not None:
            norms.append(opt.grad_norm.detach())
    final = evaluate(model, held, contextlib.nullcontext, args.seq)
    return {
        "config": config,
        "seed": seed,
        "spikes": sorted(spikes),
        "train_loss": [float(v) for v in torch.stack(losses).cpu()],
        "grad_norm": [float(v) for v in torch.stack(norms).cpu()] if norms else [],
        "final_eval": final,
        "wall_s": time.perf_counter() - t0,
    }


def summarise(runs: list[dict]) -> str:
    by = {(r["config"], r["seed"], bool(r["spikes"])): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        "| config | spikes | held-out loss (mean of seeds) | per-seed difference to exact | recovery after a spike |"
    ]
    lines.append("|---|---|---|---|---|")
    for spiky in (False, True):
        for config in CONFIGS:
            finals, diffs, recov = [], [], []
            for s in seeds:
                run, ref = by.get((config, s, spiky)), by.get(("exact", s, spiky))
                if run is None:
                    continue
                finals.append(run["final_eval"])
                if ref is not None:
                    diffs.append(run["final_eval"] - ref["final_eval"])
                calm = by.get((config, s, False))
                if spiky and calm is not None:
                    for t in run["spikes"]:
                        after = slice(t + 1, t + 1 + RECOVERY)
                        recov.append(
                            statistics.fmean(run["train_loss"][after]) - statistics.fmean(calm["train_loss"][after])
                        )
            if not finals:
                continue
            diff = " ".join(f"{d:+.4f}" for d in diffs)
            recovery = f"{statistics.fmean(recov):+.4f}" if recov else "-"
            lines.append(
                f"| {config} | {'yes' if spiky else 'no'} | {statistics.fmean(finals):.4f} | {diff} | {recovery} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--spikes", default="no,yes", help="no, yes or both (default)")
    parser.add_argument("--spike-factor", type=float, default=1000.0)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--shape", default=SHAPE)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--corpus-limit", type=int)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a CPU smoke run: tiny model, few steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.shape, args.warmup, args.batch, args.seq = QUICK_SHAPE, 10, 4, 32
        args.steps = min(args.steps, 160)
        args.corpus_limit = args.corpus_limit or 2_000_000
    jobs = [
        (config, int(seed), spiky == "yes")
        for seed in args.seeds.split(",")
        for spiky in args.spikes.split(",")
        for config in args.configs.split(",")
    ]
    t0 = time.perf_counter()
    runs = []
    if args.parallel <= 1:
        runs = [train_one(*job, args) for job in jobs]
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.parallel, mp_context=context) as pool:
            runs = list(pool.map(train_one, *zip(*jobs), [args] * len(jobs)))
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    settings.update(torch=torch.__version__, wall_s=time.perf_counter() - t0)
    with open(args.out, "w") as f:
        json.dump({"settings": settings, "runs": runs}, f)
    print(json.dumps(settings))
    print(summarise(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
