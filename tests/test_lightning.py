"""fusedopt under Lightning's ``Trainer`` with ``fusedopt.integrations.lightning.FusedOptCallback`` (issue 41),
on a tiny fp32 MLP and seeded random data (5 batches an epoch: with ``accumulate_grad_batches=2`` each epoch
ends on Lightning's short window of one batch).

* ``fused=True`` with Lightning's accumulation and ``gradient_clip_val``: the Trainer's settings become the
  optimizer's; while nothing clips it equals ``fused=False`` bit for bit, and a small clip value changes the
  weights; a ``GradientAccumulationScheduler`` is followed. Without the callback, what the Trainer would do
  to released gradients (clip, accumulate, unscale) is refused at the first backward.
* ``fused=False`` clipping through the callback equals Lightning's own clipping (torch's ``clip_grad_norm_``)
  of an unclipped fusedopt optimizer, bit for bit; clipping by value stays Lightning's.
* ``bf16-mixed`` and ``16-mixed`` clip through the optimizer without Lightning's error, in both modes; under
  ``16-mixed`` the precision plugin's scaler is handed to a releasing optimizer.
* The logged ``grad_norm`` is the optimizer's ``grad_norm`` after each step.
* What cannot work is refused when fitting starts, before any training step, naming the fix.
* Lightning's ``BatchSizeFinder`` retries after out of memory inside a releasing backward and then trains as
  a run at the batch size it found.

The issue's acceptance, on a tiny Llama (``transformers.LlamaForCausalLM`` from a config) with
``fused=True``, ``accumulate_grad_batches=2`` and ``gradient_clip_val=1.0``:

* under ``bf16-true`` and ``bf16-mixed`` the logged ``grad_norm`` is the optimizer's after each step, and
  clipping took effect: the norms are above 1.0 and the weights differ from a run with clipping off;
* ``trainer.fit(model, ckpt_path=...)`` resumes bit for bit (weights, the optimizer's compressed state and
  clipping history, the logged norms) from a mid-epoch checkpoint (with torchdata's ``StatefulDataLoader``)
  and from an end-of-epoch one, where Lightning resumes plain ``torch.optim.AdamW`` exactly (the control).
"""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import OutOfMemory, tiny_llama

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt import release_notices  # noqa: E402
from fusedopt.integrations.lightning import FusedOptCallback  # noqa: E402

pytestmark = [
    # Lightning's own deprecation notice on every fit, not ours
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
    # torchdata's StatefulDataLoader calls a deprecated torch function
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
]

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


def loader(n: int = 20, batch: int = 4):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def fit(module: Net, callback: bool = True, callbacks=(), own_data: bool = False, **kwargs):
    """Fit ``module`` on ``loader()``, or with ``own_data`` on its own ``train_dataloader``."""
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
    trainer.fit(module, None if own_data else loader())
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


WITHOUT_CALLBACK = {
    "clipping": (dict(gradient_clip_val=SMALL), r"Trainer\(gradient_clip_val=0.1\) cannot clip a fused=True"),
    "accumulation": (
        dict(accumulate_grad_batches=2),
        r"Trainer\(accumulate_grad_batches=2\) with a fused=True fusedopt.AdamW\(accumulation_steps=1\)",
    ),
    "16-mixed": (dict(plugins=[fp16_mixed()]), r"scales the loss with a GradScaler that a fused=True .* was not given"),
}


@pytest.mark.parametrize("case", list(WITHOUT_CALLBACK))
def test_without_the_callback_what_lightning_does_to_released_gradients_is_refused(case):
    """Lightning clips after backward, accumulates by scaling the loss and unscales in its step: with
    release and no callback it would clip nothing, update from part of a window or from scaled
    gradients. Refused at the first backward, before any parameter changes."""
    trainer_kwargs, message = WITHOUT_CALLBACK[case]
    module = Net(fused=True, max_grad_norm=None)
    before = weights(module)
    with pytest.raises(ValueError, match=message + r".*FusedOptCallback\(\) to Trainer\(callbacks"):
        fit(module, callback=False, **trainer_kwargs)
    assert module.batches == 1
    assert all(torch.equal(p, q) for p, q in zip(weights(module), before))


