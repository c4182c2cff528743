"""Gradient release overhead: one training step of the 1.1B Llama shape, fused=True against fused=False.

Usage (on a CUDA machine):  python benchmarks/release_overhead.py [--preset 1b] [--steps 5] [--rounds 3]
       [--batch 1] [--out f.json]
       python benchmarks/release_overhead.py --only "default, fused=True" "clipping, fused=True" --paired 30

The configurations take turns (``--rounds``, each ``--steps`` timed steps, order rotated per
round; models kept alive). For each: median over timed steps of backward alone and of the whole step
(forward + backward + ``opt.step()``), bf16 weights, micro-batch 1 x 1024, activation
checkpointing. With ``fused=True`` the updates run inside backward, so its backward is longer
and its ``step()`` nearly empty; the target (issue 4) is a total no slower than fused=False.

``--diagnose DIR``: after the timing, one more step per fusedopt configuration under
``torch.profiler`` (Chrome traces in DIR: GPU idle gaps inside backward, host time per hook) and
with ``torch.cuda.set_sync_debug_mode("warn")``, which names any host-device synchronisation.
On the H200 (2026-11-30) the in-backward updates cost ~300 us per parameter against ~90 us of
host time per parameter in ``step()``; the profile found no synchronisation.

The table also gives, for fusedopt, the host time of one ``update_param`` call inside backward
and inside ``step()`` (timed around the call), and PyTorch's own optimizer-in-backward pattern
as the baseline of any in-backward update. ``--switch-interval 1e-6`` tests whether the GIL
hand-off between Python threads is what costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

import fusedopt
import fusedopt.optimizer
from fusedopt.profile.models import PRESETS, TinyLM, random_batch


class TorchInBackward:
    """PyTorch's own "optimizer in backward" pattern: one fused torch AdamW per parameter, stepped
    in its post-accumulate-grad hook (the baseline for what any in-backward update costs)."""

    def __init__(self, params):
        self.optimizers = {}
        for p in params:
            self.optimizers[p] = torch.optim.AdamW([p], lr=1e-5, fused=True)
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self.optimizers[p].step()
        self.optimizers[p].zero_grad()

    def step(self):
        pass

    def zero_grad(self):
        pass


def _bucket_mb(mb: str, make):
    """``make`` with FUSEDOPT_BUCKET_MB=mb (read at construction; 0: one launch pair per parameter)."""

    def build(params):
        saved = os.environ.get("FUSEDOPT_BUCKET_MB")
        os.environ["FUSEDOPT_BUCKET_MB"] = mb
        try:
            return make(params)
        finally:
            if saved is None:
                del os.environ["FUSEDOPT_BUCKET_MB"]
            else:
                os.environ["FUSEDOPT_BUCKET_MB"] = saved

    return build


def _with_empty_hooks(make):
    """``make``, plus a post-accumulate-grad hook that does nothing on every parameter: what the
    engine's calls into Python cost by themselves (a diagnosis, not a product configuration)."""

    def build(params):
        params = list(params)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: None)
        return make(params)

    return build


RELEASE = dict(fused=True, max_grad_norm=None)  # gradient release, no clipping
CONFIGS = {
    "torch AdamW (fused=True kernel)": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True),
    "torch AdamW per parameter in backward hooks": TorchInBackward,
    "fusedopt default, fused=False": lambda ps: fusedopt.AdamW(ps, lr=1e-5),
    "fusedopt default, fused=True": lambda ps: fusedopt.AdamW(ps, lr=1e-5, **RELEASE),
    "fusedopt clipping, fused=False": lambda ps: fusedopt.AdamW(ps, lr=1e-5, max_grad_norm=1.0),
    "fusedopt clipping, fused=True": lambda ps: fusedopt.AdamW(ps, lr=1e-5, fused=True, max_grad_norm=1.0),
    "fusedopt unbucketed, fused=False": _bucket_mb("0", lambda ps: fusedopt.AdamW(ps, lr=1e-5)),
    "fusedopt unbucketed, fused=True": _bucket_mb("0", lambda ps: fusedopt.AdamW(ps, lr=1e-5, **RELEASE)),
    "fusedopt 64 MiB buckets, fused=True": _bucket_mb("64", lambda ps: fusedopt.AdamW(ps, lr=1e-5, **RELEASE)),
    "fusedopt 128 MiB buckets, fused=True": _bucket_mb("128", lambda ps: fusedopt.AdamW(ps, lr=1e-5, **RELEASE)),
    # diagnoses: the engine's hook calls alone; release holding every gradient until the end of
    # backward (all updates in the end-of-backward callback, in buckets of 16 as step() makes them)
    "diagnosis: fused=False + empty hooks": _with_empty_hooks(lambda ps: fusedopt.AdamW(ps, lr=1e-5)),
    "diagnosis: fused=True holding all": _bucket_mb("1000000", lambda ps: fusedopt.AdamW(ps, lr=1e-5, **RELEASE)),
}


