"""Low-VRAM fine-tuning in plain PyTorch with fusedopt.

A bf16 decoder-only LM is trained on byte-level text (the Python standard library's own source,
so nothing is downloaded) with ``fusedopt.AdamW(fused=True)``: each parameter is updated inside
backward as soon as its gradient is complete, and the gradient is freed, so a full set of
gradients never exists. Gradient accumulation goes through ``accumulation_steps`` (the
optimizer releases on the k-th backward). With activation checkpointing and a small
micro-batch this is the setting where fusedopt's savings make the step fit.

It shows the whole loop: warm-up + cosine LR schedule, accumulation, periodic evaluation,
checkpoint save and exact resume (model, optimizer, scheduler, step; data order is a pure
function of the step), and a memory summary of the last step from ``fusedopt.profile``.

    python examples/finetune_lowvram.py                       # CPU: tiny model, a few steps
    python examples/finetune_lowvram.py --preset 1b --steps 200 --total-steps 400 --seq-len 1024   # GPU
    python examples/finetune_lowvram.py --preset 1b --seq-len 1024 --steps 400 \
        --resume out/finetune_lowvram/checkpoint.pt          # continue the same run to step 400
    python examples/finetune_lowvram.py --init weights.pt     # start from your own weights

The LR schedule is fixed when a run starts and saved in its checkpoints: ``--total-steps``
(default: ``--steps``), ``--warmup``, ``--lr``, ``--min-lr-ratio``. A resumed run follows the
saved schedule, so its LR at every step is what an uninterrupted run would have had; past
``--total-steps`` the LR stays at ``lr * min_lr_ratio``. To train longer than the first
``--steps`` with a full cosine decay, pass the final ``--total-steps`` when the run starts.
Passing a schedule option on resume that differs from the saved one is an error (exit code 2):
it would change the LR mid-run; leave it out to continue the saved schedule.

Defaults: on CUDA the 1.1B TinyLlama shape, micro-batch 1 x 1024, 4 micro-batches per step;
on CPU the ``tiny`` preset, micro-batch 2 x 64, 2 micro-batches per step, 6 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
from memory_summary import summarize  # examples/memory_summary.py: sizes in B/KiB/MiB/GiB
from schedule import lr_lambda, resolve_schedule, saved_schedule  # examples/schedule.py

import fusedopt
from fusedopt.profile import MemoryTracker
from fusedopt.profile.models import PRESETS, TinyLM, UserError, parse_dtype, parse_shape, stdlib_source_bytes


def load_corpus() -> torch.Tensor:
    """8 MB of the standard library's source, as bytes (the model is byte-level)."""
    return stdlib_source_bytes(8_000_000)


def get_batch(corpus: torch.Tensor, step: int, micro: int, args, split: str, device) -> torch.Tensor:
    """Sequences at positions drawn from (seed, step, micro-batch): resuming replays the same data."""
    n_eval = max(len(corpus) // 20, args.seq_len + 1)
    lo, hi = (0, len(corpus) - n_eval) if split == "train" else (len(corpus) - n_eval, len(corpus))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + micro + (7 if split == "eval" else 0))
    starts = torch.randint(lo, hi - args.seq_len, (args.micro_batch,), generator=gen)
    return torch.stack([corpus[s : s + args.seq_len] for s in starts.tolist()]).long().to(device)


def build_optimizer(model, args):
    kwargs = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True, accumulation_steps=args.accum)
    kwargs["max_grad_norm"] = args.max_grad_norm or None  # clipped inside backward, before release
    # Leave state_bits / master_weight_bits unset to get fusedopt's defaults (8-bit state, 24-bit master).
    if args.state_bits is not None:
        kwargs["state_bits"] = args.state_bits
    if args.master_weight_bits is not None:
        kwargs["master_weight_bits"] = None if args.master_weight_bits == "none" else int(args.master_weight_bits)
    return fusedopt.AdamW(model.parameters(), **kwargs)


def train_step(model, optimizer, scheduler, corpus, step, args, device, phase=None):
    """One optimizer step of ``args.accum`` micro-batches; returns the mean loss."""
    phase = phase or (lambda name: contextlib.nullcontext())
    total = 0.0
    for micro in range(args.accum):
        ids = get_batch(corpus, step, micro, args, "train", device)
        with phase("forward"):
            loss = model(ids, ids) / args.accum
        with phase("backward"):
            loss.backward()  # fused=True: parameters are updated here on the last micro-batch
            total += loss.item()
            del loss
    with phase("update"):
        optimizer.step()  # bookkeeping (and anything not yet updated); the update already ran in backward
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return total


@torch.no_grad()
def evaluate(model, corpus, args, device, batches: int = 2) -> float:
    model.eval()
    losses = [model(ids, ids).item() for ids in (get_batch(corpus, 0, i, args, "eval", device) for i in range(batches))]
    model.train()
    return sum(losses) / len(losses)


DEFAULT_LR = 3e-4  # the schedule's peak LR unless --lr or a checkpoint says otherwise