def test_without_the_callback_matching_settings_train():
    """The optimizer given Lightning's accumulation itself: trains as fused=False under Lightning, bit for
    bit; fused=False clips as Lightning does without the callback."""
    fused = Net(fused=True, max_grad_norm=None, accumulation_steps=2)
    fit(fused, callback=False, accumulate_grad_batches=2)
    plain = Net(fused=False, max_grad_norm=None)
    fit(plain, callback=False, accumulate_grad_batches=2)
    assert_equal(fused, plain)
    clipped = Net(fused=False, max_grad_norm=None)
    fit(clipped, callback=False, gradient_clip_val=SMALL)
    assert differs(clipped, Net(fused=False, max_grad_norm=None))


class ManualAccumulation(Net):
    """Manual optimization that accumulates two batches per step (the optimizer's accumulation_steps)."""

    def __init__(self, **opt_kwargs):
        super().__init__(**opt_kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx) / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()


def test_manual_optimization_accumulates_as_the_optimizer_is_told():
    """Lightning forbids accumulate_grad_batches under manual optimization: the callback leaves the
    optimizer's accumulation_steps alone there."""
    fused = ManualAccumulation(fused=True, max_grad_norm=None, accumulation_steps=2)
    fit(fused, max_epochs=1, max_steps=-1, limit_train_batches=4)
    assert fused.opt.accumulation_steps == 2 and len(fused.norms) == 2
    plain = ManualAccumulation(fused=False, max_grad_norm=None)
    fit(plain, max_epochs=1, max_steps=-1, limit_train_batches=4)
    assert_equal(fused, plain)


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


class Sized(Net):
    """``Net`` with the data loader Lightning's ``BatchSizeFinder`` resizes; a batch above ``fits`` runs out of
    memory in backward after the head's update (the fault between the head and the layer below it)."""

    def __init__(self, fits=None):
        super().__init__(fused=True, max_grad_norm=None)
        self.batch_size, self.fits = 2, fits

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[1](self.net[0](x))
        if self.fits is not None and len(x) > self.fits:
            OutOfMemory.armed = True
            h = OutOfMemory.apply(h)
        return F.mse_loss(self.net[2](h), y)

    def train_dataloader(self):
        return loader(64, self.batch_size)


def test_batch_size_finder_retries_an_out_of_memory_backward(tmp_path):
    """``BatchSizeFinder`` tries batch sizes 2, 4, 8: at 8 a releasing backward runs out of memory after
    updating the head. The optimizer closes that step (it says so once), Lightning restores the checkpoint
    it saved before the trials, and the run then trains as one at batch size 4 from the start, bit for bit."""
    finder = BatchSizeFinder(mode="power", init_val=2, max_trials=4, steps_per_trial=2)
    found = Sized(fits=4)
    with pytest.warns(UserWarning, match=r"stopped early.*; 2 parameter update\(s\)") as record:
        trainer = fit(found, callbacks=[finder], default_root_dir=tmp_path, own_data=True)
    assert sum("stopped early" in str(w.message) for w in record) == 1
    assert finder.optimal_batch_size == 4 and found.batch_size == 4 and trainer.global_step == 6
    assert [int(found.opt.state[p]["step"]) for p in found.net.parameters()] == [6] * 4
    assert found.opt.num_interrupted_steps == 0  # restored from before the trials
    plain = Sized()
    plain.batch_size = 4
    fit(plain, default_root_dir=tmp_path, own_data=True)
    assert_equal(found, plain)
    assert not list(tmp_path.glob(".scale_batch_size_*"))


def test_importing_fusedopt_does_not_import_lightning():
    code = "import sys, fusedopt, fusedopt.integrations; assert 'lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- a tiny Llama: bf16-true and bf16-mixed, and resuming from a checkpoint ---------------------

CLIP = 1.0  # the Llama tests' gradient_clip_val: their gradient norms at lr=1e-2 are about 1.3-2.2
LLAMA_OPT = dict(fused=True, max_grad_norm=None, state_bits=8, min_compress_numel=0)  # 8-bit moments of every matrix


class Tokens(torch.utils.data.Dataset):
    """12 seeded random sequences of 12 tokens (map-style): 6 batches of 2 an epoch, 3 steps with
    accumulate_grad_batches=2."""

    def __init__(self, n: int = 12, seq_len: int = 12, vocab: int = 64):
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i]


