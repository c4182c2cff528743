"""Issue 6, part 4: training quality. A Llama-shaped byte-level model (~26M parameters) trained from
scratch on Python's standard-library source with every optimizer of the line-up; final held-out
loss, loss curves, and the gap to fp32 AdamW (key A) against A's seed-to-seed spread.

    python benchmarks/compare_quality.py --out $OUT/quality.json --parallel 6 --budget-s 450   # GPU, resumes
    python benchmarks/compare_quality.py --out q.json --steps 20 --batch 4 --seq 32 --eval-seqs 16 \
        --shape layers=2,d_model=64,heads=2,ffn=192 --corpus-limit 2000000 --only A,FO,D     # CPU smoke

By default A (fp32 AdamW) and FO (fusedopt's default) run seeds 0, 1, 2 and every other key
seed 0; runs go in seed order, so an interrupted run has the one-seed comparison first.
``--parallel N`` trains N runs at once in worker processes: the model is small and a run is
host-bound, so the GPU has room (wall times then include the sharing: compare step times from
part 3, not from here).

Resumable and sliced: each (key, seed) run is appended to ``--out`` when it ends and skipped when
it is there already, and ``--budget-s`` starts no run that the time already spent per run says
would not finish in time (so a device call never dies mid-run). The file records the corpus
hash: runs on another corpus (another Python version) are refused, not mixed.

Same for every optimizer and seed s: the model (``fusedopt.profile.models.TinyLM``, no
checkpointing) is initialised in fp32 from seed s, then cast to bf16 for every configuration but
A (fp32 parameters, bf16 autocast); the batches (random 256-byte windows of the training files,
batch 16) come from seed s; the schedule is ``--warmup`` linear steps then cosine to 0 of peak
``--lr``; betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter. The training text is
every ``*.py`` file of the running Python's standard library (sorted paths, site-packages
excluded); files whose path hashes to 0 mod 20 are held out for evaluation.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import zlib

import compare_io
import torch
from competitors import HPARAMS, REFERENCE, select

from fusedopt.profile.models import PRESETS, TinyLM, parse_shape

DEFAULT_SHAPE = "vocab=256,d_model=512,layers=8,heads=8,kv_heads=8,ffn=1408"
EVAL_SEQS = 256


def corpus(limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(training bytes, held-out bytes, sha256 of both) from the standard library's source."""
    root = sysconfig.get_paths()["stdlib"]
    train, held = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, "rb") as f:
                    (held if zlib.crc32(rel.encode()) % 20 == 0 else train).append(f.read())
    train_bytes, held_bytes = b"".join(train)[:limit], b"".join(held)[:limit]
    digest = hashlib.sha256(train_bytes + b"\0" + held_bytes).hexdigest()[:16]
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train_bytes), as_tensor(held_bytes), digest


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq + 1, device=starts.device)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


def next_token_loss(model, x, y) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def warmup_cosine(warm: int, total: int):
    """The quality benchmarks' LR multiplier: ``warm`` linear steps, then cosine to 0 at ``total``."""

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    return factor


@torch.no_grad()
def window_losses(model, held: torch.Tensor, autocast, seq: int, n: int = EVAL_SEQS) -> torch.Tensor:
    """The mean next-token loss of each of ``n`` windows of ``seq`` bytes spread evenly over ``held``
    (fp32, on the CPU): their mean is the held-out loss; their spread, how precisely it is known."""
    starts = torch.linspace(0, held.numel() - seq - 2, n, device=held.device).long()
    out = []
    for chunk in starts.split(64):
        x, y = windows(held, chunk, seq)
        with autocast():
            logits = model(x)
        per_token = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")
        out.append(per_token.mean(dim=1))
    return torch.cat(out).cpu()


def evaluate(model, held: torch.Tensor, autocast, seq: int, n: int = EVAL_SEQS) -> float:
    return float(window_losses(model, held, autocast, seq, n).double().mean())