def save_checkpoint(path, model, optimizer, scheduler, step, args):
    tmp = path + ".tmp"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "schedule": saved_schedule(args),
            "shape": vars(model.shape),
        },
        tmp,
    )
    os.replace(tmp, path)  # never leave a half-written checkpoint behind


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--preset", help=f"model size: {', '.join(PRESETS)} (default: 1b on CUDA, tiny on CPU)")
    p.add_argument("--shape", help="explicit shape on top of the preset, e.g. layers=4,d_model=256,heads=4")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--init", help="initial weights: a state dict saved with torch.save (fine-tune from it)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps to reach (default: 200 CUDA, 6 CPU)")
    p.add_argument(
        "--total-steps", type=int, default=None, help="length of the LR schedule (default: --steps; saved on resume)"
    )
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--accum", type=int, default=None, help="micro-batches per optimizer step (accumulation_steps)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4; saved on resume)")
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clip by the global gradient norm inside the optimizer, as release needs (0: no clipping)",
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: total steps / 10)")
    p.add_argument("--min-lr-ratio", type=float, default=None, help="final LR / peak LR (default 0.1)")
    p.add_argument("--state-bits", type=int, default=None, help="override fusedopt's default state_bits")
    p.add_argument("--master-weight-bits", default=None, help="override the default master_weight_bits (24, 32, none)")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (and keep checkpoint-N.pt)")
    p.add_argument("--out", default="out/finetune_lowvram")
    p.add_argument("--resume", help="continue from this checkpoint")
    p.add_argument("--no-profile", action="store_true", help="skip the memory summary of the last step")
    p.add_argument("--summary-json", help="write final figures (losses, memory) to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    args.preset = args.preset or ("1b" if on_gpu else "tiny")
    args.steps = args.steps if args.steps is not None else (200 if on_gpu else 6)
    defaults = dict(micro_batch=1 if on_gpu else 2, accum=4 if on_gpu else 2, seq_len=1024 if on_gpu else 64)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "micro_batch", "accum", "seq_len", "total_steps", "warmup"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    if args.preset not in PRESETS:
        print(f"error: unknown preset {args.preset!r} (choose from {', '.join(PRESETS)})", file=sys.stderr)
        return 2
    try:
        shape = parse_shape(args.shape, PRESETS[args.preset]) if args.shape else PRESETS[args.preset]
        dtype = parse_dtype(args.dtype)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if shape.vocab < 256:
        print("error: byte-level data needs vocab >= 256", file=sys.stderr)
        return 2
    ckpt = torch.load(args.resume, map_location=device, weights_only=True) if args.resume else None
    if ckpt is not None and "schedule" not in ckpt:  # written by an older version of this example
        print(
            f"note: {args.resume} has no saved LR schedule; using the options given "
            "(pass the --total-steps, --warmup, --lr and --min-lr-ratio the run started with)",
            file=sys.stderr,
        )
    error = resolve_schedule(args, ckpt.get("schedule") if ckpt is not None else None, DEFAULT_LR)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if ckpt is not None and args.steps <= ckpt["step"]:
        print(f"error: the checkpoint is at step {ckpt['step']}; pass --steps above it to continue", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = TinyLM(shape, checkpointing=True, device=device, dtype=dtype)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location=device, weights_only=True))
    optimizer = build_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    start = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start = ckpt["step"]
        print(f"resumed from {args.resume} at step {start}")
    print(
        f"LR schedule: peak {args.lr:g}, {args.warmup} warm-up steps, cosine to {args.min_lr_ratio:g} x peak"
        f" at step {args.total_steps}"
    )
    corpus = load_corpus()
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {shape.describe()}, {num_params:,} parameters, {args.dtype} on {device}; "
        f"micro-batch {args.micro_batch} x {args.seq_len}, {args.accum} micro-batches per step"
    )
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    losses, lrs, memory, t0 = [], [], None, time.perf_counter()
    for step in range(start, args.steps):
        last = step == args.steps - 1
        lr = optimizer.param_groups[0]["lr"]  # the LR this step's update uses
        if last and not args.no_profile:
            tracker = MemoryTracker(model, optimizer, device=device)
            with tracker:
                loss = train_step(model, optimizer, scheduler, corpus, step, args, device, tracker.phase)
            memory = tracker.result()
        else:
            loss = train_step(model, optimizer, scheduler, corpus, step, args, device)
        losses.append(loss)
        lrs.append(lr)
        if not math.isfinite(loss):
            print(f"step {step + 1}: loss is {loss}; stopping", file=sys.stderr)
            return 1
        elapsed = time.perf_counter() - t0
        norm = "" if optimizer.grad_norm is None else f"  grad norm {float(optimizer.grad_norm):.3f}"
        print(f"step {step + 1}/{args.steps}  loss {loss:.4f}{norm}  lr {lr:.2e}  {elapsed:.1f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            print(f"  eval loss {evaluate(model, corpus, args, device):.4f}")
        if args.save_every and (step + 1) % args.save_every == 0:
            for path in (ckpt_path, os.path.join(args.out, f"checkpoint-{step + 1}.pt")):
                save_checkpoint(path, model, optimizer, scheduler, step + 1, args)
    save_checkpoint(ckpt_path, model, optimizer, scheduler, args.steps, args)
    eval_loss = evaluate(model, corpus, args, device)
    print(f"saved {ckpt_path}; eval loss {eval_loss:.4f}")
    if memory is not None:
        print(summarize(memory, num_params))
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "lrs": lrs,  # the LR of each step run here (steps start+1 .. --steps)
                    "eval_loss": eval_loss,
                    "num_params": num_params,
                    "memory": memory.to_dict() if memory is not None else None,
                    "skipped_updates": int(optimizer.num_skipped_updates),
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