class UpdateTimer:
    """Host time of fusedopt's updates (``update_param``, ``queue_update`` and the bucket launches
    of ``flush_updates``, outermost calls only) per parameter update, split into those made inside
    backward (release hooks, the end-of-backward flush) and the rest (``step()``): the same Python
    either way, so a difference is the cost of running it in autograd's thread."""

    def __init__(self):
        self.in_backward = False
        self.seconds = {True: 0.0, False: 0.0}
        self.calls = {True: 0, False: 0}
        self.depth = 0  # timed calls in progress: only the outermost one's time is added
        self.queueing = 0  # queue_update calls in progress: an update_param inside one is the same update
        cls = fusedopt.optimizer.FusedOptimizer
        for name in ("update_param", "queue_update", "flush_updates"):
            if hasattr(cls, name):  # another tree's optimizer (tree_ab.sh) may not have them all
                setattr(cls, name, self._timed(getattr(cls, name), name))

    def _timed(self, original, name: str):
        def timed(optimizer, *args, **kwargs):
            # every parameter update counts once, at whatever depth (release's end-of-backward
            # flush queues the held updates inside flush_updates)
            if name == "queue_update" or (name == "update_param" and not self.queueing):
                self.calls[self.in_backward] += 1
            self.queueing += name == "queue_update"
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                self.depth -= 1
                self.queueing -= name == "queue_update"
                if self.depth == 0:
                    self.seconds[self.in_backward] += time.perf_counter() - t0

        return timed

    def reset(self):
        self.seconds, self.calls = {True: 0.0, False: 0.0}, {True: 0, False: 0}

    def summary(self) -> dict:
        return {
            f"{where}_us_per_update": self.seconds[flag] / self.calls[flag] * 1e6 if self.calls[flag] else None
            for where, flag in (("in_backward", True), ("in_step", False))
        }


class Trial:
    """One configuration's model and optimizer, kept alive so that configurations can take turns."""

    def __init__(self, name, make_opt, preset, batch, seq_len, device="cuda", timer=None):
        torch.manual_seed(0)
        self.name, self.preset, self.batch, self.seq_len, self.device = name, preset, batch, seq_len, device
        self.model = TinyLM(PRESETS[preset], checkpointing=True, device=device, dtype=torch.bfloat16)
        self.opt = make_opt(self.model.parameters())
        self.gen = torch.Generator(device=device).manual_seed(1)
        self.timer = timer
        self.backward_ms, self.step_ms, self.round_ms = [], [], []
        self.update_us = {"in_backward": [], "in_step": []}

    def steps(self, n: int, warmup: int) -> None:
        """``warmup`` untimed steps (compilation, allocator growth), then ``n`` timed ones."""
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        model, opt, timer = self.model, self.opt, self.timer
        round_ms = []
        for i in range(warmup + n):
            if i == warmup and timer is not None:
                timer.reset()
            ids, labels = random_batch(PRESETS[self.preset].vocab, self.batch, self.seq_len, self.device, self.gen)
            sync()
            t0 = time.perf_counter()
            loss = model(ids, labels=labels)
            sync()
            t1 = time.perf_counter()
            if timer is not None:
                timer.in_backward = True
            loss.backward()
            sync()
            if timer is not None:
                timer.in_backward = False
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            sync()
            t3 = time.perf_counter()
            if i >= warmup:
                self.backward_ms.append((t2 - t1) * 1e3)
                round_ms.append((t3 - t0) * 1e3)
        self.step_ms += round_ms
        self.round_ms.append(statistics.median(round_ms))
        if timer is not None:
            for key, value in timer.summary().items():
                self.update_us[key.removesuffix("_us_per_update")].append(value)

    def one_step(self) -> float:
        """One step as a training loop runs it (no synchronisation between its phases): ms."""
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        ids, labels = random_batch(PRESETS[self.preset].vocab, self.batch, self.seq_len, self.device, self.gen)
        sync()
        t0 = time.perf_counter()
        self.model(ids, labels=labels).backward()
        self.opt.step()
        self.opt.zero_grad()
        sync()
        return (time.perf_counter() - t0) * 1e3

    def result(self) -> dict:
        result = dict(
            name=self.name,
            backward_ms=statistics.median(self.backward_ms),
            step_ms=statistics.median(self.step_ms),
            min_step_ms=min(self.step_ms),  # the host's interference only adds: the least-disturbed step
            round_step_ms=self.round_ms,
        )
        for where, values in self.update_us.items():
            values = [v for v in values if v is not None]
            result[f"{where}_us_per_update"] = statistics.median(values) if values else None
        return result

    def close(self, diagnose=None) -> None:
        if diagnose and self.device == "cuda":
            _diagnose_step(self.name, self.model, self.opt, self.preset, self.batch, self.seq_len, self.gen, diagnose)
        del self.model, self.opt
        if self.device == "cuda":
            torch.cuda.empty_cache()