def train_steps(
    model, opt, train: torch.Tensor, args, seed: int, device: str, autocast, after_step=None
) -> list[float]:
    """``args.steps`` steps of the quality benchmarks' loop: the warm-up + cosine schedule, batches
    drawn by a generator seeded from ``seed`` (the same batches, in the same order, for every
    optimizer). ``after_step(step)`` runs after each step (1-based). Returns the training losses."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    gen = torch.Generator(device="cpu").manual_seed(10_000 + seed)
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, train.numel() - args.seq - 2, (args.batch,), generator=gen).to(device)
        x, y = windows(train, starts, args.seq)
        with autocast():
            loss = next_token_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.detach())
        if after_step is not None:
            after_step(step + 1)
    return [float(x) for x in torch.stack(losses).cpu()]


def train_one(entry, seed: int, args, device: str, train: torch.Tensor, held: torch.Tensor) -> dict:
    torch.manual_seed(seed)
    shape = parse_shape(args.shape, PRESETS["tiny"])
    model = TinyLM(shape, checkpointing=False, device=device, dtype=torch.float32)
    hparams = {**HPARAMS, "lr": args.lr}
    config = entry.optimizer_config(hparams)
    if config.autocast is None:
        model.to(torch.bfloat16)
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if config.autocast else contextlib.nullcontext
    opt = config.build(model.parameters(), model=model, device_type=device)
    total = args.steps
    evals = []

    def maybe_evaluate(step: int) -> None:
        if step % args.eval_every == 0 or step == total:
            evals.append([step, evaluate(model, held, autocast, args.seq, args.eval_seqs)])

    t0 = time.perf_counter()
    losses = train_steps(model, opt, train, args, seed, device, autocast, after_step=maybe_evaluate)
    wall = time.perf_counter() - t0
    return {
        "key": entry.key,
        "seed": seed,
        "label": entry.label,
        "ok": all(math.isfinite(x) for x in losses),
        "final_eval": evals[-1][1],
        "final_train": statistics.fmean(losses[-max(1, total // 20) :]),
        "train_loss": losses,
        "eval": evals,
        "wall_s": wall,
        "ms_per_step": wall / total * 1e3,
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def summary(data: dict) -> dict:
    """Per key: final held-out losses over seeds, mean, spread (max - min) and the gap to A."""
    by_key: dict[str, list[float]] = {}
    for run in data["runs"].values():
        if run.get("ok"):
            by_key.setdefault(run["key"], []).append(run["final_eval"])
    ref = by_key.get(REFERENCE)
    ref_mean = statistics.fmean(ref) if ref else None
    ref_spread = (max(ref) - min(ref)) if ref and len(ref) > 1 else None
    out = {}
    for key, values in by_key.items():
        mean = statistics.fmean(values)
        row = {"n": len(values), "mean": mean, "min": min(values), "max": max(values)}
        row["std"] = statistics.stdev(values) if len(values) > 1 else None
        if ref_mean is not None:
            row["gap"] = mean - ref_mean
            row["gap_pct"] = 100 * (mean - ref_mean) / ref_mean
            row["within_ref_spread"] = None if ref_spread is None else abs(mean - ref_mean) <= ref_spread
        out[key] = row
    return out


def report(data: dict) -> str:
    s = summary(data)
    labels = {r["key"]: r["label"] for r in data["runs"].values()}
    rows = []
    for key, r in s.items():
        spread = "-" if r["n"] < 2 else f"{r['min']:.4f}..{r['max']:.4f}"
        within = {None: "-", True: "yes", False: "no"}[r.get("within_ref_spread")]
        gap = "-" if "gap" not in r else f"{r['gap']:+.4f} ({r['gap_pct']:+.2f}%)"
        rows.append([key, labels[key], r["n"], f"{r['mean']:.4f}", spread, gap, within])
    times = [r["wall_s"] for r in data["runs"].values()]
    st = data["settings"]
    lines = [
        f"{st['num_params']:,} params, {st['steps']} steps, batch {st['batch']} x {st['seq']}, corpus {st['corpus']}",
        "",
        compare_io.table(
            ["key", "optimizer", "seeds", "held-out loss", "seed range", "gap to A", "|gap| <= A spread"], rows
        ),
        "",
        f"runs: {len(times)}, wall s per run: min {min(times):.0f}, max {max(times):.0f}" if times else "no runs",
    ]
    return "\n".join(lines)


def plot(plt, data: dict):
    """The figure, or why there is none."""
    runs = sorted(data["runs"].values(), key=lambda r: (r["key"], r["seed"]))
    if not runs:
        return "no runs"
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(13, 5))
    cmap = plt.get_cmap("tab20")
    keys = sorted({r["key"] for r in runs})
    for run in runs:
        color = cmap(keys.index(run["key"]) % 20)
        k = max(1, len(run["train_loss"]) // 100)
        smooth = [statistics.fmean(run["train_loss"][i : i + k]) for i in range(0, len(run["train_loss"]), k)]
        label = run["key"] if run["seed"] == min(r["seed"] for r in runs if r["key"] == run["key"]) else None
        ax.plot([i + k for i in range(0, len(run["train_loss"]), k)], smooth, color=color, lw=0.8, label=label)
        steps, values = zip(*run["eval"])
        zoom.plot(steps, values, color=color, marker=".", lw=0.8, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over windows of steps)")
    ax.legend(fontsize=7, ncol=2)
    zoom.set_xlabel("step")
    zoom.set_ylabel("held-out loss")
    finals = [r["eval"][-1][1] for r in runs]
    lo, hi = min(finals), max(finals)
    zoom.set_ylim(lo - 0.02, hi + 0.1 + 0.5 * (hi - lo))
    zoom.set_title("held-out loss (zoomed on the end)")
    return fig


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _settings_argv(args) -> list[str]:
    """The command-line options that define a run, for a worker process."""
    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", repr(args.lr)]
    argv += ["--eval-every", str(args.eval_every), "--shape", args.shape, "--batch", str(args.batch)]
    argv += ["--seq", str(args.seq), "--eval-seqs", str(args.eval_seqs), "--device", args.device]
    return argv + (["--corpus-limit", str(args.corpus_limit)] if args.corpus_limit else [])


def _record(data: dict, run: dict, out: str) -> None:
    data["runs"][f"{run['key']}/{run['seed']}"] = run
    compare_io.save(out, data)
    print(f"[{run['key']}/{run['seed']}] held-out {run['final_eval']:.4f}, {run['wall_s']:.0f} s", flush=True)


def _estimate(data: dict, key: str) -> float:
    done = [r["wall_s"] for r in data["runs"].values() if r["key"] == key]
    return max(done or [r["wall_s"] for r in data["runs"].values()] or [0.0])


def run_all(todo, args, device, data, t_start, train, held) -> None:
    """Run the (entry, seed) pairs, ``--parallel`` at a time (worker processes sharing the GPU)."""

    def over_budget(entry) -> bool:
        guess = 1.2 * _estimate(data, entry.key)
        if args.budget_s and time.perf_counter() - t_start + guess > args.budget_s:
            print(f"[{entry.key}] not started: about {guess:.0f} s would pass --budget-s", flush=True)
            return True
        return False

    if args.parallel <= 1:
        train, held = train.to(device), held.to(device)
        for entry, seed in todo:
            if not over_budget(entry):
                _record(data, train_one(entry, seed, args, device, train, held), args.out)
                if device == "cuda":
                    torch.cuda.empty_cache()
        return
    running = []
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        queue = list(todo)
        while queue or running:
            while queue and len(running) < args.parallel:
                entry, seed = queue.pop(0)
                if over_budget(entry):
                    continue
                path = os.path.join(tmp, f"{entry.key}-{seed}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker-run", f"{entry.key}/{seed}"]
                cmd += ["--worker-out", path] + _settings_argv(args)
                running.append((subprocess.Popen(cmd), path, f"{entry.key}/{seed}"))
            time.sleep(0.5)
            for item in [r for r in running if r[0].poll() is not None]:
                running.remove(item)
                proc, path, name = item
                if os.path.exists(path):
                    with open(path) as f:
                        _record(data, json.load(f), args.out)
                else:
                    print(f"[{name}] worker failed (exit code {proc.returncode})", flush=True)


def worker(args) -> int:
    key, seed = args.worker_run.split("/")
    torch.set_num_threads(2)  # several workers share the host's cores
    train, held, _ = corpus(args.corpus_limit)
    entry = select(key, "quality")[0]
    run = train_one(entry, int(seed), args, args.device, train.to(args.device), held.to(args.device))
    with open(args.worker_out, "w") as f:
        json.dump(run, f)
    return 0


def run_settings(args, shape, train, held, digest) -> dict:
    """What must match for runs to be compared, in the form the results file stores it (JSON turns
    tuples into lists: compared unconverted, a resumed call refused its own file, 2026-11-30)."""
    settings = {
        "steps": args.steps,
        "warmup": args.warmup,
        "lr": args.lr,
        "shape": args.shape,
        "num_params": shape.num_params(),
        "batch": args.batch,
        "seq": args.seq,
        "eval_seqs": args.eval_seqs,
        "corpus": digest,
        "corpus_bytes": [train.numel(), held.numel()],
        "hparams": {**HPARAMS, "lr": args.lr},
    }
    return json.loads(json.dumps(settings))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated line-up keys (default: the part's line-up)")
    parser.add_argument("--seeds", default="0", help="seeds of every key, comma-separated (default 0)")
    parser.add_argument("--multi-seed-keys", default="A,FO", help="keys run with --multi-seeds (default A,FO)")
    parser.add_argument("--multi-seeds", default="0,1,2", help="their seeds (default 0,1,2)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time, in worker processes")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--shape", default=DEFAULT_SHAPE)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--eval-seqs", type=int, default=EVAL_SEQS, help="held-out windows per evaluation")
    parser.add_argument("--corpus-limit", type=int, help="use at most this many bytes of each split (tests)")
    parser.add_argument("--budget-s", type=float, help="start no run that would end after this many seconds")
    parser.add_argument("--device", default=None)
    compare_io.output_args(parser, "out/compare/quality.json", "loss-curve")
    parser.add_argument("--worker-run", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    device = args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.worker_run:
        return worker(args)
    if compare_io.report_only(args, report, plot):
        return 0
    data = compare_io.load(args.out)
    train, held, digest = corpus(args.corpus_limit)
    shape = parse_shape(args.shape, PRESETS["tiny"])
    settings = run_settings(args, shape, train, held, digest)
    if data and data.get("settings") != settings:
        print(f"error: {args.out} holds runs of other settings or another corpus:", file=sys.stderr)
        print(f"  there: {data.get('settings')}\n  here:  {settings}", file=sys.stderr)
        return 2
    data.setdefault("settings", settings)
    data.setdefault("runs", {})
    data.setdefault("env", compare_io.environment())
    todo = []
    for seed in sorted({*_ints(args.seeds), *_ints(args.multi_seeds)}):
        for entry in select(args.only, "quality"):
            wanted = _ints(args.multi_seeds) if entry.key in args.multi_seed_keys.split(",") else _ints(args.seeds)
            if seed in wanted and f"{entry.key}/{seed}" not in data["runs"]:
                why = entry.unavailable(device)
                if why:
                    data.setdefault("skipped", {})[entry.key] = why
                else:
                    todo.append((entry, seed))
    for key, why in data.get("skipped", {}).items():
        print(f"[{key}] skipped: {why}", flush=True)
    run_all(todo, args, device, data, t_start, train, held)
    if not data.get("runs"):
        print("no runs yet")
        return 0
    compare_io.finish(report(data), plot, data, args.out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
