"""The benchmarks' shared harness: model and data, timing in one process as ratios, the paired-seed
quality runner, results files and reports, and the fingerprints that compare two source trees bit
for bit.

The scripts of ``benchmarks/`` import it as ``import harness`` (the folder is not a package: each
script puts its own folder on ``sys.path``). The optimizers and the line-up of other libraries come
from the profiler (``fusedopt.profile.competitors``). Nothing here imports fusedopt at module level,
so the fingerprints also run against another tree's fusedopt (``PYTHONPATH=<tree>``, tree_ab.sh).

    python benchmarks/harness.py lineup                     # the line-up and what is installed here
    python benchmarks/harness.py bits --out bits.json       # fingerprints of this fusedopt (CUDA)
    python benchmarks/harness.py bits --device cpu --algorithms adamw --formats norm2-root4 --out /tmp/b.json
    python benchmarks/harness.py same old.json new.json     # which configurations are bit-identical
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import signal
import statistics
import sys
import sysconfig
import tempfile
import time
import zlib

import torch

GIB, MIB = 1 << 30, 1 << 20

# --- the line-up (fusedopt/profile/lineup.py) ---------------------------------------------

# What each benchmark runs by default (its --only narrows it).
PARTS = {
    "memory": None,  # every entry
    "step": ("A", "B", "D", "E", "E4", "F", "H", "I0", "FO", "FO4", "FON", "FO4N"),
    "quality": ("A", "B", "C", "D", "E", "E4", "F", "G", "H", "I", "FO", "FO4", "FON", "FO4N"),
    "fit": ("A", "B", "C", "D", "E4", "F", "G", "H", "I", "FO", "FOR", "FO4R", "FO4NR"),
}


def select(keys: str | None, part: str) -> list:
    """Line-up entries by comma-separated keys (``"A,FO,FOR"``), or the part's default line-up; an
    unknown key ends the script with a message."""
    from fusedopt.profile.lineup import BY_KEY, lineup
    from fusedopt.profile.models import UserError

    try:
        return lineup(keys, PARTS[part] or tuple(BY_KEY))
    except UserError as exc:
        raise SystemExit(str(exc)) from None


# --- model and data ----------------------------------------------------------------------------

EVAL_SEQS = 256


@functools.cache
def _corpus(limit: int | None) -> tuple[bytes, bytes]:
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
    return b"".join(train)[:limit], b"".join(held)[:limit]


def corpus(limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(training bytes, held-out bytes, sha256 of both) of the running Python's standard-library
    source: every ``*.py`` file (sorted paths, site-packages excluded); files whose path hashes to 0
    mod 20 are held out. ``limit``: at most that many bytes of each split (smoke tests)."""
    train, held = _corpus(limit)
    digest = hashlib.sha256(train + b"\0" + held).hexdigest()[:16]
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(held), digest


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows of ``seq`` bytes at ``starts``."""
    idx = starts[:, None] + torch.arange(seq + 1, device=starts.device)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


def next_token_loss(model, x, y) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def warmup_cosine(warm: int, total: int):
    """The LR multiplier of the training benchmarks: ``warm`` linear steps, then cosine to 0 at ``total``."""

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


def model_shapes(preset: str) -> list[tuple[int, ...]]:
    """The parameter shapes of the profiler's Llama-style model ``preset`` (``fusedopt.profile.models``)."""
    from fusedopt.profile.models import PRESETS

    return PRESETS[preset].param_shapes()


