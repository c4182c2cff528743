"""Per-GPU peak and persistent memory and step time of a training step under FSDP2 (``fully_shard``).

The 1.1B Llama shape (the profiler's ``1b`` preset: TinyLlama's shapes), every block and the root
wrapped in ``fully_shard`` over all ranks, non-reentrant activation checkpointing, micro-batch
1 x 1024 per rank, for: fusedopt defaults (``fused=False``), ``fused=True`` (without and with
``max_grad_norm``: its per-parameter all-reduce of the squared shard norm), 4-bit state +
``fused=True``, torch AdamW (fp32 parameters, bf16 compute: FSDP2's ``MixedPrecisionPolicy``) and
FlashOptim's FlashAdamW with its gradient release (``enable_gradient_release``). Gradients are
reduced in fp32 for every configuration. Every configuration runs in this one process, one after
another; between them everything is freed (what stays allocated is reported as ``left_after_gib``,
expected 0), so each peak counts only its own tensors.

    torchrun --nproc-per-node 1 benchmarks/fsdp_step.py --out fsdp_step.json          # one GPU
    torchrun --nproc-per-node 2 benchmarks/fsdp_step.py --out fsdp_step.json          # two GPUs
    torchrun --nproc-per-node 2 benchmarks/fsdp_step.py --tiny --device cpu           # CPU/gloo smoke

Per configuration: ``--warmup`` steps (state created, kernels compiled), one tracked step whose
peak (``torch.cuda.max_memory_allocated``) is the peak, then ``--steps`` timed steps whose median
is the step time. Persistent = allocated after ``zero_grad`` (weights, state, what the optimizer
keeps). Memory figures are per GPU, the largest over ranks. Ratios are to torch AdamW.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fusedopt  # noqa: E402
from fusedopt.profile.competitors import COMPETITORS  # noqa: E402
from fusedopt.profile.lineup import HPARAMS  # noqa: E402
from fusedopt.profile.models import PRESETS, TinyLM  # noqa: E402

GIB = 1 << 30
REFERENCE = "torch-adamw"
# name -> (parameter dtype, how the optimizer is built)
CONFIGS = {
    "fusedopt": (torch.bfloat16, "fusedopt.AdamW defaults (8-bit state, 24-bit master), fused=False"),
    "fusedopt-fused": (torch.bfloat16, "fusedopt.AdamW, fused=True (gradient release)"),
    "fusedopt-fused-clip": (torch.bfloat16, "fusedopt.AdamW, fused=True, max_grad_norm=1.0"),
    "fusedopt-4bit-fused": (torch.bfloat16, "fusedopt.AdamW state_bits=4, fused=True"),
    "torch-adamw": (torch.float32, "torch.optim.AdamW(fused=True), fp32 params, bf16 compute"),
    "flashoptim-release": (torch.bfloat16, "flashoptim.FlashAdamW + enable_gradient_release"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="the tiny preset, 64 tokens, 2+2 steps (a smoke test)")
    p.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)} (default 1b; tiny with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1024; 64 with --tiny)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None, help="default 3 (1 with --tiny)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    p.add_argument("--only", default=None, help=f"comma-separated configurations of {', '.join(CONFIGS)}")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.tiny else "1b")
    args.seq_len = args.seq_len or (64 if args.tiny else 1024)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
    args.only = [c.strip() for c in args.only.split(",")] if args.only else list(CONFIGS)
    unknown = [c for c in args.only if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    return args


def build(name: str, args, device):
    """The sharded model and its optimizer for configuration ``name``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = CONFIGS[name][0]
    torch.manual_seed(0)
    model = TinyLM(PRESETS[args.preset], checkpointing=True, device=device, dtype=dtype)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    params = list(model.parameters())
    if name == "torch-adamw":
        return model, torch.optim.AdamW(params, **HPARAMS, fused=device.type == "cuda")
    if name.startswith("fusedopt"):
        bits = 4 if "4bit" in name else 8
        fused = "fused" in name
        clip = 1.0 if name.endswith("clip") else None
        return model, fusedopt.AdamW(params, **HPARAMS, state_bits=bits, fused=fused, max_grad_norm=clip)
    # FlashOptim as the profiler builds it (its README's enable_gradient_release), a benchmark-only dependency
    optimizer = COMPETITORS["flashoptim.FlashAdamW"].build(params, dict(HPARAMS), "cuda", release=True, model=model)
    return model, optimizer