class Llama(L.LightningModule):
    """The LM loss of a tiny Llama; records the optimizer's grad_norm after each of its steps (None for
    an optimizer without one) and the token batches each step trained on."""

    def __init__(self, opt_cls=fusedopt.AdamW, **opt_kwargs):
        super().__init__()
        self.model = tiny_llama()
        self.opt_cls, self.opt_kwargs = opt_cls, opt_kwargs
        self.norms: list = []
        self.batches: list = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch.clone())
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        self.opt = self.opt_cls(self.model.parameters(), lr=1e-2, **self.opt_kwargs)
        self.opt.register_step_post_hook(
            lambda opt, args, kwargs: self.norms.append(_copy(getattr(opt, "grad_norm", None)))
        )
        return self.opt


def fit_llama(module: Llama, out, callback: bool = True, callbacks=(), loader_cls=None, ckpt_path=None, **kwargs):
    """Lightning with accumulate_grad_batches=2, logging every step to a CSV file under ``out``."""
    loader_cls = loader_cls or torch.utils.data.DataLoader
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,
        logger=CSVLogger(out),
        log_every_n_steps=1,
        enable_checkpointing=bool(callbacks),  # no default ModelCheckpoint
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=([FusedOptCallback()] if callback else []) + list(callbacks),
        **kwargs,
    )
    trainer.fit(module, loader_cls(Tokens(), batch_size=2), ckpt_path=ckpt_path)
    return trainer


def logged_norms(out) -> dict[int, float]:
    """The logged grad_norm of each step, by step (no file: nothing was logged)."""
    path = out / "lightning_logs" / "version_0" / "metrics.csv"
    if not path.exists():
        return {}
    with open(path) as f:
        return {int(row["step"]): float(row["grad_norm"]) for row in csv.DictReader(f) if row.get("grad_norm")}


@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_llama_accumulates_clips_and_logs_through_the_optimizer(tmp_path, precision, dtype):
    """fused=True under bf16-true (bf16 weights, their correction in the optimizer) and bf16-mixed (fp32
    weights, bf16 autocast), accumulate_grad_batches=2, gradient_clip_val=1.0 handed to the optimizer: the
    logged grad_norm is the optimizer's after each step, steps with a norm above 1.0 were clipped, and the
    weights differ from the same run with clipping off."""
    clipped = Llama(**LLAMA_OPT)
    trainer = fit_llama(clipped, tmp_path / "clipped", precision=precision, gradient_clip_val=CLIP, max_steps=4)
    opt = clipped.opt
    assert trainer.global_step == 4 and len(clipped.batches) == 8
    assert {p.dtype for p in clipped.parameters()} == {dtype}
    assert opt.fused and opt.max_grad_norm == CLIP and opt.accumulation_steps == 2
    norms = [n.item() for n in clipped.norms]
    assert logged_norms(tmp_path / "clipped") == dict(enumerate(norms))
    assert all(n > CLIP for n in norms), norms  # so every step was clipped (the norm is before clipping)

    unclipped = Llama(**LLAMA_OPT)
    fit_llama(unclipped, tmp_path / "unclipped", precision=precision, max_steps=4)
    assert unclipped.opt.max_grad_norm is None and unclipped.norms == [None] * 4
    assert logged_norms(tmp_path / "unclipped") == {}
    assert differs(clipped, unclipped)


def _stateful_loader():
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


# Where the checkpoint is taken (6 steps in 2 epochs of 3): (the dataloader, ModelCheckpoint's schedule, the
# length of the run, the step of the checkpoint resumed from). Lightning 2.6 resumes both exactly with plain
# torch.optim.AdamW (the control below); it does not resume a mid-epoch checkpoint exactly with a plain
# DataLoader (it starts the epoch's data again: the resumed batches are the epoch's first ones, while the
# step and batch counters continue), nor the last.ckpt of a run stopped by max_steps on an epoch's last
# batch (the resumed run trains the next epoch's first batch alone as one more step of the old epoch).
RESUME_AT = {
    "mid-epoch": (_stateful_loader, dict(every_n_train_steps=2), dict(max_steps=6), 2),
    "epoch-end": (lambda: torch.utils.data.DataLoader, dict(every_n_epochs=1), dict(max_epochs=2), 3),
}