def _diagnose_step(name, model, opt, preset, batch, seq_len, gen, out_dir) -> None:
    import os
    import warnings

    from torch.profiler import ProfilerActivity, profile

    ids, labels = random_batch(PRESETS[preset].vocab, batch, seq_len, "cuda", gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        ):
            warnings.simplefilter("always")
            model(ids, labels=labels).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time_total for e in kernels) / 1e3
    print(f"{name}: {len(kernels)} GPU kernels and copies, busy {busy_ms:.1f} ms of the profiled step")
    syncs = sorted({str(w.message).splitlines()[0] for w in caught})
    print(f"{name}: {len(caught)} synchronising calls" + "".join(f"\n  {m}" for m in syncs[:10]))
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, name.replace(" ", "_").replace(",", "") + ".json"))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="count", row_limit=15))
    _python_profile(name, model, opt, preset, batch, seq_len, gen)


def _python_profile(name, model, opt, preset, batch, seq_len, gen) -> None:
    """cProfile of one more step: which Python functions the host time per parameter goes to."""
    import cProfile
    import pstats

    ids, labels = random_batch(PRESETS[preset].vocab, batch, seq_len, "cuda", gen)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    model(ids, labels=labels).backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"{name}: Python profile of one step (tottime)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    print(f"{name}: fusedopt's functions (cumulative)")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats("fusedopt/", 40)


