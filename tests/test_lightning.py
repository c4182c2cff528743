"""fusedopt under Lightning's ``Trainer`` with ``fusedopt.integrations.lightning.FusedOptCallback`` (issue 41),
on a tiny fp32 MLP and seeded random data (5 batches an epoch: with ``accumulate_grad_batches=2`` each epoch
ends on Lightning's short window of one batch).

* ``fused=True`` with Lightning's accumulation and ``gradient_clip_val``: the Trainer's settings become the
  optimizer's; while nothing clips it equals ``fused=False`` bit for bit, and a small clip value changes the
  weights; a ``GradientAccumulationScheduler`` is followed. Without the callback the Trainer clips nothing
  (the issue).
* ``fused=False`` clipping through the callback equals Lightning's own clipping (torch's ``clip_grad_norm_``)
  of an unclipped fusedopt optimizer, bit for bit; clipping by value stays Lightning's.
* ``bf16-mixed`` and ``16-mixed`` clip through the optimizer without Lightning's error, in both modes; under
  ``16-mixed`` the precision plugin's scaler is handed to a releasing optimizer.
* The logged ``grad_norm`` is the optimizer's ``grad_norm`` after each step.
* What cannot work is refused when fitting starts, before any training step, naming the fix.
"""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt import release_notices  # noqa: E402
from fusedopt.integrations.lightning import FusedOptCallback  # noqa: E402

# Lightning's own deprecation notice on every fit, not ours
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

BIG = 1e6  # a gradient_clip_val that never clips (the gradient norms here are about 0.5-0.9)
SMALL = 0.1  # one that clips every step


class Net(L.LightningModule):
    """A small fp32 MLP; records the optimizer's grad_norm after each of its steps."""

    def __init__(self, opt_cls=fusedopt.AdamW, **opt_kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.opt_cls, self.opt_kwargs = opt_cls, opt_kwargs
        self.norms: list = []
        self.batches = 0  # training steps run

    def training_step(self, batch, batch_idx):
        self.batches += 1
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        self.opt = self.opt_cls(self.net.parameters(), lr=1e-2, **self.opt_kwargs)
        self.opt.register_step_post_hook(lambda opt, args, kwargs: self.norms.append(_copy(opt.grad_norm)))
        return self.opt


def _copy(norm):
    return None if norm is None else norm.detach().clone()


class ClipsItself(Net):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class Manual(Net):
    """Manual optimization that clips through LightningModule.clip_gradients at ``clip``."""

    def __init__(self, clip, **opt_kwargs):
        super().__init__(**opt_kwargs)
        self.automatic_optimization = False
        self.clip = clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()


def loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(20, 8, generator=g), torch.randn(20, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def fit(module: Net, callback: bool = True, callbacks=(), **kwargs):
    kwargs.setdefault("max_steps", 6)
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=([FusedOptCallback()] if callback else []) + list(callbacks),
        **kwargs,
    )
    trainer.fit(module, loader())
    return trainer


def weights(module: Net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def assert_equal(a: Net, b: Net) -> None:
    for p, q in zip(weights(a), weights(b), strict=True):
        assert torch.equal(p, q), (p - q).abs().max()


def differs(a: Net, b: Net) -> bool:
    return any(not torch.equal(p, q) for p, q in zip(weights(a), weights(b), strict=True))


def fp16_mixed():
    return MixedPrecision("16-mixed", "cpu")  # Trainer(precision="16-mixed") falls back to bf16 on a CPU


def test_fused_accumulation_and_clipping():
    """The issue's setup: fused=True, accumulate_grad_batches=2, gradient_clip_val."""
    common = dict(accumulate_grad_batches=2)
    fused = Net(fused=True)
    trainer = fit(fused, gradient_clip_val=BIG, **common)
    assert trainer.global_step == 6 and fused.batches == 10  # 3 steps an epoch: 2 + 2 + 1 batches
    assert fused.opt.accumulation_steps == 2 and fused.opt.max_grad_norm == BIG
    plain = Net(fused=False)
    fit(plain, gradient_clip_val=BIG, **common)
    assert plain.opt.max_grad_norm == BIG
    assert_equal(fused, plain)  # nothing clipped: release and step() agree bit for bit, short windows too

    clipped = Net(fused=True)
    trainer = fit(clipped, gradient_clip_val=SMALL, **common)
    assert len(clipped.norms) == 6 and all(n > SMALL for n in clipped.norms)  # every step clipped
    assert differs(clipped, fused)
    # the callback is gone after fit: Lightning's clipping and the optimizer's step hooks are their own again
    assert "clip_gradients" not in vars(trainer.precision_plugin)
    assert len(clipped.opt._optimizer_step_post_hooks) == 1  # the test's own


def test_without_the_callback_nothing_is_clipped():
    """The issue: Lightning clips after backward, when release has freed every gradient."""
    silent = Net(fused=True, max_grad_norm=None)
    fit(silent, callback=False, gradient_clip_val=SMALL)
    unclipped = Net(fused=True, max_grad_norm=None)
    fit(unclipped, callback=False)
    assert_equal(silent, unclipped)
    clipped = Net(fused=True)
    fit(clipped, gradient_clip_val=SMALL)
    assert differs(clipped, unclipped)


def test_accumulation_schedule_is_followed():
    """GradientAccumulationScheduler: 1 batch a step in epoch 0, 2 from epoch 1 on."""
    common = dict(max_steps=8, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})], gradient_clip_val=BIG)
    fused = Net(fused=True)
    fit(fused, **common)
    assert fused.batches == 10 and fused.opt.accumulation_steps == 2
    plain = Net(fused=False)
    fit(plain, **common)
    assert_equal(fused, plain)


