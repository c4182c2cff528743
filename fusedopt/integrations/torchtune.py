"""torchtune's single-device full fine-tuning recipe with a releasing fusedopt optimizer (needs ``torchtune``).

torchtune's ``full_finetune_single_device`` recipe backpropagates each micro-batch's loss times its
number of target tokens (the sum over tokens) and, before ``optimizer.step()``, multiplies the
gradients by ``1 / num_tokens`` of the whole accumulation window (``training.scale_grads``), then
clips them (``clip_grad_norm``). Under gradient release (``fused=True``) every parameter has been
updated inside the window's last backward and its gradient freed by then: ``scale_grads`` finds
nothing, and every update and the optimizer's clipping use gradients ``num_tokens`` times too large.
So a ``fused=True`` fusedopt optimizer built by torchtune's config for a recipe that does not say it
normalises through the optimizer is refused (``fusedopt.optimizer.check_release_normalisation``).

``FullFinetuneRecipeSingleDevice`` here is torchtune's recipe with one addition: before each backward
it counts the micro-batch's target tokens as the recipe does and sets the optimizer's
``grad_multiplier`` to ``1 / num_tokens`` of the window so far. The update runs in the window's last
backward, when that is the whole window's count, and multiplies each gradient by exactly the factor
``scale_grads`` would have used, before clipping: ``fused=True`` gives, bit for bit, what the stock
recipe gives with ``fused=False`` (fp32 weights; bf16 gradients accumulated over micro-batches
differ by their rounding, docs/semantics.md). Besides:

* ``gradient_accumulation_steps`` becomes the optimizer's ``accumulation_steps`` (a different one is
  refused: the optimizer would update on other backward passes than the recipe steps on);
* clip through the optimizer (``max_grad_norm`` in the optimizer's config); the recipe's
  ``clip_grad_norm`` is refused with ``fused=True`` (it would clip absent gradients); the logged
  ``grad_norm`` is the optimizer's (the window's global norm before clipping);
* ``optimizer_in_bwd: True`` with ``fused=True`` is refused: release already is an optimizer step in
  backward, with accumulation and clipping. (torchtune's own optimizer-in-backward updates from the
  unnormalised gradients, whatever the optimizer; with ``fused=False`` fusedopt optimizers it works as
  torchtune's, and each one-parameter optimizer built without a ``seed`` draws its own stochastic
  rounding stream, ``fusedopt.rng.DefaultSeeds``.)

A ``fused=False`` optimizer, or a torch one, runs exactly as in torchtune's recipe. Checkpoints and
``resume_from_checkpoint`` are the recipe's: the optimizer's ``state_dict()`` resumes it exactly.
Run it as torchtune runs a custom recipe::

    tune run fusedopt/integrations/torchtune.py --config my_config.yaml   # from a checkout
    python -m fusedopt.integrations.torchtune --config my_config.yaml     # anywhere

with ``optimizer: {_component_: fusedopt.AdamW, fused: True, max_grad_norm: 1.0, lr: 2e-5}`` in the
config. The recipe file is loaded from torchtune's installation (torchtune ships its recipes as files,
not as an importable package).
"""

from __future__ import annotations

import importlib.util
import sys
import weakref
from pathlib import Path

import torch
import torchtune
from omegaconf import DictConfig, OmegaConf
from torchtune import config
from torchtune.config._utils import _get_component_from_path

from fusedopt.optimizer import FusedOptimizer

_RECIPE_FILE = "full_finetune_single_device.py"