def _paired(trials: list, rounds: int, diagnose=None) -> int:
    """Single steps of every trial in turn, ``rounds`` times (the order reversed every other round,
    so a drift within a round cancels over rounds); each trial's step time, and per round its ratio
    to the first trial's step: their median and quartiles."""
    base = trials[0]
    for trial in trials:
        for _ in range(3):  # compilation, allocator growth
            trial.one_step()
    times = {trial.name: [] for trial in trials}
    for r in range(rounds):
        for trial in trials if r % 2 == 0 else trials[::-1]:
            times[trial.name].append(trial.one_step())
    print(f"{rounds} rounds of single steps, micro-batch {base.batch}; ratio to {base.name!r} within each round")
    print("| configuration | median step ms | fastest | ratio: median | quartiles |")
    print("|---|---|---|---|---|")
    for trial in trials:
        ms = times[trial.name]
        ratios = [a / b for a, b in zip(ms, times[base.name])]
        q = statistics.quantiles(ratios, n=4)
        print(f"| {trial.name} | {statistics.median(ms):.1f} | {min(ms):.1f} | {statistics.median(ratios):.3f} "
              f"| {q[0]:.3f}-{q[2]:.3f} |")  # fmt: skip
    for trial in trials:
        trial.close(diagnose)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in which the configurations take turns")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test the script")
    parser.add_argument("--diagnose", metavar="DIR", help="profile one more step per configuration (see above)")
    parser.add_argument("--only", nargs="+", help="configurations whose name contains one of these")
    parser.add_argument(
        "--switch-interval", type=float, help="sys.setswitchinterval(S) first (does the GIL hand-off matter?)"
    )
    parser.add_argument(
        "--paired",
        type=int,
        metavar="N",
        help="instead of --rounds/--steps: N rounds of one step of each configuration (in --only's order; no "
        "synchronisation inside a step), ratios to the first configuration's step of the same round",
    )
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    configs = {k: v for k, v in CONFIGS.items() if not args.only or any(word in k for word in args.only)}
    if args.device != "cuda":
        configs.pop("torch AdamW (fused=True kernel)", None)
    timer = UpdateTimer()  # one patch of update_param; each trial resets it before its timed steps
    trials = [Trial(name, make, args.preset, args.batch, args.seq_len, args.device,
                    timer if not name.startswith("torch") else None) for name, make in configs.items()]  # fmt: skip
    if args.paired:
        if args.only:
            trials.sort(key=lambda t: next(i for i, word in enumerate(args.only) if word in t.name))
        return _paired(trials, args.paired, args.diagnose)
    # Configurations take turns, in a rotated order each round: the host's speed drifts (other
    # jobs, clocks), and a whole step here is mostly host time.
    for r in range(args.rounds):
        for trial in trials[r % len(trials) :] + trials[: r % len(trials)]:
            trial.steps(args.steps, warmup=2 if r == 0 else 1)
    results = [trial.result() for trial in trials]
    for trial in trials:
        trial.close(args.diagnose)
    print(f"Python threads: {[t.name for t in threading.enumerate()]}; switch interval {sys.getswitchinterval()} s")
    print("| configuration | backward ms | whole step ms | fastest step ms | per round "
          "| host us per update in backward | in step() |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        hooks, step = r.get("in_backward_us_per_update"), r.get("in_step_us_per_update")
        cells = ["-" if x is None else f"{x:.0f}" for x in (hooks, step)]
        rounds = " / ".join(f"{x:.1f}" for x in r["round_step_ms"])
        print(f"| {r['name']} | {r['backward_ms']:.1f} | {r['step_ms']:.1f} | {r['min_step_ms']:.1f} | {rounds} "
              f"| {cells[0]} | {cells[1]} |")  # fmt: skip
    by_name = {r["name"]: r for r in results}
    for label, a, b in (
        ("fused=True / fused=False", "fusedopt default, fused=True", "fusedopt default, fused=False"),
        ("fused=True (64 MiB) / fused=False", "fusedopt 64 MiB buckets, fused=True", "fusedopt default, fused=False"),
        ("fused=True (128 MiB) / fused=False", "fusedopt 128 MiB buckets, fused=True", "fusedopt default, fused=False"),
        ("clipping / none, fused=True", "fusedopt clipping, fused=True", "fusedopt default, fused=True"),
        ("clipping / none, fused=False", "fusedopt clipping, fused=False", "fusedopt default, fused=False"),
        ("clipping, fused=True / False", "fusedopt clipping, fused=True", "fusedopt clipping, fused=False"),
        ("empty hooks / none, fused=False", "diagnosis: fused=False + empty hooks", "fusedopt default, fused=False"),
        ("fused=True holding all / fused=False", "diagnosis: fused=True holding all", "fusedopt default, fused=False"),
        ("fused=True / fused=False, unbucketed", "fusedopt unbucketed, fused=True", "fusedopt unbucketed, fused=False"),
        ("bucketed / unbucketed, fused=True", "fusedopt default, fused=True", "fusedopt unbucketed, fused=True"),
        ("bucketed / unbucketed, fused=False", "fusedopt default, fused=False", "fusedopt unbucketed, fused=False"),
    ):  # fmt: skip
        if a in by_name and b in by_name:
            ratios = [x / y for x, y in zip(by_name[a]["round_step_ms"], by_name[b]["round_step_ms"])]
            print(f"{label}, whole step: {by_name[a]['step_ms'] / by_name[b]['step_ms']:.3f} "
                  f"(fastest steps {by_name[a]['min_step_ms'] / by_name[b]['min_step_ms']:.3f}) "
                  f"(per round {' / '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, preset=args.preset, results=results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
