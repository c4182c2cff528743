"""Hugging Face ``transformers.Trainer`` with a fusedopt optimizer (needs ``transformers`` and ``accelerate``).

``FusedOptTrainer`` is a ``transformers.Trainer`` whose optimizer is a fusedopt one, given as
``optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True, ...))`` (the Trainer builds it with its
weight-decay groups, its scheduler follows the ``TrainingArguments``) or as
``optimizers=(optimizer, scheduler)``. What it changes:

* **Clipping goes through the optimizer.** ``TrainingArguments.max_grad_norm`` becomes the
  optimizer's ``max_grad_norm`` and the Trainer's own ``clip_grad_norm_`` pass is left out (with
  ``fused=True`` the gradients are gone by then; with ``fused=False`` it would clip twice).
* **The logged ``grad_norm`` is the optimizer's** ``grad_norm`` (the step's global norm before
  clipping, a device tensor read only when the Trainer logs). Without clipping none is logged.
* **Accumulation**: with ``fused=True`` the Trainer's ``gradient_accumulation_steps`` becomes the
  optimizer's ``accumulation_steps``.
* **fp16**: with ``fused=True`` the Trainer's ``GradScaler`` becomes the optimizer's ``grad_scaler``
  (each released gradient is unscaled inside backward).

Unspecified ``optimizer_cls_and_kwargs`` entries come from the ``TrainingArguments`` as the Trainer's
own optimizers take them (``lr``; AdamW's ``betas`` and ``eps``); an optimizer that contradicts them
(``max_grad_norm``, ``accumulation_steps`` with ``fused=True``) is refused when ``train()`` starts.
Checkpoints and ``train(resume_from_checkpoint=...)`` are the Trainer's own: the optimizer's
``state_dict()`` resumes it exactly. ``FusedOptTrainerMixin`` adds the same to another Trainer
subclass: ``class MyTrainer(FusedOptTrainerMixin, SomeTrainer)`` (first among the bases, or the class is
refused), which then takes ``optimizer_cls_and_kwargs`` even where ``SomeTrainer`` does not (TRL's
``DPOTrainer``); ``fusedopt.integrations.trl.FusedOptSFTTrainer`` is TRL's ``SFTTrainer`` with it.

A plain ``transformers.Trainer`` (or TRL trainer) given a ``fused=True`` optimizer is checked by gradient
release itself (``fusedopt.integrations.accelerate.check_release_window``): a ``gradient_accumulation_steps``
the optimizer's ``accumulation_steps`` does not match is refused at the optimizer's first backward, before
anything changes; otherwise that backward warns once that the Trainer's logged ``grad_norm`` (0) and its
``max_grad_norm`` clipping miss the released gradients.
"""

from __future__ import annotations

import inspect

import transformers

from fusedopt.adamw import AdamW
from fusedopt.optimizer import FusedOptimizer

# The Trainer methods this module overrides: a transformers without them would clip and log on its own.
_TRAINER_METHODS = ("create_optimizer", "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate")


