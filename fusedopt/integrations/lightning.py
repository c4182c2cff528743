"""Lightning (``lightning.pytorch.Trainer``) with a fusedopt optimizer (needs ``lightning``).

``FusedOptCallback`` is a callback: ``Trainer(callbacks=[FusedOptCallback()], gradient_clip_val=1.0,
accumulate_grad_batches=4, ...)`` with a fusedopt optimizer from ``configure_optimizers`` (``fused=True``
or ``False``, any precision). When fitting starts, after the optimizers are built and before a
checkpoint's state is loaded into them, it:

* **hands clipping to the optimizer.** ``gradient_clip_val`` (by norm) becomes the optimizer's
  ``max_grad_norm``, and Lightning's own clipping of that optimizer does nothing: with ``fused=True``
  the gradients are gone by then (torch's ``clip_grad_norm_`` would clip nothing), with ``fused=False``
  it would clip twice, and under ``bf16-mixed``/``16-mixed`` Lightning refuses to clip an optimizer that
  unscales in its ``step()``. The optimizer clips unscaled gradients, ``16-mixed`` included.
* **hands accumulation to the optimizer** (``fused=True``): ``accumulate_grad_batches`` becomes its
  ``accumulation_steps`` (and follows a ``GradientAccumulationScheduler``); Lightning's short last
  window of an epoch is stepped as usual.
* **hands the loss scaler to the optimizer** (``16-mixed``, ``fused=True``): the precision plugin's
  ``GradScaler`` becomes its ``grad_scaler``, so each released gradient is unscaled inside backward.
* **logs** the optimizer's ``grad_norm`` (the step's global norm before clipping, a device tensor:
  no host synchronisation until a logger reads it) as ``grad_norm`` after each optimizer step, through
  ``LightningModule.log``; with several fusedopt optimizers as ``grad_norm_<i>`` (``i``: its index in
  ``trainer.optimizers``). An optimizer that does not clip has no norm, and nothing is logged for it.

What cannot work as asked is refused when fitting starts, before any step, naming the fix: no fusedopt
optimizer; an optimizer ``max_grad_norm`` other than ``gradient_clip_val``; ``accumulation_steps`` other than
``accumulate_grad_batches`` (``fused=True``, automatic optimization: under manual optimization the module
accumulates, and ``accumulation_steps`` is left as it was set); ``gradient_clip_algorithm="value"`` with
``fused=True`` or ``16-mixed`` (the gradients are released or still scaled when Lightning would clip; with
``fused=False`` otherwise, Lightning clips by value as usual); an overridden ``configure_gradient_clipping``
with ``fused=True`` (it runs after backward, when the gradients are gone); a ``grad_scaler`` that is not the
Trainer's. A ``clip_gradients`` call of your own (manual optimization) with a norm other than the optimizer's
``max_grad_norm`` raises when it is made. Without the callback, a releasing optimizer refuses at its first
backward what the Trainer would do to released gradients (``check_release_window``). Checkpoints are
Lightning's own; it loads the optimizer's ``state_dict()`` after these hand-overs, so a resumed optimizer
keeps its clipping history. A resumed fit marks its restored step as saved for each
``ModelCheckpoint(every_n_train_steps=...)``: Lightning does not keep the step such a callback saved last, so
it would save the step it resumed from again at the end of the first batch, inside an accumulation window,
where a ``fused=True`` optimizer's ``state_dict()`` refuses (the window's gradients would be lost) and any
other would overwrite that checkpoint with one that loses them.
"""

from __future__ import annotations

import weakref

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden

from fusedopt.integrations.frames import running_owners
from fusedopt.optimizer import FusedOptimizer, check_number


