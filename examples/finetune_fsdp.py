"""Data-parallel fine-tuning with FSDP2 (``fully_shard``) and fusedopt's gradient release.

Each transformer block and the whole model are sharded with ``fully_shard``; every rank keeps the
optimizer state of its own shard. ``fusedopt.AdamW(fused=True)`` updates each shard inside
backward, as soon as FSDP2 has reduce-scattered its gradient, and frees that gradient. Because the
update runs inside backward, the loss must be normalised across ranks *before* ``backward()``:
here by the global number of target tokens, all-reduced first (FSDP2 averages the gradients over
ranks, so each rank's loss is its summed token loss times world size / global tokens).
Gradients are clipped by their global norm (``--max-grad-norm``): each rank's update hook sums the
squared norm of its shard over the ranks, so every rank clips with the same factor.

Checkpoints go through ``torch.distributed.checkpoint`` (one directory, each rank writing its
shards) and load on any number of ranks.

    torchrun --nproc_per_node 2 examples/finetune_fsdp.py                  # 2 GPUs (or CPU/gloo)
    torchrun --nproc_per_node 2 examples/finetune_fsdp.py --device cpu --steps 4
    torchrun --nproc_per_node 2 examples/finetune_fsdp.py --resume out/finetune_fsdp/checkpoint --steps 8
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fusedopt
from fusedopt.profile.models import PRESETS, TinyLM, stdlib_source_bytes


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--preset", default=None, help=f"{', '.join(PRESETS)} (default: 1b on CUDA, tiny on CPU)")
    p.add_argument("--steps", type=int, default=None, help="train until this step (default: 50 on CUDA, 3 on CPU)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank (default: 4 on CUDA, 2 on CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="default: 1024 on CUDA, 64 on CPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--state-bits", type=int, default=8, choices=(32, 16, 8, 4))
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clip gradients to this global L2 norm inside backward (0: no clipping)",
    )
    p.add_argument("--out", default="out/finetune_fsdp")
    p.add_argument("--resume", default=None, help="a checkpoint directory written by this script")
    args = p.parse_args(argv)
    on_cuda = args.device == "cuda"
    args.preset = args.preset or ("1b" if on_cuda else "tiny")
    args.steps = args.steps or (50 if on_cuda else 3)
    args.micro_batch = args.micro_batch or (4 if on_cuda else 2)
    args.seq_len = args.seq_len or (1024 if on_cuda else 64)
    return args


def get_batch(corpus: torch.Tensor, step: int, rank: int, args, device) -> torch.Tensor:
    """This rank's sequences of a step (a pure function of step and rank: resuming replays the data)."""
    gen = torch.Generator().manual_seed(step * 1009 + rank)
    starts = torch.randint(0, len(corpus) - args.seq_len - 1, (args.micro_batch,), generator=gen)
    return torch.stack([corpus[s : s + args.seq_len + 1] for s in starts.tolist()]).long().to(device)


def normalised_loss(model, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The loss whose gradient, averaged by FSDP2 over ranks, is that of the mean over all ranks' tokens."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    tokens = torch.tensor(float(targets.numel()), device=batch.device)
    dist.all_reduce(tokens)  # the global token count, known before backward (with padding: count real tokens)
    logits = model(inputs)
    summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    return summed * dist.get_world_size() / tokens, (summed / tokens).detach()


def checkpoint_state(model, optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # every rank builds the same initial model; fully_shard keeps its shard
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = TinyLM(PRESETS[args.preset], checkpointing=True, device=device, dtype=dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = fusedopt.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        state_bits=args.state_bits,
        fused=True,
        max_grad_norm=args.max_grad_norm or None,  # the whole model's norm, summed over the ranks' shards
    )
    step = 0
    if args.resume:
        state = checkpoint_state(model, optimizer)
        state["step"] = torch.zeros((), dtype=torch.int64)
        dcp.load(state, checkpoint_id=args.resume)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)
    corpus = stdlib_source_bytes(2_000_000)
    start = time.perf_counter()
    while step < args.steps:
        loss, mean = normalised_loss(model, get_batch(corpus, step, rank, args, device))
        loss.backward()  # fused=True: each shard is updated here, right after its reduce-scatter
        optimizer.step()  # bookkeeping; the update already ran in backward
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dist.all_reduce(mean)  # for the log only: the mean token loss over all ranks
        if rank == 0:
            norm = "" if optimizer.grad_norm is None else f"  grad norm {float(optimizer.grad_norm):.3f}"
            print(
                f"step {step}/{args.steps}  loss {mean.item():.4f}{norm}  {time.perf_counter() - start:.1f}s",
                flush=True,
            )
        if not math.isfinite(mean.item()):
            return 1
    state = checkpoint_state(model, optimizer)
    state["step"] = torch.tensor(step)
    path = os.path.join(args.out, "checkpoint")
    dcp.save(state, checkpoint_id=path)
    if rank == 0:
        print(f"saved {path} (step {step}, {world} ranks)", flush=True)
    dist.barrier()  # no rank tears the group down while another is still in a collective (gloo aborts)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