def fused_optimizer(optimizer) -> FusedOptimizer | None:
    """The fusedopt optimizer inside ``optimizer`` (accelerate wraps it), or None."""
    while optimizer is not None and not isinstance(optimizer, FusedOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _clip_norm(args) -> float | None:
    """``TrainingArguments.max_grad_norm`` as the optimizer option (0 or less: no clipping)."""
    norm = args.max_grad_norm
    return float(norm) if norm is not None and norm > 0 else None


def optimizer_kwargs(optimizer_cls, kwargs: dict, args) -> dict:
    """``kwargs`` completed from the ``TrainingArguments``: what the Trainer's own optimizers take
    from them, plus clipping and (``fused=True``) accumulation. Given entries are kept as they are."""
    kwargs = dict(kwargs)
    kwargs.setdefault("lr", args.learning_rate)
    if issubclass(optimizer_cls, AdamW):
        kwargs.setdefault("betas", (args.adam_beta1, args.adam_beta2))
        kwargs.setdefault("eps", args.adam_epsilon)
    kwargs.setdefault("max_grad_norm", _clip_norm(args))
    if kwargs.get("fused", False):
        kwargs.setdefault("accumulation_steps", args.gradient_accumulation_steps)
    return kwargs


def check_optimizer(optimizer, args) -> FusedOptimizer:
    """Refuse an optimizer the Trainer cannot drive as ``args`` ask; return the fusedopt optimizer."""
    opt = fused_optimizer(optimizer)
    if opt is None:
        raise TypeError(
            f"FusedOptTrainer trains with a fusedopt optimizer, got {type(optimizer).__name__}: pass "
            "optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True)) or optimizers=(fusedopt optimizer, "
            "scheduler), or use transformers.Trainer"
        )
    expected = _clip_norm(args)
    if opt.max_grad_norm != expected:
        raise ValueError(
            f"the optimizer's max_grad_norm={opt.max_grad_norm} differs from TrainingArguments.max_grad_norm="
            f"{args.max_grad_norm}: FusedOptTrainer clips only through the optimizer. Give the optimizer "
            f"max_grad_norm={expected} (None when TrainingArguments.max_grad_norm is 0)"
        )
    if opt.fused and opt.accumulation_steps != args.gradient_accumulation_steps:
        raise ValueError(
            f"fused=True with accumulation_steps={opt.accumulation_steps} but TrainingArguments."
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: gradient release updates on the "
            f"last backward of each accumulation window, so the two must be equal; give the optimizer "
            f"accumulation_steps={args.gradient_accumulation_steps}"
        )
    return opt


def check_fsdp2_accumulation(opt: FusedOptimizer, accelerator, args) -> None:
    """Refuse gradient accumulation under FSDP2 that would release nothing: accelerate skips the
    reduce-scatter of the micro-batches before the last (``set_requires_gradient_sync(False)``), so no
    update hook runs in them, the last one's runs once short of ``accumulation_steps``, and every update
    waits for ``step()`` with the whole unsharded gradients kept meanwhile."""
    k = args.gradient_accumulation_steps
    if not opt.fused or k <= 1 or accelerator is None or not getattr(accelerator, "is_fsdp2", False):
        return
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        return  # every micro-batch is reduce-scattered: release accumulates the shards
    raise ValueError(
        f"fused=True with gradient_accumulation_steps={k} under FSDP2: accelerate skips the reduce-scatter of all "
        "but the last micro-batch, so gradient release would hold every gradient until step() and save nothing. "
        "Reduce-scatter each micro-batch: TrainingArguments(accelerator_config={'gradient_accumulation_kwargs': "
        "{'sync_each_batch': True}}), or use fused=False"
    )


def hand_over_scaler(opt: FusedOptimizer, scaler) -> None:
    """fp16: a releasing optimizer unscales each gradient inside backward, so it needs the scaler
    accelerate scales the loss with (``grad_scaler``)."""
    if not opt.fused or scaler is None or opt.grad_scaler is scaler:
        return
    if opt.grad_scaler is not None:
        raise ValueError(
            "the optimizer's grad_scaler is not the GradScaler the Trainer scales the loss with (fp16): leave "
            "grad_scaler unset, FusedOptTrainer hands the Trainer's over"
        )
    opt.grad_scaler = scaler


def _init_parameters(parent) -> dict:
    """The keyword parameters ``parent.__init__`` takes (a ``super()`` object)."""
    return inspect.signature(parent.__init__).parameters


class FusedOptTrainerMixin:
    """Clipping, grad-norm logging and accumulation through a fusedopt optimizer (see the module)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if transformers.Trainer in mro and mro.index(transformers.Trainer) < mro.index(FusedOptTrainerMixin):
            raise TypeError(
                f"{cls.__name__}: put FusedOptTrainerMixin before the Trainer among the bases (class "
                f"{cls.__name__}(FusedOptTrainerMixin, SomeTrainer)); after it, the Trainer's own clipping and "
                "grad-norm logging would run instead of the optimizer's"
            )

    def __init__(self, *args, **kwargs):
        missing = [name for name in _TRAINER_METHODS if not hasattr(transformers.Trainer, name)]
        if missing:
            raise RuntimeError(
                f"FusedOptTrainer does not support transformers {transformers.__version__}: its Trainer has no "
                f"{', '.join(missing)}, so it would clip and log gradient norms on its own"
            )
        if "optimizer_cls_and_kwargs" in kwargs and "optimizer_cls_and_kwargs" not in _init_parameters(super()):
            # a Trainer subclass that does not pass it on (TRL's DPOTrainer, KTOTrainer, GRPOTrainer...)
            optimizer_cls_and_kwargs = kwargs.pop("optimizer_cls_and_kwargs")
            super().__init__(*args, **kwargs)
            if optimizer_cls_and_kwargs is not None and self.optimizer is not None:
                raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` is incompatible.")
            self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        else:
            super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            if self.optimizer_cls_and_kwargs is None:
                raise ValueError(
                    "FusedOptTrainer needs its optimizer: pass optimizer_cls_and_kwargs=(fusedopt.AdamW, "
                    "dict(fused=True, ...)) or optimizers=(optimizer, scheduler)"
                )
            cls, kwargs = self.optimizer_cls_and_kwargs
            if isinstance(cls, type) and issubclass(cls, FusedOptimizer):
                self.optimizer_cls_and_kwargs = cls, optimizer_kwargs(cls, kwargs, self.args)
        optimizer = super().create_optimizer(model)
        opt = check_optimizer(optimizer, self.args)
        check_fsdp2_accumulation(opt, self.accelerator, self.args)
        hand_over_scaler(opt, getattr(self.accelerator, "scaler", None))
        return optimizer

    def create_scheduler(self, *args, **kwargs):
        # called right after accelerate's prepare(), which may have put sharded parameters (FSDP2) in
        # place of the optimizer's: take them over now, so that the first backward already releases
        opt = fused_optimizer(self.optimizer)
        if opt is not None:
            opt.sync_groups()
        return super().create_scheduler(*args, **kwargs)

    def _clip_grad_norm(self, model):
        return None  # the optimizer clips (max_grad_norm), in step() or inside backward

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # no pass over the gradients: the optimizer's norm is logged instead

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        opt = fused_optimizer(self.optimizer)
        return super()._maybe_log_save_evaluate(tr_loss, opt.grad_norm if opt is not None else None, *args, **kwargs)


class FusedOptTrainer(FusedOptTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` driving a fusedopt optimizer (see ``fusedopt.integrations.huggingface``)."""
