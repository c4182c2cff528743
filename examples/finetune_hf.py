"""Fine-tune a Hugging Face ``transformers`` causal LM with fusedopt (built from a config, no download).

The model is ``AutoModelForCausalLM.from_config(...)``: a Llama config written here (tiny on
CPU, the TinyLlama 1.1B shape on a GPU), or any ``config.json`` given with ``--config``; pass
``--init`` with a directory saved by ``save_pretrained`` to start from real weights. It is
trained in bf16 with gradient checkpointing and ``fusedopt.AdamW(fused=True)`` (the update runs
inside backward and frees each gradient), gradient accumulation through
``accumulation_steps``, a warm-up + cosine schedule, on byte-level text from the Python
standard library. At the end it saves the model with ``save_pretrained`` plus the optimizer
state, and prints the memory of the last step measured by ``fusedopt.profile``.

    python examples/finetune_hf.py                          # CPU: tiny Llama, a few steps
    python examples/finetune_hf.py --steps 200              # GPU: 1.1B Llama shape, bf16
    python examples/finetune_hf.py --config my_model/config.json --init my_model/

Needs ``pip install transformers``.
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

import fusedopt
from fusedopt.profile import MemoryTracker
from fusedopt.profile.models import enable_hf_checkpointing, stdlib_source_bytes


def llama_config(tiny: bool):
    import transformers

    if tiny:
        shape = dict(
            hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
        )
    else:  # TinyLlama 1.1B
        shape = dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
        )
    return transformers.LlamaConfig(
        vocab_size=256 + 3,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        **shape,
    )


def load_corpus() -> torch.Tensor:
    """8 MB of the standard library's source, as bytes (the model is byte-level)."""
    return stdlib_source_bytes(8_000_000)


def get_batch(corpus, step, micro, args, device):
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + micro)
    starts = torch.randint(0, len(corpus) - args.seq_len, (args.micro_batch,), generator=gen)
    return torch.stack([corpus[s : s + args.seq_len] for s in starts.tolist()]).long().to(device)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--config", help="a transformers config.json (default: a Llama config, tiny on CPU)")
    p.add_argument("--init", help="a directory saved with save_pretrained: start from its weights")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200 on CUDA, 4 on CPU)")
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--accum", type=int, default=None, help="micro-batches per step (accumulation_steps)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--state-bits", type=int, default=None, help="override fusedopt's default state_bits")
    p.add_argument("--master-weight-bits", default=None, help="override the default master_weight_bits (24, 32, none)")
    p.add_argument("--out", default="out/finetune_hf")
    p.add_argument("--summary-json", help="write losses and the memory summary to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    args.steps = args.steps if args.steps is not None else (200 if on_gpu else 4)
    defaults = dict(micro_batch=1 if on_gpu else 2, accum=4 if on_gpu else 2, seq_len=1024 if on_gpu else 64)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "micro_batch", "accum", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("error: this example needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.config:
        config = transformers.AutoConfig.from_pretrained(args.config, local_files_only=True)
    else:
        config = llama_config(tiny=device.type == "cpu")
    if config.vocab_size < 256:
        print("error: byte-level data needs a vocabulary of at least 256", file=sys.stderr)
        return 2
    config.use_cache = False
    torch.manual_seed(args.seed)
    if args.init:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.init, local_files_only=True)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(device=device, dtype=dtype)
    enable_hf_checkpointing(model)  # non-reentrant activation checkpointing, any transformers version
    model.train()

    kwargs = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True, accumulation_steps=args.accum)
    if args.state_bits is not None:
        kwargs["state_bits"] = args.state_bits
    if args.master_weight_bits is not None:
        kwargs["master_weight_bits"] = None if args.master_weight_bits == "none" else int(args.master_weight_bits)
    optimizer = fusedopt.AdamW(model.parameters(), **kwargs)
    warmup = max(1, args.steps // 10)
    schedule = lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / args.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    corpus = load_corpus()
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"{config.model_type}: {num_params:,} parameters, {args.dtype} on {device}, "
        f"micro-batch {args.micro_batch} x {args.seq_len}, {args.accum} micro-batches per step"
    )
    losses, memory, t0 = [], None, time.perf_counter()
    for step in range(args.steps):
        tracker = MemoryTracker(model, optimizer, device=device) if step == args.steps - 1 else None
        phase = tracker.phase if tracker else (lambda name: contextlib.nullcontext())
        with tracker or contextlib.nullcontext():
            total = 0.0
            for micro in range(args.accum):
                ids = get_batch(corpus, step, micro, args, device)
                with phase("forward"):
                    loss = model(input_ids=ids, labels=ids).loss / args.accum  # the ModelOutput is dropped here
                with phase("backward"):
                    loss.backward()  # the k-th backward updates each parameter and frees its gradient
                    total += loss.item()
                    del loss
            with phase("update"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
        if tracker:
            memory = tracker.result()
        losses.append(total)
        print(f"step {step + 1}/{args.steps}  loss {total:.4f}  {time.perf_counter() - t0:.1f}s", flush=True)
        if not math.isfinite(total):
            print("non-finite loss; stopping", file=sys.stderr)
            return 1

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": args.steps},
        os.path.join(args.out, "optimizer.pt"),
    )
    print(f"saved to {args.out}")
    gib = lambda b: f"{b / 2**30:.3f} GiB"
    cats = memory.peak_breakdown.categories
    print(
        f"memory of the last step ({memory.method['peak']}): peak {gib(memory.peak)} in {memory.peak_phase}; "
        + ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in cats.items())
        + f"; persistent {gib(memory.persistent)}"
    )
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({"losses": losses, "num_params": num_params, "memory": memory.to_dict()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
