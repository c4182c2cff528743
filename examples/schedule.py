"""The examples' LR schedule (linear warm-up, cosine decay to a floor), saved in checkpoints so a
resumed run keeps the schedule it started with. Imported by ``finetune_lowvram.py`` and
``finetune_hf.py`` (Python puts the script's own directory on ``sys.path``).
"""

from __future__ import annotations

import math

SCHEDULE_KEYS = ("total_steps", "warmup", "lr", "min_lr_ratio")  # what defines the LR at every step
MIN_LR_RATIO = 0.1


def lr_lambda(args):
    """The LR multiplier at each step, for ``torch.optim.lr_scheduler.LambdaLR``."""

    def fn(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.total_steps - args.warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def saved_schedule(args) -> dict:
    return {k: getattr(args, k) for k in SCHEDULE_KEYS}


def resolve_schedule(args, saved: dict | None, default_lr: float) -> str | None:
    """Fill ``args``' schedule: the checkpoint's values on resume, else the options and defaults.

    Returns an error message when an option given on resume contradicts the saved schedule.
    """
    if saved is not None:
        conflicts = [
            f"--{k.replace('_', '-')} {getattr(args, k)} (the checkpoint's schedule has {saved[k]})"
            for k in SCHEDULE_KEYS
            if getattr(args, k) is not None and getattr(args, k) != saved[k]
        ]
        if conflicts:
            return (
                "the checkpoint's LR schedule differs from "
                + "; ".join(conflicts)
                + ": a resumed run keeps the schedule it started with. Leave the option out to continue it"
                " (pass the final --total-steps when a run starts to decay over a longer run)"
            )
        for k in SCHEDULE_KEYS:
            setattr(args, k, saved[k])
        return None
    for k, value in {"lr": default_lr, "min_lr_ratio": MIN_LR_RATIO}.items():
        if getattr(args, k) is None:
            setattr(args, k, value)
    if args.total_steps is None:
        args.total_steps = args.steps
    if args.warmup is None:
        args.warmup = max(1, args.total_steps // 10)
    return None
