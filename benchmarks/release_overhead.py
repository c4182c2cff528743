"""Gradient release overhead: one training step of the 1.1B Llama shape, fused=True against fused=False.

Usage (on a CUDA machine):  python benchmarks/release_overhead.py [--preset 1b] [--steps 6] [--out f.json]

For each configuration: median over timed steps of backward alone and of the whole step
(forward + backward + ``opt.step()``), bf16 weights, micro-batch 1 x 1024, activation
checkpointing. With ``fused=True`` the updates run inside backward, so its backward is longer
and its ``step()`` nearly empty; the target (issue 4) is a total no slower than fused=False.

``--diagnose DIR``: after the timing, one more step per fusedopt configuration under
``torch.profiler`` (Chrome traces in DIR: GPU idle gaps inside backward, host time per hook) and
with ``torch.cuda.set_sync_debug_mode("warn")``, which names any host-device synchronisation.
On the H200 (2026-11-30) the in-backward updates cost ~300 us per parameter against ~90 us of
host time per parameter in ``step()``: this is the run that should say why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import fusedopt
from fusedopt.profiler_models import PRESETS, TinyLM, random_batch

CONFIGS = {
    "torch AdamW (fused=True kernel)": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True),
    "fusedopt default, fused=False": lambda ps: fusedopt.AdamW(ps, lr=1e-5),
    "fusedopt default, fused=True": lambda ps: fusedopt.AdamW(ps, lr=1e-5, fused=True),
}


def run(name, make_opt, preset, steps, batch, seq_len, device="cuda", diagnose=None) -> dict:
    torch.manual_seed(0)
    model = TinyLM(PRESETS[preset], checkpointing=True, device=device, dtype=torch.bfloat16)
    opt = make_opt(model.parameters())
    gen = torch.Generator(device=device).manual_seed(1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    backward_ms, total_ms = [], []
    for i in range(steps):
        ids, labels = random_batch(PRESETS[preset].vocab, batch, seq_len, device, gen)
        sync()
        t0 = time.perf_counter()
        loss = model(ids, labels=labels)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync()
        t3 = time.perf_counter()
        if i >= 2:  # warm-up: compilation, allocator growth
            backward_ms.append((t2 - t1) * 1e3)
            total_ms.append((t3 - t0) * 1e3)
    if diagnose and device == "cuda":
        _diagnose_step(name, model, opt, preset, batch, seq_len, gen, diagnose)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(name=name, backward_ms=statistics.median(backward_ms), step_ms=statistics.median(total_ms))


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
    syncs = sorted({str(w.message).splitlines()[0] for w in caught})
    print(f"{name}: {len(caught)} synchronising calls" + "".join(f"\n  {m}" for m in syncs[:10]))
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, name.replace(" ", "_").replace(",", "") + ".json"))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test the script")
    parser.add_argument("--diagnose", metavar="DIR", help="profile one more step per configuration (see above)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    configs = dict(CONFIGS)
    if args.device != "cuda":
        configs.pop("torch AdamW (fused=True kernel)")
    results = [
        run(name, make, args.preset, args.steps, args.batch, args.seq_len, args.device, args.diagnose)
        for name, make in configs.items()
    ]
    print("| configuration | backward ms | whole step ms |\n|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['backward_ms']:.1f} | {r['step_ms']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, preset=args.preset, results=results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
