"""Fine-tune a Hugging Face ``transformers`` causal LM with fusedopt (built from a config, no download).

The model is ``AutoModelForCausalLM.from_config(...)``: a Llama config written here (tiny on
CPU, the TinyLlama 1.1B shape on a GPU), or any ``config.json`` given with ``--config``; pass
``--init`` with a directory saved by ``save_pretrained`` to start from real weights (with that
directory's config unless ``--config`` is given). It is
trained in bf16 with gradient checkpointing and ``fusedopt.AdamW(fused=True)`` (the update runs
inside backward and frees each gradient), gradient accumulation through
``accumulation_steps``, a warm-up + cosine schedule, on byte-level text from the Python
standard library. At the end it saves the model with ``save_pretrained`` plus the optimizer,
scheduler and step (``optimizer.pt``), and prints the memory of the last step measured by
``fusedopt.profile``.

    python examples/finetune_hf.py                          # CPU: tiny Llama, a few steps
    python examples/finetune_hf.py --steps 200 --total-steps 400   # GPU: 1.1B Llama shape, bf16
    python examples/finetune_hf.py --steps 400 --resume out/finetune_hf   # continue it to step 400
    python examples/finetune_hf.py --config my_model/config.json --init my_model/

Llama-3-8B on one 24 GB GPU (a directory saved by ``save_pretrained``; the configuration the planner
recommends for it, ``fusedopt-profile plan --model llama3-8b --gpu-memory 22.35``)::

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python examples/finetune_hf.py --init Meta-Llama-3-8B/ \
        --state-format norm2-root4 --master-weight-bits none --vocab-pieces 8 --chunked-loss --accum 1

``--vocab-pieces N`` holds the embedding and the LM head as N row pieces each (``fusedopt.split_rows``),
so release holds one piece's gradient at a time; ``--chunked-loss`` computes the loss with
``fusedopt.chunked_cross_entropy``, which never builds the full logits. ``--accum 1``: with
accumulation the optimizer keeps every gradient until the last micro-batch.

The LR schedule (warm-up, then cosine to ``lr * min_lr_ratio`` at ``--total-steps``, default
``--steps``; constant after that) is fixed when a run starts and saved in ``optimizer.pt``. A
resumed run follows the saved schedule, so its LR at every step is what an uninterrupted run
would have had; a schedule option given on resume that differs from the saved one is an error
(exit code 2). To train longer than the first ``--steps`` with a full decay, pass the final
``--total-steps`` when the run starts.

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
from memory_summary import summarize  # examples/memory_summary.py: sizes in B/KiB/MiB/GiB
from schedule import lr_lambda, resolve_schedule, saved_schedule  # examples/schedule.py

import fusedopt
from fusedopt.pieces import RowPiecesLinear
from fusedopt.profile import MemoryTracker
from fusedopt.profile.models import enable_hf_checkpointing, stdlib_source_bytes

DEFAULT_LR = 2e-4  # the schedule's peak LR unless --lr or a checkpoint says otherwise


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
    p.add_argument("--resume", help="a directory this example saved (--out): continue its run to --steps")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps to reach (default 200 CUDA, 4 CPU)")
    p.add_argument("--total-steps", type=int, default=None, help="length of the LR schedule (default: --steps)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: total steps / 10)")
    p.add_argument("--min-lr-ratio", type=float, default=None, help="final LR / peak LR (default 0.1)")
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--accum", type=int, default=None, help="micro-batches per step (accumulation_steps)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-4)")
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clip by the global gradient norm inside the optimizer, as release needs (0: no clipping)",
    )
    p.add_argument("--state-bits", type=int, default=None, help="override fusedopt's default state_bits")
    p.add_argument("--state-format", default=None, help="a state format by name, e.g. norm2-root4")
    p.add_argument("--vocab-pieces", type=int, default=None, help="embedding and LM head in N row pieces each")
    p.add_argument("--chunked-loss", action="store_true", help="the loss without the full logits")
    p.add_argument("--master-weight-bits", default=None, help="override the default master_weight_bits (24, 32, none)")
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        default=None,
        help="CUDA: let the allocator use at most this much (e.g. 22.35 to try a 24 GB card on a larger one)",
    )
    p.add_argument("--out", default="out/finetune_hf")
    p.add_argument("--no-save", action="store_true", help="do not save the model and optimizer at the end")
    p.add_argument("--summary-json", help="write losses and the memory summary to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    args.steps = args.steps if args.steps is not None else (200 if on_gpu else 4)
    defaults = dict(micro_batch=1 if on_gpu else 2, accum=4 if on_gpu else 2, seq_len=1024 if on_gpu else 64)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "micro_batch", "accum", "seq_len", "total_steps", "warmup", "vocab_pieces"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def next_token_loss(model, ids: torch.Tensor, chunked: bool) -> torch.Tensor:
    """The mean next-token loss; ``chunked``: from the last hidden state, without the full logits."""
    if not chunked:
        return model(input_ids=ids, labels=ids).loss  # the ModelOutput is dropped here
    hidden = model.base_model(input_ids=ids).last_hidden_state
    head = model.get_output_embeddings()
    weight = head.pieces if isinstance(head, RowPiecesLinear) else head.weight
    return fusedopt.chunked_cross_entropy(hidden[:, :-1], weight, ids[:, 1:])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("error: this example needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    ckpt = None
    if args.resume:
        if args.init or args.config:
            print("error: --resume takes the model from its directory; leave out --init and --config", file=sys.stderr)
            return 2
        ckpt = torch.load(os.path.join(args.resume, "optimizer.pt"), map_location=device, weights_only=True)
        if "schedule" not in ckpt:  # written by an older version of this example
            print(
                f"note: {args.resume} has no saved LR schedule; using the options given "
                "(pass the --total-steps, --warmup, --lr and --min-lr-ratio the run started with)",
                file=sys.stderr,
            )
        if args.steps <= ckpt["step"]:
            print(f"error: the checkpoint is at step {ckpt['step']}; pass --steps above it", file=sys.stderr)
            return 2
    error = resolve_schedule(args, ckpt.get("schedule") if ckpt is not None else None, DEFAULT_LR)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # The config of the model this run trains: every check and message below reads it, and the
    # model is built (or loaded, with it) from it: a resumed run's own, else --config, else --init's.
    pretrained = args.init or args.resume  # a directory whose weights are loaded
    source = args.resume or args.config or args.init
    if source:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    else:
        config = llama_config(tiny=device.type == "cpu")
    if config.vocab_size < 256:
        print("error: byte-level data needs a vocabulary of at least 256", file=sys.stderr)
        return 2
    if args.vocab_pieces and config.tie_word_embeddings:
        print("error: --vocab-pieces needs an untied LM head (tie_word_embeddings is true)", file=sys.stderr)
        return 2
    config.use_cache = False
    if args.memory_cap_gib is not None:
        if device.type != "cuda":
            print("error: --memory-cap-gib caps a CUDA device's allocator", file=sys.stderr)
            return 2
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), index)
    torch.manual_seed(args.seed)
    if pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, config=config, local_files_only=True)
    elif device.type == "cuda":  # built on the GPU in its dtype: an fp32 copy of a large model on the CPU is slow
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with device:
                model = transformers.AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(default_dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(device=device, dtype=dtype)
    if args.vocab_pieces:  # before the optimizer: each piece is a parameter of its own
        if model.get_output_embeddings().weight is model.get_input_embeddings().weight:  # tied another way
            print("error: --vocab-pieces needs an untied LM head (the model ties it)", file=sys.stderr)
            return 2
        model.set_input_embeddings(fusedopt.split_rows(model.get_input_embeddings(), args.vocab_pieces))
        model.set_output_embeddings(fusedopt.split_rows(model.get_output_embeddings(), args.vocab_pieces))
    enable_hf_checkpointing(model)  # non-reentrant activation checkpointing, any transformers version
    model.train()

    kwargs = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True, accumulation_steps=args.accum)
    kwargs["max_grad_norm"] = args.max_grad_norm or None  # clipped inside backward, before release
    if args.state_bits is not None:
        kwargs["state_bits"] = args.state_bits
    if args.state_format is not None:
        kwargs["state_format"] = args.state_format
    if args.master_weight_bits is not None:
        kwargs["master_weight_bits"] = None if args.master_weight_bits == "none" else int(args.master_weight_bits)
    optimizer = fusedopt.AdamW(model.parameters(), **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    start = 0
    if ckpt is not None:
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
        f"{config.model_type}: {num_params:,} parameters, {args.dtype} on {device}, "
        f"micro-batch {args.micro_batch} x {args.seq_len}, {args.accum} micro-batches per step"
    )
    losses, lrs, memory, t0 = [], [], None, time.perf_counter()
    for step in range(start, args.steps):
        lr = optimizer.param_groups[0]["lr"]  # the LR this step's update uses
        tracker = MemoryTracker(model, optimizer, device=device) if step == args.steps - 1 else None
        phase = tracker.phase if tracker else (lambda name: contextlib.nullcontext())
        with tracker or contextlib.nullcontext():
            total = 0.0
            for micro in range(args.accum):
                ids = get_batch(corpus, step, micro, args, device)
                with phase("forward"):
                    loss = next_token_loss(model, ids, args.chunked_loss) / args.accum
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
        lrs.append(lr)
        elapsed = time.perf_counter() - t0
        norm = "" if optimizer.grad_norm is None else f"  grad norm {float(optimizer.grad_norm):.3f}"
        print(f"step {step + 1}/{args.steps}  loss {total:.4f}{norm}  lr {lr:.2e}  {elapsed:.1f}s", flush=True)
        if not math.isfinite(total):
            print("non-finite loss; stopping", file=sys.stderr)
            return 1

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
        print(f"peak over the run: {peak[0]:.2f} GiB allocated, {peak[1]:.2f} GiB reserved")
    if not args.no_save:
        os.makedirs(args.out, exist_ok=True)
        model.save_pretrained(args.out)
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": args.steps,
                "schedule": saved_schedule(args),
            },
            os.path.join(args.out, "optimizer.pt"),
        )
        print(f"saved to {args.out}")
    print(summarize(memory, num_params))
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({"losses": losses, "lrs": lrs, "num_params": num_params, "memory": memory.to_dict()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