def params_with_grads(shapes, device, dtype=torch.bfloat16, grad_scale: float = 1.0) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` with random values and random gradients (kept across steps)."""
    params = [torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * grad_scale if grad_scale != 1.0 else torch.randn_like(p)
    return params


# --- timing in one process, as ratios ----------------------------------------------------------


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, reps: int, device="cuda") -> float:
    """Median ms of ``reps`` calls of ``fn``, each bracketed by CUDA events (wall clock on the CPU)."""
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbps(device, numel: int = 2**31) -> float:
    """GB/s of a device-to-device copy (bytes read + written): 4 GiB of int16 on CUDA, ``numel`` fp32
    elements elsewhere."""
    if torch.device(device).type == "cuda":
        src = torch.empty(2**31, dtype=torch.int16, device=device).random_()
    else:
        src = torch.randn(numel)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = time_ms(lambda: dst.copy_(src), 20 if torch.device(device).type == "cuda" else 10, device)
    gbps = 2 * src.numel() * src.element_size() / ms / 1e6
    src = dst = None
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the 8 GiB go back before the configurations are built
    return gbps


def round_order(names: list, r: int, order: str = "reverse") -> list:
    """The order of round ``r``: ``reverse`` every other round, or ``rotate`` by one each round, so
    that the host's and the GPU's drift hits every configuration alike."""
    if order == "rotate":
        k = r % len(names) if names else 0
        return names[k:] + names[:k]
    return list(names) if r % 2 == 0 else list(reversed(names))


def interleave(fns: dict, rounds: int, reps: int, device="cuda", order: str = "reverse") -> dict[str, list[float]]:
    """name -> per-round ms: each round times every ``fns[name]`` (median of ``reps`` calls) in
    :func:`round_order`. Timed one after another instead, the same configuration drifted by 2-3%
    between runs on the H200, as much as the differences measured."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in round_order(list(fns), r, order):
            times[name].append(time_ms(fns[name], reps, device))
    return times


def ratios(times: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    """name -> {ms: median ms, ratios: per-round ratio to ``baseline`` in the same round, ratio,
    min, max}: the ratio is the median over rounds of the per-round ratios."""
    base = times[baseline]
    out = {}
    for name, ms in times.items():
        per_round = [t / b for t, b in zip(ms, base)]
        out[name] = dict(ms=statistics.median(ms), round_ms=ms, ratios=per_round)
        out[name].update(ratio=statistics.median(per_round), min=min(per_round), max=max(per_round))
    return out


# --- the paired-seed quality runner ------------------------------------------------------------
#
# For a seed, every configuration starts from the same fp32 initialisation (cast to its parameter
# dtype) and sees the same batches in the same order: only the optimizer differs. A configuration's
# effect is then its per-seed difference to the reference of the same seed, free of the seed-to-seed
# spread of the loss itself (initialisation and data), which is larger than most effects measured.

RECOVERY = 50  # steps after a loss spike over which its cost is measured


def spike_steps(seed: int, steps: int, warmup: int) -> list[int]:
    """1% of the steps after warm-up (at least one), the same for every configuration of a seed."""
    gen = torch.Generator().manual_seed(20_000 + seed)
    count = max(1, steps // 100)
    return sorted((warmup + torch.randperm(steps - warmup - RECOVERY, generator=gen)[:count]).tolist())


def train_one(make, seed: int, settings: dict, device: str, *, spiky: bool = False, autocast: bool = False) -> dict:
    """Train the byte-level Llama-shaped model (``fusedopt.profile.models.TinyLM``, ``settings["shape"]``
    over the ``tiny`` preset, no checkpointing) from seed ``seed`` with the optimizer ``make(model)``.

    ``settings``: ``steps``, ``warmup`` (linear, then cosine to 0 of the optimizer's lr: ``make``
    sets the peak), ``batch`` x ``seq`` random windows of the standard library's source (drawn from
    seed ``10000 + seed``), ``eval_seqs`` held-out windows, ``corpus_limit``, ``spike_factor``.
    Parameters are bf16 unless ``autocast`` (fp32 parameters, forward under bf16 autocast).
    ``spiky``: the loss of :func:`spike_steps` is multiplied by ``spike_factor`` before backward
    (a bad batch: every gradient grows by that factor). Returns the run's record: final held-out
    loss and its per-window losses, training losses, gradient norms (optimizers that clip)."""
    from fusedopt.profile.models import PRESETS, TinyLM, parse_shape

    train, held, _ = corpus(settings.get("corpus_limit"))
    train, held = train.to(device), held.to(device)
    torch.manual_seed(seed)  # the same initialisation for every configuration of a seed
    shape = parse_shape(settings["shape"], PRESETS["tiny"])
    model = TinyLM(shape, checkpointing=False, device=device, dtype=torch.float32)
    model.to(torch.float32 if autocast else torch.bfloat16)
    context = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    opt = make(model)
    steps, seq = settings["steps"], settings["seq"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(settings["warmup"], steps))
    spikes = set(spike_steps(seed, steps, settings["warmup"])) if spiky else set()
    gen = torch.Generator(device="cpu").manual_seed(10_000 + seed)  # the same batches for every optimizer
    losses, norms = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, train.numel() - seq - 2, (settings["batch"],), generator=gen).to(device)
        x, y = windows(train, starts, seq)
        with context():
            loss = next_token_loss(model, x, y)
        (loss * settings["spike_factor"] if step in spikes else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.detach())
        if getattr(opt, "grad_norm", None) is not None:
            norms.append(opt.grad_norm.detach())
    per_window = window_losses(model, held, context, seq, settings["eval_seqs"])
    final = float(per_window.double().mean())
    losses = [float(v) for v in torch.stack(losses).cpu()]
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return {
        "seed": seed,
        "spiky": spiky,
        "spikes": sorted(spikes),
        "final_eval": final,
        "eval_windows": [round(v, 5) for v in per_window.tolist()],
        "final_train": statistics.fmean(losses[-max(1, steps // 20) :]),
        "train_loss": losses,
        "grad_norm": [float(v) for v in torch.stack(norms).cpu()] if norms else [],
        "ok": all(math.isfinite(v) for v in losses) and math.isfinite(final),
        "wall_s": time.perf_counter() - t0,
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def _job(fn, job: tuple, path: str) -> None:
    with open(path, "w") as f:
        json.dump(fn(*job), f)


def run_jobs(fn, jobs: list[tuple], parallel: int, on_result, budget_s: float | None = None) -> None:
    """``fn(*job)`` for every job, ``parallel`` at a time in fresh (spawned) processes, or here one by
    one when ``parallel`` <= 1; ``on_result(job, result)`` as each ends (a failed process: result
    None). ``budget_s``: start no job that, at 1.2 times the longest so far, would end later than
    that many seconds from now. A SIGTERM (``timeout``) stops the workers; ended jobs are kept."""
    import multiprocessing

    t_start, spent = time.perf_counter(), []

    def over_budget(job) -> bool:
        guess = 1.2 * max(spent or [0.0])
        if budget_s and time.perf_counter() - t_start + guess > budget_s:
            print(f"{job}: not started, about {guess:.0f} s would pass the budget of {budget_s:.0f} s", flush=True)
            return True
        return False

    if parallel <= 1:
        for job in jobs:
            if not over_budget(job):
                t0 = time.perf_counter()
                on_result(job, fn(*job))
                spent.append(time.perf_counter() - t0)
        return
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    running = []
    try:
        with tempfile.TemporaryDirectory(prefix="runs-") as tmp:
            queue = list(enumerate(jobs))
            while queue or running:
                while queue and len(running) < parallel:
                    i, job = queue.pop(0)
                    if over_budget(job):
                        continue
                    path = os.path.join(tmp, f"{i}.json")
                    proc = context.Process(target=_job, args=(fn, job, path))
                    proc.start()
                    running.append((proc, job, path, time.perf_counter()))
                time.sleep(0.2)
                for item in [r for r in running if not r[0].is_alive()]:
                    running.remove(item)
                    proc, job, path, t0 = item
                    proc.join()
                    spent.append(time.perf_counter() - t0)
                    result = None
                    if os.path.exists(path):
                        with open(path) as f:
                            result = json.load(f)
                    else:
                        print(f"{job}: worker failed (exit code {proc.exitcode})", flush=True)
                    on_result(job, result)
    finally:
        for proc, *_ in running:
            if proc.is_alive():
                proc.kill()
                proc.join()
        signal.signal(signal.SIGTERM, previous)


def _eval_error(windows, ref_windows) -> float | None:
    """Standard error (%) of one paired difference from the finite held-out sample: the spread of
    the per-window differences over the square root of their number (None without windows)."""
    if not windows or not ref_windows or len(windows) != len(ref_windows) or len(windows) < 2:
        return None
    gaps = [a - b for a, b in zip(windows, ref_windows)]
    return 100 * statistics.stdev(gaps) / math.sqrt(len(gaps)) / statistics.fmean(ref_windows)


def paired(runs: list[dict], reference: str, seeds: list[int] | None = None, spiky: bool = False) -> list[dict]:
    """Per configuration (runs of ``spiky``): its held-out loss per seed, the per-seed difference to
    ``reference`` of the same seed (``diff``; ``diff_pct`` in %), their mean, sd and paired t, a
    verdict (worse/better on every seed, or mixed), the held-out sample's part of the noise
    (``eval_se_pct``), the gap of the means over all seeds of each (``gap_pct``: what an unpaired
    comparison sees), and with spikes the recovery: the mean training loss over the RECOVERY steps
    after each spike minus the same steps of the same configuration and seed without spikes."""
    calm = {(r["key"], r["seed"]): r for r in runs if not r.get("spiky")}
    runs = [r for r in runs if bool(r.get("spiky")) == spiky]
    ref = {r["seed"]: r for r in runs if r["key"] == reference}
    ref_mean = statistics.fmean(r["final_eval"] for r in ref.values()) if ref else None
    rows = []
    for key in dict.fromkeys(r["key"] for r in runs):
        got = {r["seed"]: r for r in runs if r["key"] == key}
        mine = [s for s in (seeds if seeds is not None else sorted(got)) if s in got]
        both = [s for s in mine if s in ref]
        row = {"key": key, "label": got[mine[0]]["label"] if mine else key, "seeds": mine}
        row["loss"] = [got[s]["final_eval"] for s in mine]
        row["diff"] = [got[s]["final_eval"] - ref[s]["final_eval"] for s in both]
        row["diff_pct"] = [100 * d / ref[s]["final_eval"] for d, s in zip(row["diff"], both)]
        if mine and ref_mean is not None:
            row["gap_pct"] = 100 * (statistics.fmean(row["loss"]) - ref_mean) / ref_mean
        errors = [_eval_error(got[s].get("eval_windows"), ref[s].get("eval_windows")) for s in both]
        if key != reference and errors and None not in errors:
            row["eval_se_pct"] = math.sqrt(statistics.fmean(e * e for e in errors))
        diffs = row["diff_pct"]
        if diffs and not all(math.isfinite(d) for d in diffs):
            row["verdict"] = "not finite"
        elif diffs:
            mean = statistics.fmean(diffs)
            sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
            t = mean / (sd / math.sqrt(len(diffs))) if len(diffs) > 1 and sd > 0 else float("nan")
            verdict = "worse on every seed" if min(diffs) > 0 else "better on every seed" if max(diffs) < 0 else "mixed"
            verdict = verdict if len(diffs) > 1 else "one seed"
            row.update(mean_pct=mean, sd_pct=sd, t=t, verdict=verdict if key != reference else "reference")
        recovery = []
        for s in mine if spiky else ():
            quiet = calm.get((key, s))
            for t in got[s].get("spikes", []) if quiet else ():
                after = slice(t + 1, t + 1 + RECOVERY)
                gap = statistics.fmean(got[s]["train_loss"][after]) - statistics.fmean(quiet["train_loss"][after])
                recovery.append(gap)
        if recovery:
            row["recovery"] = statistics.fmean(recovery)
        rows.append(row)
    return rows


def paired_table(rows: list[dict], reference: str, units: str = "pct") -> str:
    """The markdown table of :func:`paired`'s rows; per-seed differences in % (``units="pct"``) or
    in loss (``"abs"``)."""
    nan = float("nan")
    body = []
    for r in rows:
        per_seed = r["diff_pct"] if units == "pct" else r["diff"]
        spec = "+.2f" if units == "pct" else "+.4f"
        loss = f"{statistics.fmean(r['loss']):.4f}" if r["loss"] else "-"
        cells = [r["key"], r["label"], len(r["loss"]), loss]
        if r["key"] == reference or not per_seed:
            cells += ["-", "-", "-"]
        else:
            cells += [" ".join(format(d, spec) for d in per_seed)]
            sd = f" ± {r['sd_pct']:.2f}" if len(per_seed) > 1 else ""
            cells += [f"{r.get('mean_pct', nan):+.2f}{sd}", fmt(r.get("t") if len(per_seed) > 1 else None, ".1f")]
        cells += [fmt(r.get("eval_se_pct"), ".2f"), fmt(r.get("gap_pct"), "+.2f"), r.get("verdict", "")]
        if any("recovery" in x for x in rows):
            cells.append(fmt(r.get("recovery"), "+.4f"))
        body.append(cells)
    per_seed = f"vs {reference} per seed ({'%' if units == 'pct' else 'loss'})"
    headers = ["key", "configuration", "seeds", "held-out loss", per_seed, "mean ± sd (%)", "t", "eval± (%)"]
    headers += ["gap of means (%)", "verdict"] + (["recovery"] if any("recovery" in x for x in rows) else [])
    return table(headers, body)


# --- results files and reports -----------------------------------------------------------------


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
    """Date, Python, device, the installed version of every library of the line-up, and how the
    profiler builds each other library's optimizer."""
    from fusedopt.profile.competitors import COMPETITORS, library_versions

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version()}
    env["versions"] = library_versions()
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    env["usage"] = {name: c.how for name, c in COMPETITORS.items()}
    return env


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table (readable in a terminal, pasteable into RESULTS.md)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def ok_rows(data: dict) -> list[tuple[str, dict]]:
    return [(k, r) for k, r in data.get("rows", {}).items() if r.get("ok")]


def not_measured(data: dict) -> list[str]:
    bad = [(k, r) for k, r in data.get("rows", {}).items() if not r.get("ok")]
    return ["", "Not measured:"] + [f"  {k} ({r['label']}): {r.get('error')}" for k, r in bad] if bad else []


def pyplot():
    """matplotlib.pyplot with a file backend, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


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


# --- fingerprints: two source trees bit for bit ------------------------------------------------
#
# Each configuration trains a few small parameters of odd and bucketable shapes for 4 steps through
# the public API; the SHA-256 of every parameter and state tensor is its fingerprint. Run by the same
# code against two trees (PYTHONPATH=<tree>), equal fingerprints mean bit-identical results.

FP_SHAPES = [(256, 512), (512, 256), (1000, 37), (4096,), (64, 64), (300, 300)]
FP_ALGORITHMS = ("adamw", "sgd", "lion", "adafactor")
# the state formats that state_bits also names (the grid of bits covers them for AdamW, SGD and Lion)
_BITS_FORMATS = ("fp32", "bf16", "block8", "block4")


def _algorithm(name: str):
    import fusedopt

    return {
        "adamw": (fusedopt.AdamW, {}),
        "sgd": (fusedopt.SGD, dict(momentum=0.9)),
        "lion": (fusedopt.Lion, {}),
        "adafactor": (fusedopt.Adafactor, dict(beta1=0.9)),
    }[name]


def fingerprint(name: str, options: dict, dtype, fused: bool, device) -> str:
    """SHA-256 over every parameter and state tensor after 4 steps of ``name`` with ``options``."""
    cls, kwargs = _algorithm(name)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in FP_SHAPES]
    opt = cls(params, lr=1e-3, fused=fused, max_grad_norm=None, **options, **kwargs)
    for _ in range(4):
        grads = [torch.randn(s, generator=gen).to(device, dtype) for s in FP_SHAPES]
        loss = sum((p * g).sum() for p, g in zip(params, grads))
        loss.backward()
        opt.step()
        opt.zero_grad()
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().view(torch.uint8 if p.dtype != torch.float32 else torch.int32).numpy().tobytes())
        for key in sorted(opt.state[p]):
            t = opt.state[p][key].detach().cpu().contiguous()
            h.update(key.encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return h.hexdigest()


def fingerprint_grid(algorithms=FP_ALGORITHMS, formats=None) -> list[tuple[str, str, dict, object, bool]]:
    """(key, algorithm, options, dtype, fused) of every configuration: AdamW, SGD and Lion x state bits
    32/16/8/4 x master 24/None x bf16/fp32 x fused (the keys of the first bits files, 2026-12-01),
    then each algorithm x every other state format (``formats``, default: every registered one) x the
    same masters, dtypes and fused. fp32 parameters take no master correction."""
    if formats is None:
        try:
            from fusedopt.codecs import registered_formats
        except ImportError:  # a tree from before named formats: its state bits only
            registered_formats = tuple
        formats = registered_formats()
    settings = [
        (master, dtype, fused)
        for master in (24, None)
        for dtype in (torch.bfloat16, torch.float32)
        for fused in (False, True)
        if not (dtype == torch.float32 and master is None)
    ]
    grid = []
    for name in [a for a in algorithms if a != "adafactor"]:
        for bits in (32, 16, 8, 4):
            for master, dtype, fused in settings:
                key = f"{name} bits={bits} master={master} {str(dtype)[6:]} fused={fused}"
                grid.append((key, name, dict(state_bits=bits, master_weight_bits=master), dtype, fused))
    for name in algorithms:
        for fmt_name in formats:
            if fmt_name in _BITS_FORMATS and name != "adafactor":
                continue
            for master, dtype, fused in settings:
                key = f"{name} format={fmt_name} master={master} {str(dtype)[6:]} fused={fused}"
                grid.append((key, name, dict(state_format=fmt_name, master_weight_bits=master), dtype, fused))
    return grid


def fingerprints(device="cuda", algorithms=FP_ALGORITHMS, formats=None, out: str | None = None) -> dict[str, str]:
    """key -> fingerprint (or ``"refused: ..."`` where this tree refuses the configuration), written
    to ``out`` after each configuration (a run cut short keeps what it did)."""
    result = {}
    for key, name, options, dtype, fused in fingerprint_grid(algorithms, formats):
        try:
            result[key] = fingerprint(name, options, dtype, fused, device)
        except (ValueError, TypeError, NotImplementedError) as exc:  # a format this algorithm does not take
            result[key] = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        save(out, result)
    return result


def same_bits(a: dict[str, str], b: dict[str, str]) -> dict[str, list[str]]:
    """Compare two fingerprint files (``a`` the old tree's, ``b`` the new one's): keys bit-identical
    (fingerprints equal), differing, refused in both, refused in one only, and present in one file only
    (a format one of the trees lacks: only in the old one, a removed format)."""
    out = {"identical": [], "differ": [], "refused in both": [], "refused in one": [], "only in the first": []}
    out["only in the second"] = []
    for key in dict.fromkeys([*a, *b]):
        x, y = a.get(key), b.get(key)
        if y is None:
            out["only in the first"].append(key)
        elif x is None:
            out["only in the second"].append(key)
        elif x.startswith("refused") and y.startswith("refused"):
            out["refused in both"].append(key)
        elif x.startswith("refused") or y.startswith("refused"):
            out["refused in one"].append(key)
        else:
            out["identical" if x == y else "differ"].append(key)
    return out


def update_drift(cap: float, steps: int = 300, seed: int = 0) -> list[tuple[float, float, float]]:
    """How far ``state_format="norm2-root4"`` moves parameters along a known gradient signal, against fp32
    AdamW: a 64 x 1024 parameter fed gradients ``mu + sigma * noise`` whose signal-to-noise ratio runs from
    0.01 to 10 across the elements (mixed within every block), ``steps`` steps at lr 1e-3, no weight
    decay. ``cap``: the first moment's half-range cap in block rms, set for this process (8 = sqrt(64)
    never binds: a block's absmax is at most sqrt(64) times its rms). Returns, per band of the ratio,
    (low, high, the format's drift / AdamW's)."""
    import fusedopt
    from fusedopt.codecs import normalised

    if cap != normalised.FORMATS["norm2"][1]:  # this process only: the codec with another cap
        normalised.FORMATS["norm2"] = (2, cap)
        normalised.normalised_codec.cache_clear()
        fusedopt.codecs.codec_named.cache_clear()
        fusedopt.codecs.codec_for.cache_clear()
    gen = torch.Generator().manual_seed(seed)
    rows, cols = 64, 1024
    snr = torch.logspace(-2, 1, rows * cols)[torch.randperm(rows * cols, generator=gen)].reshape(rows, cols)
    sigma = torch.exp(torch.randn(rows, cols, generator=gen) * 0.5) * 1e-3
    mu = snr * sigma * torch.randn(rows, cols, generator=gen).sign()

    def run(**options) -> torch.Tensor:
        p = torch.nn.Parameter(torch.zeros(rows, cols))
        opt = fusedopt.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=None, **options)
        noise = torch.Generator().manual_seed(seed + 1)
        for _ in range(steps):
            p.grad = mu + sigma * torch.randn(rows, cols, generator=noise)
            opt.step()
        return (p.detach() * mu.sign()).reshape(-1)  # the drift along each element's signal

    reference, drift = run(state_bits=32), run(state_format="norm2-root4")
    edges = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.01]
    out = []
    for low, high in zip(edges, edges[1:]):
        band = (snr.reshape(-1) >= low) & (snr.reshape(-1) < high)
        out.append((low, high, float(drift[band].mean() / reference[band].mean())))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lineup = sub.add_parser("lineup", help="the line-up, what is installed here, and how each library is used")
    lineup.add_argument("--device", default=None)
    bits = sub.add_parser("bits", help="fingerprints of every configuration of this fusedopt")
    bits.add_argument("--out", required=True)
    bits.add_argument("--device", default="cuda")
    bits.add_argument("--algorithms", default=",".join(FP_ALGORITHMS))
    bits.add_argument("--formats", default=None, help="comma-separated state formats (default: every registered one)")
    drift = sub.add_parser("drift", help="norm2-root4's update drift along a known signal, against fp32 AdamW")
    drift.add_argument("--cap", type=float, default=2.0, help="half-range cap, block rms (8: none)")
    same = sub.add_parser("same", help="compare two fingerprint files")
    same.add_argument("files", nargs=2)
    args = parser.parse_args(argv)
    if args.command == "lineup":
        from fusedopt.profile.competitors import COMPETITORS, library_versions
        from fusedopt.profile.lineup import status_lines

        print("\n".join(status_lines(args.device)))
        print(library_versions())
        print("\nHow each library is used (fusedopt/profile/competitors.py):")
        for name, c in COMPETITORS.items():
            print(f"  {name}: {c.how}")
        return 0
    if args.command == "bits":
        formats = args.formats.split(",") if args.formats else None
        result = fingerprints(args.device, args.algorithms.split(","), formats, args.out)
        refused = sum(v.startswith("refused") for v in result.values())
        print(f"{len(result)} configurations fingerprinted ({refused} refused by this tree)")
        return 0
    if args.command == "drift":
        for low, high, ratio in update_drift(args.cap):
            print(f"signal/noise {low:5.2f}-{high:5.2f}: drift {ratio:.3f} of fp32 AdamW's")
        return 0
    a, b = (load(path) for path in args.files)
    verdict = same_bits(a, b)
    compared = len(verdict["identical"]) + len(verdict["differ"])
    print(f"bit-identical: {len(verdict['identical'])} of {compared} configurations both trees ran")
    for what in ("differ", "refused in one"):
        for key in verdict[what]:
            print(f"  {what}: {key}")
    # not compared, and no failure: a configuration one tree lacks (in the first only: a removed format)
    for what, path in (("only in the first", args.files[0]), ("only in the second", args.files[1])):
        if verdict[what]:
            print(f"not compared, {len(verdict[what])} configurations only in {path}:")
            print("\n".join(f"  {key}" for key in verdict[what]))
    return 1 if verdict["differ"] or verdict["refused in one"] else 0


if __name__ == "__main__":
    sys.exit(main())
