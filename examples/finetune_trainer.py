"""Fine-tune a causal LM with the Hugging Face ``Trainer`` and ``fusedopt.AdamW(fused=True)``.

``fusedopt.integrations.huggingface.FusedOptTrainer`` is a ``transformers.Trainer`` whose optimizer
is a fusedopt one, given as ``optimizer_cls_and_kwargs``: the Trainer builds it (with its weight-decay
groups) and its LR schedule from the ``TrainingArguments``. ``max_grad_norm`` clips inside the
optimizer (with ``fused=True`` each gradient is clipped and applied during backward, then freed),
the logged ``grad_norm`` is the optimizer's, ``gradient_accumulation_steps`` becomes its
``accumulation_steps``, and checkpoints and ``--resume`` are the Trainer's own (exact).

The model is built from a Llama config (tiny on CPU, the TinyLlama 1.1B shape on a GPU) in bf16 with
non-reentrant activation checkpointing, trained on byte-level text from the Python standard library
(nothing is downloaded).

    python examples/finetune_trainer.py                            # CPU: tiny Llama, a few steps
    python examples/finetune_trainer.py --steps 200                # GPU: 1.1B Llama shape, bf16
    python examples/finetune_trainer.py --steps 200 --resume out/finetune_trainer/checkpoint-100

Needs ``pip install transformers accelerate``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import fusedopt
from fusedopt.profile.models import enable_hf_checkpointing, stdlib_source_bytes


class ByteWindows(torch.utils.data.Dataset):
    """``size`` windows of ``seq_len`` bytes at positions drawn from ``seed``: a fixed dataset."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, size: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.corpus, self.seq_len = corpus, seq_len
        self.starts = torch.randint(0, len(corpus) - seq_len, (size,), generator=gen).tolist()

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        ids = self.corpus[self.starts[i] : self.starts[i] + self.seq_len].long()
        return {"input_ids": ids, "labels": ids}


def llama_config(tiny: bool):
    import transformers

    if tiny:
        shape = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4)
        shape["num_key_value_heads"] = 2
    else:  # TinyLlama 1.1B
        shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32)
        shape["num_key_value_heads"] = 4
    return transformers.LlamaConfig(vocab_size=256, max_position_embeddings=4096, use_cache=False, **shape)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200 on CUDA, 4 on CPU)")
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--accum", type=int, default=None, help="micro-batches per step (gradient_accumulation_steps)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip in the optimizer (0: no clipping)")
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--resume", help="a checkpoint directory this example saved (out/.../checkpoint-N)")
    p.add_argument("--out", default="out/finetune_trainer")
    p.add_argument("--summary-json", help="write the logged losses and grad norms to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    defaults = dict(steps=200 if on_gpu else 4, micro_batch=1 if on_gpu else 2, accum=4 if on_gpu else 2)
    defaults["seq_len"] = 1024 if on_gpu else 64
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "micro_batch", "accum", "seq_len", "save_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import transformers

        from fusedopt.integrations.huggingface import FusedOptTrainer
    except ImportError as error:
        print(f"error: this example needs transformers and accelerate ({error})", file=sys.stderr)
        return 2
    on_gpu = args.device.startswith("cuda")
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(llama_config(tiny=not on_gpu)).to(args.device, torch.bfloat16)
    enable_hf_checkpointing(model)  # non-reentrant: release updates each parameter once per backward

    corpus = stdlib_source_bytes(8_000_000)
    dataset = ByteWindows(corpus, args.seq_len, size=args.steps * args.accum * args.micro_batch, seed=args.seed)
    training_args = transformers.TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.accum,  # becomes the optimizer's accumulation_steps
        learning_rate=args.lr,
        weight_decay=0.1,
        max_grad_norm=args.max_grad_norm,  # clipped by the optimizer, inside backward
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        logging_steps=1,
        save_steps=args.save_steps,
        report_to="none",
        use_cpu=not on_gpu,
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = FusedOptTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(betas=(0.9, 0.95), fused=True)),
    )
    trainer.train(resume_from_checkpoint=args.resume)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({"losses": [e["loss"] for e in logs], "grad_norms": [e.get("grad_norm") for e in logs]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
