"""Full fine-tuning of the 7B Llama shape on one GPU under an enforced memory cap (24 GiB by default).

The profiler's Llama-style model (``fusedopt.profile.models``, preset ``7b``: 6.74e9 parameters,
bf16, activation checkpointing) trains for ``--steps`` steps at micro-batch 1 x 1024 on real text
(Python's standard-library source as bytes, the corpus of the quality benchmarks) with
``fused=True``, while the CUDA caching allocator is capped at the budget with
``torch.cuda.set_per_process_memory_fraction`` (the CUDA context and library handles are outside
the cap). It reports whether every step ran, the peak allocated and reserved memory, the median step
time, and the training loss along the way (random initialisation: the loss must fall from ln(vocab)
towards the corpus's byte entropy; a diverging or non-finite loss fails the run).

    python benchmarks/fit_7b.py --config block4-nomaster --steps 300 --out $OUT/fit_7b.json
    python benchmarks/fit_7b.py --shape vocab=256,d_model=64,layers=2,heads=2,kv_heads=2,ffn=192 \\
        --device cpu --steps 5 --config block4-nomaster        # CPU smoke test (no cap)

``--vocab-pieces N`` holds the embedding and the LM head as N row pieces each
(``fusedopt.split_rows``), so release holds one piece's gradient at a time; ``--chunked-loss`` computes
the loss with ``fusedopt.chunked_cross_entropy`` (default chunk: 0), given the head's pieces.

    python benchmarks/fit_7b.py --shape llama3-8b --config norm2-root4-nomaster --budget-gib 22.35 \
        --vocab-pieces 8 --chunked-loss 0 --steps 200 --out $OUT/fit_llama3.json

``--profile-steps N`` runs N more steps under ``torch.profiler`` and reports the GPU time per step of
every kernel, and of the optimizer's (the update, its finite check, clipping and norms; torch's
fused AdamW), whatever the eager model leaves idle between launches:

    python benchmarks/fit_7b.py --shape llama3-8b --config norm2-root4-nomaster --opt max_grad_norm=1.0 \
        --budget-gib 22.35 --vocab-pieces 8 --chunked-loss 0 --steps 12 --profile-steps 3

With ``--idle`` the profile also records the host and reports the GPU's idle time per step, each gap
charged to the code that launched the kernel after it (where a step waits on Python, not on the GPU).
``benchmarks/llama3_2048.sh`` runs the recipe against torch at 2048 tokens.

``--config`` names one of ``CONFIGS`` (fusedopt.AdamW or fusedopt.Adafactor, its keyword arguments
and peak lr); ``--opt k=v,...`` adds or overrides keyword arguments (``master_weight_bits=None``,
``state_format=norm2-root4``...); for ``torch-bf16``, ``max_grad_norm=X`` clips with ``clip_grad_norm_``
before its step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import corpus, next_token_loss, warmup_cosine, windows  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.losses import default_chunk_size  # noqa: E402
from fusedopt.profile.models import PRESETS, TinyLM, head_weight, parse_shape  # noqa: E402

GIB = 1 << 30
ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# key -> (optimizer class, keyword arguments, peak learning rate). Adafactor's lr is torch's relative
# step: the update is scaled by max(eps2, RMS(param)) * min(lr, 1/sqrt(step)).
CONFIGS = {
    "default": (fusedopt.AdamW, dict(ADAMW), 1e-4),
    # the baseline: torch's AdamW on the bf16 parameters (fused=True is its CUDA kernel; no release)
    "torch-bf16": (torch.optim.AdamW, dict(ADAMW), 1e-4),
    "nomaster": (fusedopt.AdamW, dict(ADAMW, master_weight_bits=None), 1e-4),
    "block4": (fusedopt.AdamW, dict(ADAMW, state_bits=4), 1e-4),
    "block4-nomaster": (fusedopt.AdamW, dict(ADAMW, state_bits=4, master_weight_bits=None), 1e-4),
    "norm2-root4-nomaster": (fusedopt.AdamW, dict(ADAMW, state_format="norm2-root4", master_weight_bits=None), 1e-4),
    # the peak lrs of the Adafactor sweep of quality.py's formats study; weight decay per step equal to AdamW's
    "adafactor": (fusedopt.Adafactor, dict(weight_decay=1e-4 * 0.1 / 0.3), 0.3),
    "adafactor-nomaster": (fusedopt.Adafactor, dict(weight_decay=1e-4 * 0.1 / 0.3, master_weight_bits=None), 0.3),
    "adafactor-m4": (fusedopt.Adafactor, dict(weight_decay=1e-4 * 0.1 / 0.1, beta1=0.9, state_bits=4), 0.1),
}


# the optimizer's GPU work: fusedopt's Triton kernels by name (update, check, clipping, norms, Adafactor's);
# torch's by a part of the name (its fused AdamW and multi-tensor norm and scale, clip_grad_norm_'s)
OPTIMIZER_KERNELS = {"_update_kernel", "_check_kernel", "_release_clip_kernel", "_release_clip_gradients_kernel",
                     "_sum_squares_kernel", "_rows_kernel", "_cols_kernel", "_factors_kernel", "_usq_kernel",
                     "_norm_kernel", "_apply_kernel"}  # fmt: skip
TORCH_OPTIMIZER_KERNELS = ("FusedOptimizer", "multi_tensor_apply")


def profile_steps(step, steps: int, idle: bool = False) -> dict:
    """GPU time per step (ms) of each kernel over ``steps`` calls of ``step`` under torch.profiler, the
    optimizer's kernels (OPTIMIZER_KERNELS, TORCH_OPTIMIZER_KERNELS) and all of them summed; with ``idle``,
    also the GPU's idle time per step by the code that launched the kernel ending each gap (``idle_by_launcher``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if idle else [])
    with profile(activities=activities, with_stack=idle) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA and idle:
            continue
        us = getattr(event, "self_device_time_total", None)
        us = event.self_cuda_time_total if us is None else us
        if us > 0:
            per_kernel[event.key] = per_kernel.get(event.key, 0.0) + us / 1000 / steps
    optimizer = {
        k: v for k, v in per_kernel.items() if k in OPTIMIZER_KERNELS or any(n in k for n in TORCH_OPTIMIZER_KERNELS)
    }
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    result = {
        "gpu_ms_per_step": sum(per_kernel.values()),
        "optimizer_ms_per_step": sum(optimizer.values()),
        "optimizer_kernels_ms": {k[:120]: round(v, 3) for k, v in sorted(optimizer.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k[:120]: round(v, 3) for k, v in top},
    }
    if idle:
        result["idle_by_launcher"] = idle_by_launcher(prof, steps)
    return result


def idle_by_launcher(prof, steps: int) -> dict:
    """``idle_gaps`` of a finished ``torch.profiler`` run (CPU and CUDA activities, ``with_stack=True``)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            return idle_gaps(json.load(trace)["traceEvents"], steps)


LOOKBACK = 4000  # events of a thread searched back from a launch for the frames around it


def idle_gaps(events: list[dict], steps: int, min_gap_us: float = 5.0) -> dict:
    """The GPU's idle time per step (ms) in a Chrome trace's ``events``: each gap of more than ``min_gap_us``
    between the end of the kernels so far and the next kernel's start is charged to the code that launched
    that kernel: the innermost frames of this project's Python code (else torch's), and the operator."""
    import bisect

    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e
    }
    frames: dict = {}  # thread -> its Python frames and operators, by start
    for e in events:
        if e.get("cat") in ("python_function", "cpu_op") and e.get("ph") == "X":
            frames.setdefault(e["tid"], []).append(e)
    for fs in frames.values():
        fs.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in fs] for tid, fs in frames.items()}

    def launcher(kernel) -> str:
        runtime = launches.get(kernel.get("args", {}).get("correlation"))
        if runtime is None:
            return "(launch not found)"
        t, tid = runtime["ts"], runtime["tid"]
        last = bisect.bisect_right(starts.get(tid, []), t)
        before = frames.get(tid, [])[max(0, last - LOOKBACK) : last]  # the innermost frames started shortly before
        enclosing = sorted((e for e in before if e["ts"] + e.get("dur", 0) >= t), key=lambda e: e.get("dur", 0))
        python = [e["name"] for e in enclosing if e["cat"] == "python_function"]  # innermost first
        ours = [n.rsplit("/", 1)[-1] for n in python if "fusedopt" in n or "benchmarks" in n]
        op = next((e["name"] for e in enclosing if e["cat"] == "cpu_op"), "?")
        where = " < ".join(ours[:3]) if ours else (python[0] if python else "(no python frame)")
        return f"{where} | {op}"

    gaps: dict[str, list] = {}
    end = None
    for kernel in gpu:
        if end is not None and kernel["ts"] - end > min_gap_us:
            entry = gaps.setdefault(launcher(kernel), [0.0, 0])
            entry[0] += (kernel["ts"] - end) / 1000 / steps
            entry[1] += 1
        end = max(end or 0, kernel["ts"] + kernel.get("dur", 0))
    top = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:25]
    return {"total_ms": sum(v[0] for v in gaps.values()), "gaps": {k[:200]: [round(v[0], 3), v[1]] for k, v in top}}


def _value(text: str):
    if text == "None":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_opt(text: str | None) -> dict:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--opt: expected key=value, got {item!r}")
        out[key.strip()] = _value(value.strip())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="7b", help="a preset name or key=value overrides of the 7b preset")
    parser.add_argument("--config", default="block4-nomaster", choices=sorted(CONFIGS))
    parser.add_argument("--opt", default=None, help="extra optimizer keyword arguments, k=v,...")
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the config's)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab-pieces", type=int, default=None, help="split the embedding and head (split_rows)")
    parser.add_argument("--chunked-loss", type=int, default=None, help="tokens per chunked-loss chunk (0: default)")
    parser.add_argument("--profile-steps", type=int, default=0, help="then N steps under torch.profiler (CUDA)")
    parser.add_argument("--idle", action="store_true", help="with --profile-steps: the GPU's idle time by launcher")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    shape = PRESETS[args.shape] if args.shape in PRESETS else parse_shape(args.shape, PRESETS["7b"])
    opt_class, kwargs, lr = CONFIGS[args.config]
    kwargs = {**kwargs, **parse_opt(args.opt)}
    torch_clip = None  # torch's AdamW clips by clip_grad_norm_ before its step (--opt max_grad_norm=X)
    if opt_class is torch.optim.AdamW:
        torch_clip = kwargs.pop("max_grad_norm", None)
    else:
        kwargs = {"max_grad_norm": None, **kwargs}  # no clipping unless --opt asks
    lr = args.lr if args.lr is not None else lr
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * GIB / total), index)
    train, _, digest = corpus(None if cuda else 2_000_000)
    train = train.to(device)

    torch.manual_seed(0)
    model = TinyLM(shape, checkpointing=True, device=device, dtype=torch.bfloat16)
    if args.vocab_pieces:
        model.embed_tokens = fusedopt.split_rows(model.embed_tokens, args.vocab_pieces)
        model.lm_head = fusedopt.split_rows(model.lm_head, args.vocab_pieces)
    chunk = None if args.chunked_loss is None else args.chunked_loss or default_chunk_size(shape.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    opt = opt_class(model.parameters(), lr=lr, fused=True, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps + args.profile_steps))
    gen = torch.Generator().manual_seed(0)
    losses, times, error, profiled = [], [], None, None

    def step():
        starts = torch.randint(0, train.numel() - args.seq - 2, (args.batch,), generator=gen).to(device)
        x, y = windows(train, starts, args.seq)
        if chunk is None:
            loss = next_token_loss(model, x, y)
        else:
            loss = fusedopt.chunked_cross_entropy(model.hidden_states(x), head_weight(model.lm_head), y, chunk)
        loss.backward()  # fusedopt's fused=True: every parameter is updated inside backward
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return loss.detach()

    try:
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses.append(step())
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if args.profile_steps and cuda:
            profiled = profile_steps(step, args.profile_steps, args.idle)
    except torch.OutOfMemoryError as exc:
        error = f"out of memory at step {len(times)}: {str(exc).splitlines()[0]}"
    losses = [float(v) for v in torch.stack(losses).cpu()] if losses else []
    finite = all(math.isfinite(v) for v in losses)
    window = max(1, len(losses) // 10)
    result = {
        "shape": str(shape),
        "params": n_params,
        "config": args.config,
        "optimizer": opt_class.__name__,
        "lr": lr,
        "optimizer_kwargs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()},
        "clip_grad_norm": torch_clip,
        "budget_gib": args.budget_gib if cuda else None,
        "vocab_pieces": args.vocab_pieces,
        "chunked_loss": chunk,
        "steps_run": len(times),
        "steps": args.steps,
        "error": error,
        "finite": finite,
        "loss_first": statistics.fmean(losses[:window]) if losses else None,
        "loss_last": statistics.fmean(losses[-window:]) if losses else None,
        "loss_every_10": losses[::10],
        "losses": [round(v, 5) for v in losses] if len(losses) <= 1000 else None,  # two runs compared step by step
        "step_s_median": statistics.median(times[2:]) if len(times) > 2 else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
        "persistent_gib": torch.cuda.memory_allocated(device) / GIB if cuda else None,  # weights + state
        "profile": profiled,
        "corpus": digest,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    ok = error is None and finite and len(times) == args.steps
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