def fused_optimizer(optimizer) -> FusedOptimizer | None:
    """The fusedopt optimizer inside ``optimizer`` (a ``LightningOptimizer`` wraps it), or None."""
    while optimizer is not None and not isinstance(optimizer, FusedOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def hand_over_clipping(opt: FusedOptimizer, max_grad_norm: float) -> None:
    """Make ``opt``, built without clipping, clip at ``max_grad_norm`` as if it had been built so."""
    opt.max_grad_norm = float(max_grad_norm)  # (clipping under release starts with its own history)


class FusedOptCallback(Callback):
    """Clipping, accumulation, fp16 loss scaling and grad-norm logging through fusedopt optimizers
    (see ``fusedopt.integrations.lightning``). ``log_name``: the name ``grad_norm`` is logged under
    (None: not logged)."""

    def __init__(self, log_name: str | None = "grad_norm"):
        self.log_name = log_name
        self._optimizers: list[FusedOptimizer] = []
        self._handles: list = []
        self._plugin = None

    # --- fit start: checks, then hand-overs ----------------------------------------------------

    def on_fit_start(self, trainer, pl_module) -> None:
        found = [(i, fused_optimizer(o)) for i, o in enumerate(trainer.optimizers)]
        found = [(i, opt) for i, opt in found if opt is not None]
        if not found:
            names = ", ".join(type(o).__name__ for o in trainer.optimizers) or "none"
            raise TypeError(
                f"FusedOptCallback drives fusedopt optimizers, but configure_optimizers gave {names}: return a "
                "fusedopt optimizer (fusedopt.AdamW(..., fused=True)), or remove the callback"
            )
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        clip_val = trainer.gradient_clip_val or 0.0
        by_value = trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE
        if clip_val > 0 and not by_value:
            check_number("gradient_clip_val", clip_val)  # a max_grad_norm: finite
        for _, opt in found:  # everything is checked before anything changes
            self._check(trainer, pl_module, opt, scaler, clip_val, by_value)
        for _, opt in found:
            if clip_val > 0 and not by_value and opt.max_grad_norm is None:
                hand_over_clipping(opt, clip_val)
            if opt.fused and scaler is not None:
                opt.grad_scaler = scaler
        self._install(trainer, plugin, found)
        self._optimizers = [opt for _, opt in found]

    def _check(self, trainer, pl_module, opt: FusedOptimizer, scaler, clip_val: float, by_value: bool) -> None:
        name = type(opt).__name__
        if clip_val > 0 and by_value:
            if opt.fused:
                raise ValueError(
                    f"Trainer(gradient_clip_algorithm='value') cannot clip a fused=True fusedopt.{name}: gradient "
                    "release updates each parameter inside backward and frees its gradient, before Lightning clips. "
                    "Clip by norm through the optimizer (gradient_clip_algorithm='norm', the default), or use "
                    "fused=False"
                )
            if scaler is not None:
                raise ValueError(
                    f"Trainer(gradient_clip_algorithm='value') with a loss scaler (precision='16-mixed') cannot clip "
                    f"fusedopt.{name}: it unscales the gradients in its step(), after Lightning would clip them by "
                    "value. Clip by norm (gradient_clip_algorithm='norm'): the optimizer clips unscaled gradients"
                )
        elif clip_val > 0 and opt.max_grad_norm is not None and opt.max_grad_norm != clip_val:
            raise ValueError(
                f"fusedopt.{name}(max_grad_norm={opt.max_grad_norm}) differs from Trainer(gradient_clip_val="
                f"{trainer.gradient_clip_val}): FusedOptCallback clips through the optimizer. Set only one of them "
                "(leave max_grad_norm unset and the callback hands gradient_clip_val over), or make them equal"
            )
        manual = not pl_module.automatic_optimization  # its accumulation is the module's own, with the optimizer's
        if opt.fused and not manual and opt.accumulation_steps not in (1, trainer.accumulate_grad_batches):
            raise ValueError(
                f"fusedopt.{name}(fused=True, accumulation_steps={opt.accumulation_steps}) differs from "
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): gradient release updates on "
                "the last backward of each accumulation window, so the two must be equal. Leave accumulation_steps "
                "unset (FusedOptCallback hands accumulate_grad_batches over), or make them equal"
            )
        if opt.fused and pl_module.automatic_optimization and is_overridden("configure_gradient_clipping", pl_module):
            raise ValueError(
                f"{type(pl_module).__name__} overrides configure_gradient_clipping, which Lightning calls after "
                f"backward, when a fused=True fusedopt.{name} has already updated the parameters and freed their "
                "gradients: it can neither see nor clip them. Remove the override and clip by norm through the "
                "optimizer (Trainer(gradient_clip_val=...) or max_grad_norm), or use fused=False"
            )
        if opt.fused and opt.grad_scaler is not None and opt.grad_scaler is not scaler:
            raise ValueError(
                f"fusedopt.{name}'s grad_scaler is not the GradScaler Lightning scales the loss with "
                f"({'none: precision=' + repr(trainer.precision) if scaler is None else 'another one'}): leave "
                "grad_scaler unset, FusedOptCallback hands the precision plugin's over"
            )

    def _install(self, trainer, plugin, found) -> None:
        """Lightning's clipping of the fusedopt optimizers, and the grad-norm logging after each step."""
        self._remove()
        original = plugin.clip_gradients

        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM):
            opt = fused_optimizer(optimizer)
            if opt is None or not clip_val or clip_val <= 0:
                return original(optimizer, clip_val, gradient_clip_algorithm)
            if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
                if opt.fused or getattr(plugin, "scaler", None) is not None:
                    raise RuntimeError(
                        "FusedOptCallback: clipping by value cannot reach the gradients of a fused=True fusedopt "
                        "optimizer (released in backward) nor unscaled ones under a loss scaler: clip by norm"
                    )
                return plugin.clip_grad_by_value(optimizer, clip_val)  # Lightning's own, on unscaled gradients
            if opt.max_grad_norm != clip_val:
                raise RuntimeError(
                    f"FusedOptCallback: clip_gradients(gradient_clip_val={clip_val}) asks for a norm other than the "
                    f"optimizer's max_grad_norm={opt.max_grad_norm}, which is what clips it: make them equal"
                )
            return None  # the optimizer clips: inside backward (fused=True) or in its step()

        plugin.clip_gradients = clip_gradients
        self._plugin = plugin
        if self.log_name is not None:
            for i, opt in found:
                name = self.log_name if len(found) == 1 else f"{self.log_name}_{i}"
                self._handles.append(opt.register_step_post_hook(_grad_norm_logger(trainer, name)))

    # --- during fit -----------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        """After a checkpoint is restored: its step counts as saved by every ModelCheckpoint that saves
        every n steps (their last saved step is not in Lightning's checkpoint), so none saves it again at
        the end of the first batch, inside an accumulation window."""
        step = trainer.global_step
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint) or callback._every_n_train_steps < 1:
                continue
            if step % callback._every_n_train_steps == 0 and callback._last_global_step_saved < step:
                callback._last_global_step_saved = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """accumulate_grad_batches becomes the releasing optimizers' accumulation_steps before each batch's
        backward: a GradientAccumulationScheduler changes it when an epoch starts, after a step."""
        if not pl_module.automatic_optimization:
            return
        k = trainer.accumulate_grad_batches
        for opt in self._optimizers:
            if opt.fused and opt.accumulation_steps != k:
                opt.accumulation_steps = k

    # --- fit end --------------------------------------------------------------------------------

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._plugin is not None:
            self._plugin.__dict__.pop("clip_gradients", None)
            self._plugin = None
        self._optimizers = []


# --- without the callback: what the Trainer would do to released gradients, refused -------------------

_SEEN: weakref.WeakSet = weakref.WeakSet()  # releasing optimizers checked at their first backward
_TRAINER_FRAMES = ("_run_stage", "_run", "_fit_impl")  # Trainer methods on the stack while it fits


def check_release_window(optimizer: FusedOptimizer, p, n: int) -> None:
    """Called by gradient release at the first hook of each backward pass, before anything of the pass is
    updated (``fusedopt.release.FRAMEWORK_CHECKS``). At a releasing optimizer's first backward under a
    Lightning Trainer without ``FusedOptCallback``, refuses what the Trainer would do to gradients
    release has freed: clip them (``gradient_clip_val``), accumulate a window other than the
    optimizer's, unscale them with a scaler the optimizer was not given. Then a set lookup per pass."""
    if optimizer in _SEEN:
        return
    trainer = _running_trainer()
    if trainer is not None and not any(isinstance(c, FusedOptCallback) for c in trainer.callbacks):
        problem = _problem_without_callback(trainer, optimizer)
        if problem is not None:
            raise ValueError(
                f"{problem}. Add fusedopt.integrations.lightning.FusedOptCallback() to Trainer(callbacks=[...]): "
                "it hands clipping, accumulation and the loss scaler to the optimizer"
            )
    _SEEN.add(optimizer)


def _problem_without_callback(trainer, opt: FusedOptimizer) -> str | None:
    name = f"a fused=True fusedopt.{type(opt).__name__}"
    clip = trainer.gradient_clip_val
    if clip is not None and clip > 0:
        return (
            f"Trainer(gradient_clip_val={clip}) cannot clip {name} by itself: gradient release updates each "
            "parameter inside backward and frees its gradient, before Lightning would clip (it would clip nothing)"
        )
    module = trainer.lightning_module
    k = trainer.accumulate_grad_batches
    if module is not None and module.automatic_optimization and k != opt.accumulation_steps:
        return (
            f"Trainer(accumulate_grad_batches={k}) with {name}(accumulation_steps={opt.accumulation_steps}): "
            "release would update on other backward passes than Lightning's window ends, from part of its gradient"
        )
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and opt.grad_scaler is not scaler:
        return (
            f"Trainer(precision={trainer.precision!r}) scales the loss with a GradScaler that {name} was not "
            "given: release would update from scaled gradients"
        )
    return None


def _running_trainer() -> Trainer | None:
    """The Lightning Trainer fitting now (``frames.running_owners``), or None."""
    return next((owner for owner in running_owners(_TRAINER_FRAMES) if isinstance(owner, Trainer)), None)


def _grad_norm_logger(trainer, name: str):
    def log_grad_norm(optimizer, args, kwargs) -> None:
        norm = optimizer.grad_norm
        if norm is not None:
            trainer.lightning_module.log(name, norm, on_step=True, on_epoch=False)

    return log_grad_norm
