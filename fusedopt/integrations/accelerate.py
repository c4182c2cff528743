"""accelerate (``accelerate.Accelerator``) with a fusedopt optimizer (needs ``accelerate``).

``setup(accelerator, optimizer)``, once, after ``accelerator.prepare(...)`` (or before it), makes an
``Accelerator`` loop drive a fusedopt optimizer as it drives a torch one:

* **accumulation** (``fused=True``): ``Accelerator(gradient_accumulation_steps=N)`` becomes the optimizer's
  ``accumulation_steps`` (an optimizer built with another number than 1 or N is refused), so the
  releasing optimizer updates on the backward where ``accelerator.sync_gradients`` is True;
* **fp16** (``fused=True``): the accelerator's ``GradScaler`` becomes the optimizer's ``grad_scaler``
  (each released gradient is unscaled inside backward);
* **clipping**: ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` over the optimizer's
  parameters returns the optimizer's ``grad_norm`` (the global norm before clipping) and leaves the
  clipping to the optimizer, which must have been built with ``max_grad_norm=max_norm``
  (``max_norm=inf``, a norm without clipping, needs only some ``max_grad_norm``). Anything else raises,
  naming the fix: after a releasing backward there are no gradients to clip, and with ``fused=False``
  clipping there too would clip twice. ``accelerator.clip_grad_value_`` of a releasing optimizer's
  parameters raises (nothing to clip).

Without ``setup``, gradient release under accelerate is checked at each backward pass (this module's
``check_release_window``, called by ``fusedopt/release.py`` while accelerate is imported, never importing
it). A ``fused=True`` optimizer whose ``accumulation_steps`` differs from the accumulation of what steps it
raises before any parameter changes, naming the framework's setting and the fix: at its first backward
when a Hugging Face Trainer (``gradient_accumulation_steps``) or ``accelerator.backward`` of an
``Accelerator(gradient_accumulation_steps=N > 1)`` runs it, and at any backward in which it would update
while accelerate marks the window as going on (``sync_gradients`` False: ``loss.backward()`` inside
``accelerator.accumulate``). The first backward under ``accelerator.backward`` without ``setup``, or
under a plain Hugging Face Trainer, warns once (their norm passes find no gradients). An accumulation of
1 is never refused (a loop may accumulate on its own, or accelerate's state be left from an earlier loop).
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref

import torch
from accelerate import Accelerator
from accelerate.state import GradientState

from fusedopt.dispatch import total_norm
from fusedopt.integrations.frames import running_owners
from fusedopt.loss_scaling import inverse
from fusedopt.optimizer import FusedOptimizer
from fusedopt.sharding import as_sharded, is_sharded

# optimizers given to setup() -> the accelerator they were set up with
_SET_UP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# optimizers whose first releasing backward was looked at (the once-per-optimizer warnings)
_SEEN: weakref.WeakSet = weakref.WeakSet()
_PLAIN_TRAINER: weakref.WeakSet = weakref.WeakSet()  # optimizers a plain Trainer's clipping was routed to


def fused_optimizer(optimizer) -> FusedOptimizer | None:
    """The fusedopt optimizer inside ``optimizer`` (an ``AcceleratedOptimizer`` wraps it), or None."""
    while optimizer is not None and not isinstance(optimizer, FusedOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def setup(accelerator: Accelerator, optimizer) -> FusedOptimizer:
    """Hand the accelerator's accumulation and fp16 scaler to the fusedopt optimizer inside ``optimizer``
    (as given or as ``accelerator.prepare`` returned it) and route ``accelerator.clip_grad_norm_`` over
    its parameters through it (see the module). Returns the fusedopt optimizer."""
    opt = fused_optimizer(optimizer)
    if opt is None:
        got = type(optimizer).__name__
        raise TypeError(f"setup() takes a fusedopt optimizer (or accelerate's wrapper of one), got {got}")
    steps = accelerator.gradient_accumulation_steps
    if opt.fused and opt.accumulation_steps != steps:
        if opt.accumulation_steps != 1:
            raise ValueError(
                f"the optimizer's accumulation_steps={opt.accumulation_steps} differs from Accelerator("
                f"gradient_accumulation_steps={steps}): with fused=True the optimizer updates inside the backward that "
                f"ends each accumulation window, so the two must be equal; build it with accumulation_steps={steps} "
                "(or leave it unset: setup() takes the accelerator's)"
            )
        if opt.released_since_step():
            raise RuntimeError("setup() changes accumulation_steps: call it before the first backward of a step")
        opt.accumulation_steps = steps
    scaler = getattr(accelerator, "scaler", None)
    if opt.fused and scaler is not None and opt.grad_scaler is not scaler:
        if opt.grad_scaler is not None:
            raise ValueError(
                "the optimizer's grad_scaler is not the GradScaler the accelerator scales the loss with (fp16): leave "
                "grad_scaler unset, setup() hands the accelerator's over"
            )
        opt.grad_scaler = scaler
    _route(accelerator, opt)
    return opt


def _route(accelerator, opt: FusedOptimizer) -> None:
    """``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` of ``opt``'s parameters through ``opt``."""
    _SET_UP[opt] = weakref.ref(accelerator)
    if "clip_grad_norm_" not in vars(accelerator):  # once per accelerator: route its clipping
        accelerator.clip_grad_norm_ = _ClipGradNorm(accelerator, type(accelerator).clip_grad_norm_)
        accelerator.clip_grad_value_ = _ClipGradValue(accelerator, type(accelerator).clip_grad_value_)


def _optimizers_of(accelerator) -> list[FusedOptimizer]:
    return [opt for opt, ref in list(_SET_UP.items()) if ref() is accelerator]


def _owner(accelerator, params: list) -> FusedOptimizer | None:
    """The set-up optimizer holding ``params`` (all its parameters, no other trainable one), or None
    when they belong to none; anything in between is refused."""
    ids = {id(p) for p in params}
    owners = []
    for opt in _optimizers_of(accelerator):
        own = {id(p) for group in opt.param_groups for p in group["params"]}
        if own & ids:
            owners.append((opt, own))
    if not owners:
        return None
    opt, own = owners[0]
    trainable = {id(p) for p in params if p.requires_grad}
    if len(owners) > 1 or not own <= ids or not trainable <= own:
        raise ValueError(
            "accelerator.clip_grad_norm_ over part of a fusedopt optimizer's parameters, or over those of several "
            "optimizers: the optimizer clips by the global norm of all its own parameters (max_grad_norm), so pass "
            "exactly its parameters (model.parameters() of the model it trains)"
        )
    return opt


class _ClipGradNorm:
    """``accelerator.clip_grad_norm_`` after ``setup``: the optimizer's norm and clipping (see the module)."""

    def __init__(self, accelerator, original):
        self._accelerator, self._original = weakref.ref(accelerator), original

    def __call__(self, parameters, max_norm, norm_type=2):
        accelerator = self._accelerator()
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        opt = _owner(accelerator, params)
        if opt is None or (not opt.fused and opt.max_grad_norm is None):  # gradients there, no clipping in step()
            return self._original(accelerator, params, max_norm, norm_type=norm_type)
        max_norm, norm_only = float(max_norm), math.isinf(float(max_norm))
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: a fusedopt optimizer clips by the L2 norm (norm_type=2)")
        if norm_only and opt.max_grad_norm is None and opt in _PLAIN_TRAINER:
            return None  # a plain Trainer's norm for its log, which an optimizer that does not clip never took
        if opt.max_grad_norm is None or not (norm_only or max_norm == opt.max_grad_norm):
            released = "gradient release (fused=True) freed the gradients during backward, so there are none to clip"
            if not opt.fused:
                released = "clipping here and in the optimizer's step() would clip twice"
            fix = "some max_grad_norm" if norm_only else f"max_grad_norm={max_norm}"
            trainer = ""
            if opt in _PLAIN_TRAINER:
                trainer = (
                    " (a plain Hugging Face Trainer clips by TrainingArguments.max_grad_norm: give the optimizer the "
                    "same, or train with FusedOptTrainer / FusedOptSFTTrainer, which hands it over)"
                )
            raise ValueError(
                f"accelerator.clip_grad_norm_(..., max_norm={max_norm}) of a fusedopt optimizer with max_grad_norm="
                f"{opt.max_grad_norm}: {released}. Clip through the optimizer: build it with {fix}; "
                f"accelerator.clip_grad_norm_ then returns its norm (opt.grad_norm){trainer}"
            )
        if opt.fused:
            pending = _pending_norm(opt)  # a window accelerate ended early leaves its update to step()
            return opt.grad_norm if pending is None else pending  # (exact once backward has finished)
        # fused=False: the norm only (max_norm=inf); the optimizer clips in step(), from the same gradients
        return self._original(accelerator, params, math.inf, norm_type=norm_type)


def _pending_norm(opt: FusedOptimizer) -> torch.Tensor | None:
    """The global norm ``step()`` will clip by, where release left this window's update to ``step()``
    (accelerate ended the window before ``accumulation_steps`` backward passes: the last of an epoch), from
    the gradients it will update from (unscaled); None where release updated the window inside backward."""
    tensors = []
    for group in opt.param_groups:
        for p in group["params"]:
            buffer = opt.accumulated_gradient(p)  # bf16/fp16 gradients accumulate here
            if buffer is not None:
                tensors.append(as_sharded(p, buffer) if is_sharded(p) else buffer)
            if p.grad is not None:
                tensors.append(p.grad)
    if not tensors:
        return None
    norm, _ = total_norm(tensors)
    if is_sharded(norm):
        norm = norm.full_tensor()
    scaler = opt.grad_scaler
    if scaler is not None and scaler.is_enabled() and scaler._scale is not None:  # the scale of this window's loss
        norm = norm * inverse(scaler._scale.to(norm.device))
    return norm


class _ClipGradValue:
    """``accelerator.clip_grad_value_`` after ``setup``: refused for a releasing optimizer's parameters."""

    def __init__(self, accelerator, original):
        self._accelerator, self._original = weakref.ref(accelerator), original

    def __call__(self, parameters, clip_value):
        accelerator = self._accelerator()
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        for opt in _optimizers_of(accelerator):
            if opt.fused and any(id(p) in ids for group in opt.param_groups for p in group["params"]):
                raise ValueError(
                    "accelerator.clip_grad_value_ of a fusedopt optimizer with fused=True: gradient release freed the "
                    "gradients during backward, so there are none to clip; clip by norm through the optimizer "
                    "(max_grad_norm), or use fused=False"
                )
        return self._original(accelerator, params, clip_value)


# --- the check gradient release runs at each backward pass while accelerate is imported -----------


def check_release_window(optimizer: FusedOptimizer, p: torch.Tensor, n: int) -> None:
    """Called by gradient release at the first hook of each backward pass (``n``: the backward count
    since ``step()`` it brings to ``p``), before anything of the pass is updated. Refuses a releasing
    optimizer whose ``accumulation_steps`` differs from the accumulation of the framework stepping it: at
    its first backward where a Hugging Face Trainer or an ``Accelerator(gradient_accumulation_steps=N > 1)``
    is seen driving it, and at any backward that would update while accelerate's ``GradientState`` says the
    window goes on (``sync_gradients`` False). At its first backward, routes a plain Trainer's clipping and
    logged norm to the optimizer, and warns once about an ``accelerator.clip_grad_norm_`` without ``setup``
    (it would find no gradients). After the first backward it costs a few dictionary lookups per pass."""
    if n == optimizer.accumulation_steps and GradientState._shared_state.get("sync_gradients", True) is False:
        _refuse_mismatch(optimizer, p, *_drivers(), accumulating=True)
    if optimizer not in _SEEN:
        trainer, accelerator = _drivers()
        _refuse_mismatch(optimizer, p, trainer, accelerator, accumulating=False)
        _SEEN.add(optimizer)
        _route_or_warn(optimizer, trainer, accelerator)


def _drivers() -> tuple[object | None, Accelerator | None]:
    """The Hugging Face Trainer and the Accelerator running a backward pass now (their training step and
    ``Accelerator.backward`` frames, in this thread or another: CUDA runs hooks on a device thread)."""
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    owners = running_owners(("training_step", "_inner_training_loop", "backward"))
    trainer = next((o for o in owners if trainer_cls is not None and isinstance(o, trainer_cls)), None)
    accelerator = next((o for o in owners if isinstance(o, Accelerator)), None)
    return trainer, accelerator


def trainer_fix(trainer) -> str:
    """The fusedopt Trainer to use in place of ``trainer``'s class."""
    cls = type(trainer)
    package = cls.__module__.split(".")[0]
    if package == "trl" and cls.__name__ == "SFTTrainer":
        return "fusedopt.integrations.trl.FusedOptSFTTrainer"
    if package == "transformers" and cls.__name__ == "Trainer":
        return "fusedopt.integrations.huggingface.FusedOptTrainer"
    name = f"{package}.{cls.__name__}" if package in ("trl", "transformers") else cls.__name__
    return f"class MyTrainer(FusedOptTrainerMixin, {name}) (fusedopt.integrations.huggingface.FusedOptTrainerMixin)"


def _refuse_mismatch(optimizer: FusedOptimizer, p: torch.Tensor, trainer, accelerator, *, accumulating: bool):
    """Raise, before this backward updates anything, when the framework stepping ``optimizer`` accumulates
    over another number of backward passes than its ``accumulation_steps``. ``accumulating``: accelerate
    says this backward does not end the window while the optimizer would update in it; then, with no
    framework seen, accelerate's ``num_steps`` says how many. An accumulation of 1 (none configured: a loop
    accumulating on its own, or accelerate's state left over from an earlier loop) is never refused."""
    k = optimizer.accumulation_steps
    if trainer is not None:
        steps = trainer.args.gradient_accumulation_steps
        framework = (
            f"the Hugging Face {type(trainer).__name__} steps the optimizer once every gradient_accumulation_steps="
            f"{steps} backward passes (TrainingArguments)"
        )
        fix = (
            f"(optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True, accumulation_steps={steps}, ...))), or train "
            f"with {trainer_fix(trainer)}, which takes it from the TrainingArguments (and clips and logs grad_norm "
            "through the optimizer)"
        )
    else:
        if accelerator is not None:
            steps = accelerator.gradient_accumulation_steps
        elif accumulating:  # loss.backward() inside accelerator.accumulate
            steps = GradientState._shared_state.get("plugin_kwargs", {}).get("num_steps", 1)
        else:
            return
        if steps == 1:
            return  # no accumulation configured: the loop may accumulate on its own
        framework = (
            f"accelerate steps the optimizer once every Accelerator(gradient_accumulation_steps={steps}) backward "
            "passes (accelerator.accumulate)"
        )
        fix = (
            "or call fusedopt.integrations.accelerate.setup(accelerator, optimizer), which takes it from the "
            "accelerator (and routes accelerator.clip_grad_norm_ and the fp16 scaler through the optimizer)"
        )
    if steps == k:
        return
    now = (
        "would update the parameters inside this backward, which accelerate marks as one that only accumulates "
        "(sync_gradients=False)"
        if accumulating
        else "updates inside the backward that ends each of its own windows"
    )
    p.grad = None  # this pass fails: its gradient must not reach a later step()
    raise RuntimeError(
        f"fusedopt: {framework}, but this fused=True optimizer has accumulation_steps={k}: gradient release {now}, "
        f"so the two must be equal. Pass accumulation_steps={steps} to the optimizer {fix}. Nothing was updated"
    )


def _route_or_warn(optimizer: FusedOptimizer, trainer, accelerator) -> None:
    """Once per releasing optimizer: a plain Hugging Face Trainer, or an Accelerator without ``setup``,
    computes gradient norms after backward, where release left none. A plain Trainer's are routed to the
    optimizer (it calls its accelerator's ``clip_grad_norm_``); an Accelerator of a loop of your own is
    warned about (``setup`` routes it)."""
    if trainer is not None:
        from fusedopt.integrations.huggingface import FusedOptTrainerMixin  # transformers is imported

        if isinstance(trainer, FusedOptTrainerMixin) or _SET_UP.get(optimizer) is not None:
            return
        # a plain Trainer clips and takes the norm it logs through its accelerator's clip_grad_norm_: route it
        # to the optimizer, which returns its own norm, or refuses a threshold it does not clip by
        _PLAIN_TRAINER.add(optimizer)
        _route(trainer.accelerator, optimizer)
    elif accelerator is not None and _SET_UP.get(optimizer) is None:
        warnings.warn(
            "fusedopt: accelerate's Accelerator drives a fused=True optimizer not given to "
            "fusedopt.integrations.accelerate.setup(accelerator, optimizer): accelerator.clip_grad_norm_ after a "
            "releasing backward finds no gradients (it clips nothing and returns 0), and fp16's GradScaler is not "
            "handed over. Call setup() once after accelerator.prepare(...) (shown once per optimizer)",
            UserWarning,
            stacklevel=2,
        )