def test_unfused_clipping_equals_lightnings():
    """fused=False: the optimizer's clipping equals Lightning's clip_grad_norm_ of an unclipped optimizer."""
    ours = Net(fused=False)
    fit(ours, gradient_clip_val=SMALL, accumulate_grad_batches=2)
    assert all(n > SMALL for n in ours.norms)
    lightnings = Net(fused=False, max_grad_norm=None)
    fit(lightnings, callback=False, gradient_clip_val=SMALL, accumulate_grad_batches=2)
    assert all(n is None for n in lightnings.norms)  # the optimizer itself did not clip
    assert_equal(ours, lightnings)


def test_unfused_value_clipping_stays_lightnings():
    common = dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")
    ours = Net(fused=False, max_grad_norm=None)
    fit(ours, **common)
    lightnings = Net(fused=False, max_grad_norm=None)
    fit(lightnings, callback=False, **common)
    assert_equal(ours, lightnings)
    unclipped = Net(fused=False, max_grad_norm=None)
    fit(unclipped)
    assert differs(ours, unclipped)
    fit(Net(fused=False, max_grad_norm=None), precision="bf16-mixed", **common)  # Lightning alone raises here


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision(precision):
    """Lightning refuses to clip an optimizer that unscales in step() (fusedopt's, also with fused=False);
    through the callback both modes clip, and fused=True takes 16-mixed's scaler."""
    kwargs = dict(plugins=[fp16_mixed()]) if precision == "16-mixed" else dict(precision=precision)
    runs = {}
    for fused in (True, False):
        for clip in (BIG, SMALL):
            module = Net(fused=fused)
            trainer = fit(module, gradient_clip_val=clip, accumulate_grad_batches=2, **kwargs)
            assert module.opt.max_grad_norm == clip and len(module.norms) == 6
            assert all(torch.isfinite(n) for n in module.norms)
            if clip == SMALL:
                assert all(n > SMALL for n in module.norms)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            assert (scaler is not None) == (precision == "16-mixed")
            assert module.opt.grad_scaler is (scaler if fused else None)
            runs[fused, clip] = module
    assert_equal(runs[True, BIG], runs[False, BIG])  # unscaled inside backward as step() unscales
    assert differs(runs[True, SMALL], runs[True, BIG])