def fit_and_resume(tmp_path, at: str, make, **kwargs) -> tuple[Llama, Llama, int, dict, dict]:
    """An uninterrupted run that saves checkpoints with a ModelCheckpoint, and a run resumed from one with
    ``trainer.fit(model, ckpt_path=...)`` with the same callback (the same script run again): both modules,
    the step resumed at, and the checkpoint files (name: bytes) before and after the resumed run."""
    loader, schedule, length, step = RESUME_AT[at]
    loader_cls = loader()
    saved = tmp_path / "checkpoints"

    def run(module: Llama, out: str, ckpt_path=None):
        saver = L.pytorch.callbacks.ModelCheckpoint(saved, filename="{step}", save_top_k=-1, **schedule)
        return fit_llama(
            module, tmp_path / out, callbacks=[saver], loader_cls=loader_cls, ckpt_path=ckpt_path, **length, **kwargs
        )

    full = make()
    trainer = run(full, "full")
    assert trainer.global_step == 6 and len(full.batches) == 12 and len(full.norms) == 6
    before = {f.name: f.read_bytes() for f in saved.iterdir()}
    resumed = make()
    trainer = run(resumed, "resumed", ckpt_path=saved / f"step={step}.ckpt")
    after = {f.name: f.read_bytes() for f in saved.iterdir()}
    assert trainer.global_step == 6
    assert len(resumed.norms) == 6 - step  # it stepped the remaining steps only, on the remaining batches
    assert all(torch.equal(a, b) for a, b in zip(resumed.batches, full.batches[2 * step :], strict=True))
    assert_equal(full, resumed)
    assert_same_state(full.opt.state_dict(), resumed.opt.state_dict())
    return full, resumed, step, before, after


def assert_same_state(a, b, where="state_dict") -> None:
    """Equal optimizer state_dicts: every tensor bit for bit, everything else equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


RESUMED_INTO_ITS_DIRECTORY = pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")


@RESUMED_INTO_ITS_DIRECTORY
@pytest.mark.parametrize("at", list(RESUME_AT))
def test_lightning_resumes_plain_torch_adamw_exactly(tmp_path, at):
    """The control: where Lightning itself resumes exactly (fp32 torch.optim.AdamW, no clipping, no
    fusedopt): the resumed run trains the uninterrupted run's remaining batches, to its weights and
    optimizer state."""
    fit_and_resume(tmp_path, at, lambda: Llama(torch.optim.AdamW), callback=False)
    # (mid-epoch, the resumed run's ModelCheckpoint saves step 2 again after its first batch, inside the
    # accumulation window: over the checkpoint it resumed from, without that batch's gradients)


@RESUMED_INTO_ITS_DIRECTORY
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("at", list(RESUME_AT))
def test_llama_resumes_bit_for_bit(tmp_path, at, precision):
    """fused=True with the callback, 8-bit moments, accumulate_grad_batches=2, clipping at 1.0, bf16-true
    (bf16 weights and their correction) or bf16-mixed, resumed where the control resumes exactly: the
    weights, the optimizer's state_dict (moments, corrections, the clipping history) and the logged
    grad_norm of every resumed step equal the uninterrupted run's."""
    full, resumed, step, before, after = fit_and_resume(
        tmp_path, at, lambda: Llama(**LLAMA_OPT), precision=precision, gradient_clip_val=CLIP
    )
    # The resumed run saved its own later steps (next to the first run's), not the step it resumed from again
    # inside its first accumulation window (Lightning's ModelCheckpoint would: the callback marks it saved).
    assert all(after[name] == data for name, data in before.items())
    later = [name for name in before if int(name.removeprefix("step=").removesuffix(".ckpt")) > step]
    assert sorted(after.keys() - before.keys()) == sorted(name.replace(".ckpt", "-v1.ckpt") for name in later)
    assert resumed.opt.max_grad_norm == CLIP and resumed.opt.accumulation_steps == 2
    bf16_weights = precision == "bf16-true"
    assert {p.dtype for p in resumed.parameters()} == {torch.bfloat16 if bf16_weights else torch.float32}
    state = resumed.opt.state_dict()  # compressed, compared with the uninterrupted run's above
    assert sum("exp_avg.codes" in s for s in state["state"].values()) == 16  # 8-bit moments of the matrices
    assert all(("master_correction" in s) == bf16_weights for s in state["state"].values())  # bf16's correction
    assert len(state["fusedopt"]["release_clipping"]["params"]) == len(state["state"])  # the clipping history
    norms = [n.item() for n in full.norms]
    assert all(n > CLIP for n in norms[step:]), norms  # the resumed steps were clipped
    assert logged_norms(tmp_path / "full") == dict(enumerate(norms))
    assert logged_norms(tmp_path / "resumed") == {i: n for i, n in enumerate(norms) if i >= step}