def _load_recipe_module(file_name: str):
    """torchtune's recipe file ``file_name`` as a module (its ``recipes/`` folder is not a package)."""
    name = "_fusedopt_torchtune_" + file_name.removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    path = Path(torchtune.__file__).resolve().parent.parent / "recipes" / file_name
    if not path.is_file():
        raise ImportError(
            f"torchtune's recipe {file_name} is not at {path}: fusedopt.integrations.torchtune needs torchtune "
            "installed with its recipes (pip install 'torchtune>=0.6.1,<0.7')"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_stock = _load_recipe_module(_RECIPE_FILE)
StockFullFinetuneRecipeSingleDevice = _stock.FullFinetuneRecipeSingleDevice


def releasing_optimizer(optimizer) -> FusedOptimizer | None:
    """``optimizer`` if it is a fusedopt optimizer with gradient release (``fused=True``), else None."""
    return optimizer if isinstance(optimizer, FusedOptimizer) and optimizer.fused else None


class _LogsGradNorm:
    """The recipe's metric logger, adding the optimizer's ``grad_norm`` to every logged step (the
    recipe logs its own only when it clips, which it may not under release)."""

    def __init__(self, logger, optimizer: FusedOptimizer):
        self._logger = logger
        self._optimizer = weakref.ref(optimizer)

    def log_dict(self, payload, step: int) -> None:
        optimizer = self._optimizer()
        norm = None if optimizer is None else optimizer.grad_norm
        if norm is not None and "grad_norm" not in payload:
            payload = {**payload, "grad_norm": norm.detach().clone()}
        self._logger.log_dict(payload, step=step)

    def __getattr__(self, name):
        return getattr(self._logger, name)


class FullFinetuneRecipeSingleDevice(StockFullFinetuneRecipeSingleDevice):
    """torchtune's ``FullFinetuneRecipeSingleDevice`` that normalises released gradients (module docstring)."""

    # fusedopt refuses a releasing optimizer that torchtune builds for a recipe normalising gradients
    # after backward (fusedopt.optimizer.NORMALISES_RELEASED_GRADS): this one tells the optimizer instead
    fusedopt_normalises_released_grads = True

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self._release_optimizer: FusedOptimizer | None = None
        self._window_tokens = 0  # target tokens of the accumulation window so far (the recipe's num_tokens)

    def _setup_optimizer(self, cfg_optimizer: DictConfig, optimizer_in_bwd: bool = False, opt_state_dict=None):
        steps = self._gradient_accumulation_steps
        if cfg_optimizer.get("fused", False) and "accumulation_steps" not in cfg_optimizer and not optimizer_in_bwd:
            component = _get_component_from_path(cfg_optimizer["_component_"])
            if isinstance(component, type) and issubclass(component, FusedOptimizer):
                cfg_optimizer = OmegaConf.merge(cfg_optimizer, {"accumulation_steps": steps})
        optimizer = super()._setup_optimizer(cfg_optimizer, optimizer_in_bwd, opt_state_dict)
        if optimizer_in_bwd:
            if any(releasing_optimizer(o) for o in self._optim_ckpt_wrapper.optim_map.values()):
                raise ValueError(
                    "optimizer_in_bwd: True with a fused=True fusedopt optimizer: gradient release already "
                    "updates each parameter inside backward (with accumulation and clipping). Set "
                    "optimizer_in_bwd: False and keep fused: True"
                )
            return optimizer
        released = releasing_optimizer(optimizer)
        if released is None:
            return optimizer
        if released.accumulation_steps != steps:
            raise ValueError(
                f"the optimizer's accumulation_steps={released.accumulation_steps} differs from the recipe's "
                f"gradient_accumulation_steps={steps}: with fused=True the optimizer updates on every "
                "accumulation_steps-th backward, the recipe steps on every gradient_accumulation_steps-th. "
                "Leave accumulation_steps out of the optimizer's config (the recipe sets it) or make them equal"
            )
        if self._clip_grad_norm is not None:
            raise ValueError(
                f"clip_grad_norm: {self._clip_grad_norm} with a fused=True optimizer: the recipe clips after "
                "backward, when gradient release has freed every gradient (it would clip nothing and log a norm "
                "of 0). Set clip_grad_norm: null and give the optimizer max_grad_norm (in its config)"
            )
        self._release_optimizer = released
        recipe = weakref.ref(self)  # the optimizer keeps its hooks: no cycle through them

        def new_window(*_):
            owner = recipe()
            if owner is not None:
                owner._window_tokens = 0  # where the recipe resets num_tokens, after its step()

        released.register_step_post_hook(new_window)
        return optimizer

    def setup(self, cfg: DictConfig) -> None:
        super().setup(cfg)
        released = self._release_optimizer
        if released is not None and released.max_grad_norm is not None:
            self._metric_logger = _LogsGradNorm(self._metric_logger, released)

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        released = self._release_optimizer
        if released is not None:
            # as train() counts them just before: the window's count is complete at its last backward,
            # the one whose release updates; the factor is training.scale_grads's 1 / num_tokens
            tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
            self._window_tokens = self._window_tokens + tokens
            released.grad_multiplier = 1 / self._window_tokens
        return super()._loss_step(batch)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point, as torchtune's recipe's (``--config`` and key=value overrides)."""
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice (fusedopt)", cfg=cfg)
    recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