def test_logged_grad_norm_is_the_optimizers(tmp_path):
    module = Net(fused=True)
    fit(module, gradient_clip_val=SMALL, accumulate_grad_batches=2, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("grad_norm")]
    assert [int(row["step"]) for row in rows] == list(range(6))
    assert [float(row["grad_norm"]) for row in rows] == [n.item() for n in module.norms]

    quiet = Net(fused=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FusedOptCallback(log_name=None)],
        gradient_clip_val=SMALL,
    )
    trainer.fit(quiet, loader())
    assert "grad_norm" not in trainer.callback_metrics and len(quiet.norms) == 2


def test_manual_optimization():
    module = Manual(SMALL, fused=True, max_grad_norm=SMALL)
    trainer = fit(module)
    assert trainer.callback_metrics["grad_norm"] == module.norms[-1] > SMALL
    module = Manual(0.5, fused=True, max_grad_norm=SMALL)
    with pytest.raises(RuntimeError, match=r"clip_gradients\(gradient_clip_val=0.5\).*max_grad_norm=0.1"):
        fit(module)


REFUSED = {
    "value clipping, fused=True": (
        dict(fused=True),
        dict(gradient_clip_val=SMALL, gradient_clip_algorithm="value"),
        r"gradient_clip_algorithm='value'\) cannot clip a fused=True .*gradient_clip_algorithm='norm'",
    ),
    "value clipping, 16-mixed": (
        dict(fused=False),
        dict(gradient_clip_val=SMALL, gradient_clip_algorithm="value", plugins=[fp16_mixed()]),
        r"gradient_clip_algorithm='value'\) with a loss scaler .*Clip by norm",
    ),
    "max_grad_norm": (
        dict(fused=False, max_grad_norm=0.5),
        dict(gradient_clip_val=SMALL),
        r"max_grad_norm=0.5\) differs from Trainer\(gradient_clip_val=0.1\)",
    ),
    "infinite gradient_clip_val": (dict(fused=True), dict(gradient_clip_val=float("inf")), r"gradient_clip_val: inf"),
    "accumulation_steps": (
        dict(fused=True, accumulation_steps=3),
        dict(accumulate_grad_batches=2),
        r"accumulation_steps=3\) differs from Trainer\(accumulate_grad_batches=2\)",
    ),
    "grad_scaler": (
        dict(fused=True, grad_scaler=torch.amp.GradScaler("cpu")),
        dict(precision="bf16-mixed"),
        r"grad_scaler is not the GradScaler Lightning scales the loss with \(none: precision='bf16-mixed'\)",
    ),
    "torch.optim": (
        dict(opt_cls=torch.optim.AdamW),
        dict(gradient_clip_val=SMALL),
        r"FusedOptCallback drives fusedopt optimizers, but configure_optimizers gave AdamW",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_at_fit_start(case):
    opt_kwargs, trainer_kwargs, message = REFUSED[case]
    module = Net(**opt_kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        fit(module, **trainer_kwargs)
    assert module.batches == 0


def test_refused_clipping_override():
    module = ClipsItself(fused=True)
    with pytest.raises(ValueError, match="ClipsItself overrides configure_gradient_clipping"):
        fit(module, gradient_clip_val=SMALL)
    assert module.batches == 0
    fit(ClipsItself(fused=False), gradient_clip_val=SMALL)  # fused=False: the override sees the gradients


def test_release_warning_names_the_callback(monkeypatch):
    monkeypatch.setattr(release_notices, "_release_warned", False)
    with pytest.warns(UserWarning, match="fusedopt.integrations.lightning.FusedOptCallback"):
        fusedopt.AdamW([torch.nn.Parameter(torch.zeros(4))], fused=True)


def test_importing_fusedopt_does_not_import_lightning():
    code = "import sys, fusedopt, fusedopt.integrations; assert 'lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