def train_step(model, opt, tokens: torch.Tensor) -> torch.Tensor:
    loss = model(tokens, labels=tokens)  # each rank's mean; FSDP2 averages the gradients over ranks
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def allocated(device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def largest_over_ranks(value):
    """The largest value over ranks (per-GPU memory is reported for the fullest GPU)."""
    if value is None:
        return None
    t = torch.tensor(float(value), dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def run_config(name: str, args, device, baseline: int | None) -> dict:
    model, opt = build(name, args, device)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    vocab = PRESETS[args.preset].vocab

    def tokens() -> torch.Tensor:
        return torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen).to(device)

    losses = [train_step(model, opt, tokens()) for _ in range(args.warmup)]
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses.append(train_step(model, opt, tokens()))
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    persistent = allocated(device)
    times = []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        losses.append(train_step(model, opt, tokens()))
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    losses = [float(x) for x in losses]
    release = getattr(model, "_flashoptim_release", None)
    if release is not None:
        release.remove()
    del model, opt, release
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    left = allocated(device)
    return {
        "config": name,
        "what": CONFIGS[name][1],
        "ok": all(map(_finite, losses)),
        "peak_gib": _gib(largest_over_ranks(None if peak is None else peak - baseline)),
        "persistent_gib": _gib(largest_over_ranks(None if persistent is None else persistent - baseline)),
        "left_after_gib": _gib(largest_over_ranks(None if left is None else left - baseline)),
        "median_step_ms": statistics.median(times) if times else None,
        "step_ms": times,
        "losses": losses,
    }


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _gib(x):
    return None if x is None else x / GIB


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["config"] == REFERENCE and "error" not in r), None)

    def ratio(r, key):
        if ref is None or r.get(key) is None or not ref.get(key):
            return "   -  "
        return f"{r[key] / ref[key]:6.3f}"

    def num(x, fmt):
        return "-".rjust(int(fmt.split(".")[0])) if x is None else format(x, fmt)

    lines = [
        f"{'configuration':22s} {'peak GiB':>9s} {'persist GiB':>11s} {'step ms':>8s}   "
        f"{'peak/torch':>10s} {'persist/torch':>13s} {'step/torch':>10s}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:22s} failed: {r['error']}")
            continue
        lines.append(
            f"{r['config']:22s} {num(r['peak_gib'], '9.3f')} {num(r['persistent_gib'], '11.3f')} "
            f"{num(r['median_step_ms'], '8.1f')}   {ratio(r, 'peak_gib'):>10s} {ratio(r, 'persistent_gib'):>13s} "
            f"{ratio(r, 'median_step_ms'):>10s}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline = allocated(device)
    rows = []
    for name in args.only:
        if name == "flashoptim-release" and not on_cuda:
            rows.append({"config": name, "what": CONFIGS[name][1], "error": "FlashOptim runs on CUDA only"})
            continue
        try:
            rows.append(run_config(name, args, device, baseline))
        except Exception as exc:  # noqa: BLE001 - a configuration that fails is reported, the others still run
            rows.append({"config": name, "what": CONFIGS[name][1], "error": f"{type(exc).__name__}: {exc}"})
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
        dist.barrier()
    if rank == 0:
        result = {
            "command": " ".join(sys.argv),
            "world_size": world,
            "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
            "preset": args.preset,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "versions": {"torch": torch.__version__, "fusedopt": fusedopt.__version__, **_flashoptim_version()},
            "rows": rows,
        }
        print(table(rows), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {args.out}", flush=True)
    dist.barrier()  # no rank tears the group down while another is still in a collective
    dist.destroy_process_group()
    failed = [r["config"] for r in rows if not r.get("ok") and not r.get("error", "").endswith("CUDA only")]
    return 1 if failed else 0


def _flashoptim_version() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"flashoptim": version("flashoptim")}
    except PackageNotFoundError:
        return {"flashoptim": None}


if __name__ == "__main__":
    raise SystemExit(main())
