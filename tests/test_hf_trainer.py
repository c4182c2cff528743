"""fusedopt under the Hugging Face ``transformers.Trainer`` (``fusedopt.integrations.huggingface``), on a tiny
Llama built from a config (nothing downloaded).

* The Trainer's ``max_grad_norm`` is the optimizer's, the Trainer's own clipping never runs, and the
  logged ``grad_norm`` is the optimizer's ``grad_norm``. ``fused=False`` training equals a plain
  ``transformers.Trainer`` that clips with torch's ``clip_grad_norm_`` and steps an unclipped fusedopt
  optimizer; ``fused=True`` is the releasing optimizer's own clipping, bit for bit.
* A plain Trainer asked to clip a releasing optimizer clips nothing (its weights are the unclipped
  run's), and building that optimizer without ``max_grad_norm`` warned, naming ``FusedOptTrainer``;
  ``FusedOptTrainer`` builds it without that warning. A plain Trainer driving a releasing optimizer
  warns once, at its first backward, that the grad_norm it logs (0) is not the optimizer's.
* A plain Trainer whose ``gradient_accumulation_steps`` a releasing optimizer does not share is refused
  at the first backward that would update, before anything changes, naming the setting and the fix; given
  the same ``accumulation_steps`` it trains as ``FusedOptTrainer`` does.
* With ``fused=True`` the Trainer's accumulation becomes the optimizer's ``accumulation_steps``; fp32
  training is then bit-identical to ``fused=False`` (a short last window included).
* ``train(resume_from_checkpoint=...)`` continues bit for bit: weights, losses and grad norms of the
  resumed steps equal the uninterrupted run's (shuffled data, dropout, a warm-up + decay schedule,
  compressed state and bf16 weights with their correction).
* Setups that cannot work as asked are refused when ``train()`` starts, naming the fix.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import warnings

import helpers
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fusedopt  # noqa: E402
from fusedopt import release_notices  # noqa: E402
from fusedopt.integrations.huggingface import FusedOptTrainer, fused_optimizer  # noqa: E402


@pytest.fixture(autouse=True)
def _no_accumulation_left():
    """accelerate's GradientState is shared by the process: a Trainer refused inside an accumulation window
    must not leave it there for the next test."""
    yield
    from accelerate.state import GradientState

    GradientState()._set_sync_gradients(True)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 20, seq_len: int = 12, vocab: int = 64):
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama(dtype=torch.float32, dropout: float = 0.0):
    return helpers.tiny_llama(dtype, attention_dropout=dropout)


def training_args(out, **overrides):
    kwargs = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=6,
        learning_rate=1e-2,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def train(trainer_cls, out, model=None, opt_kwargs=None, resume=None, **args):
    model = tiny_llama() if model is None else model
    trainer = trainer_cls(
        model=model,
        args=training_args(out, **args),
        train_dataset=TokenDataset(),
        optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(state_bits=32, **(opt_kwargs or {}))),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def step_logs(trainer, key):
    return [entry.get(key) for entry in trainer.state.log_history if "loss" in entry]


def params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def unclipped(tmp_path_factory):
    """An unclipped run (clipping configured, never reached): the clipping threshold of the tests, the
    median of its gradient norms (so clipping there changes some steps, not others, whichever way the
    installed Trainer normalises the loss), and its weights."""
    trainer, model = train(
        FusedOptTrainer, tmp_path_factory.mktemp("unclipped"), opt_kwargs=dict(fused=False), max_grad_norm=1e4
    )
    return statistics.median(step_logs(trainer, "grad_norm")), params(model)


def _train_recording_norms(out, fused: bool, clip: float):
    """FusedOptTrainer with TrainingArguments.max_grad_norm=clip; the optimizer's norm after each step."""
    seen = []

    class Record(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            norm = fused_optimizer(optimizer).grad_norm
            assert isinstance(norm, torch.Tensor) and norm.dim() == 0
            seen.append(float(norm))

    model = tiny_llama()
    trainer = FusedOptTrainer(
        model=model,
        args=training_args(out, max_grad_norm=clip),
        train_dataset=TokenDataset(),
        optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(state_bits=32, fused=fused)),
        callbacks=[Record()],
    )
    trainer.train()
    assert fused_optimizer(trainer.optimizer).max_grad_norm == clip  # from TrainingArguments
    assert step_logs(trainer, "grad_norm") == seen  # the logged norm is the optimizer's
    return model, seen


def _torch_clipped_reference(out, clip: float):
    """A plain Trainer clipping with torch's clip_grad_norm_, stepping an unclipped fusedopt optimizer."""
    ref, ref_model = train(transformers.Trainer, out, opt_kwargs=dict(fused=False, lr=1e-2), max_grad_norm=clip)
    ref_norms = step_logs(ref, "grad_norm")
    assert any(n > clip for n in ref_norms) and any(n < clip for n in ref_norms)  # clips on some steps only
    return ref_model, ref_norms


def _assert_clipping_mattered(model, unclipped_params):
    """The weights moved off the unclipped run's by far more than rounding (the runs compared above agree
    to 1e-7 or bit for bit)."""
    ours = params(model)
    assert max((unclipped_params[n] - ours[n]).abs().max().item() for n in ours) > 1e-4


def test_trainer_clips_once_through_the_optimizer_and_logs_its_grad_norm(tmp_path, unclipped):
    clip, unclipped_params = unclipped
    ref_model, ref_norms = _torch_clipped_reference(tmp_path / "ref", clip)
    model, seen = _train_recording_norms(tmp_path / "ours", fused=False, clip=clip)
    # the optimizer saw the unclipped gradients (norms above clip among them): the Trainer clipped nothing before it
    torch.testing.assert_close(seen, ref_norms, rtol=1e-5, atol=0)
    ours, ref = params(model), params(ref_model)
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)
    _assert_clipping_mattered(model, unclipped_params)


def test_trainer_clips_through_a_releasing_optimizer_and_logs_its_grad_norm(tmp_path, unclipped):
    """fused=True clips inside backward against an estimate of the global norm (fusedopt/clipping.py):
    the run is the optimizer's own clipping, bit for bit, and the logged norm is its exact norm."""
    clip, unclipped_params = unclipped
    _, ref_norms = _torch_clipped_reference(tmp_path / "ref", clip)
    # The optimizer's own clipping: a releasing optimizer that clips, under a plain Trainer that does not (the
    # norm it logs is routed to the optimizer's)
    plain, plain_model = train(
        transformers.Trainer,
        tmp_path / "plain",
        opt_kwargs=dict(fused=True, lr=1e-2, max_grad_norm=clip),
        max_grad_norm=0,
    )
    model, seen = _train_recording_norms(tmp_path / "ours", fused=True, clip=clip)
    assert step_logs(plain, "grad_norm") == seen
    torch.testing.assert_close(seen[0], ref_norms[0], rtol=1e-5, atol=0)  # the same first gradients: exact
    ours, reference = params(model), params(plain_model)
    for name in ours:
        assert torch.equal(ours[name], reference[name]), name
    _assert_clipping_mattered(model, unclipped_params)  # fused=True equals fused=False where nothing clips


def test_a_plain_trainers_clipping_and_logged_norm_go_through_a_releasing_optimizer(tmp_path, monkeypatch, unclipped):
    """A plain Trainer clips, and takes the norm it logs, through its accelerator's clip_grad_norm_, which
    finds no gradients after a releasing backward: it is routed to the optimizer. At the optimizer's own
    threshold the run is FusedOptTrainer's, bit for bit, logging the optimizer's norm; asked to clip a
    releasing optimizer that does not, it is refused at the first step, naming the setting (and building
    that optimizer warned)."""
    clip, _ = unclipped
    plain, plain_model = train(
        transformers.Trainer, tmp_path / "plain", opt_kwargs=dict(fused=True, lr=1e-2, max_grad_norm=clip),
        max_grad_norm=clip,
    )  # fmt: skip
    ours, ours_model = train(FusedOptTrainer, tmp_path / "ours", opt_kwargs=dict(fused=True), max_grad_norm=clip)
    norms = step_logs(plain, "grad_norm")
    assert norms == step_logs(ours, "grad_norm") and all(n > 0 for n in norms) and any(n > clip for n in norms)
    assert step_logs(plain, "loss") == step_logs(ours, "loss")
    a, b = params(plain_model), params(ours_model)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    monkeypatch.setattr(release_notices, "_release_warned", False)
    with (
        pytest.warns(UserWarning, match="FusedOptTrainer"),
        pytest.raises(ValueError, match=r"max_grad_norm=None.*TrainingArguments.max_grad_norm"),
    ):
        train(transformers.Trainer, tmp_path / "none", opt_kwargs=dict(fused=True, lr=1e-2), max_grad_norm=clip)


def test_fused_opt_trainer_builds_a_releasing_optimizer_without_the_clipping_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(release_notices, "_release_warned", False)
    for clip, expected in ((0, None), (1.5, 1.5)):  # TrainingArguments.max_grad_norm: 0 is no clipping
        trainer = _trainer(tmp_path, opt=(fusedopt.AdamW, dict(fused=True)), max_grad_norm=clip)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fusedopt")
            opt = fused_optimizer(trainer.create_optimizer())
        assert opt.fused and opt.max_grad_norm == expected
    assert not release_notices._release_warned


def test_trainer_accumulation_becomes_the_optimizers_and_fused_equals_unfused(tmp_path):
    # 20 samples in batches of 2 = 10 micro-batches per epoch; 3 per step leaves a last window of 1
    # clipping configured but never reached: release stays bit-identical to fused=False
    common = dict(max_grad_norm=1e4, gradient_accumulation_steps=3, max_steps=4, num_train_epochs=1)
    fused, fused_model = train(FusedOptTrainer, tmp_path / "f", opt_kwargs=dict(fused=True), **common)
    opt = fused_optimizer(fused.optimizer)
    assert opt.fused and opt.accumulation_steps == 3
    plain, plain_model = train(FusedOptTrainer, tmp_path / "p", opt_kwargs=dict(fused=False), **common)
    assert fused.state.global_step == plain.state.global_step == 4
    assert step_logs(fused, "loss") == step_logs(plain, "loss")
    norms = step_logs(fused, "grad_norm")  # of the accumulated gradient
    assert all(n is not None for n in norms)
    torch.testing.assert_close(norms, step_logs(plain, "grad_norm"), rtol=1e-5, atol=0)
    a, b = params(fused_model), params(plain_model)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _resume_is_exact(tmp_path, fused: bool, max_grad_norm: float):
    opt_kwargs = dict(fused=fused, state_bits=8, min_compress_numel=0, weight_decay=0.1)  # 8-bit moments
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, max_grad_norm=max_grad_norm)
    if fused:
        common["gradient_accumulation_steps"] = 2

    def run(out, resume=None):
        model = tiny_llama(torch.bfloat16, dropout=0.2)  # bf16 weights + int8 correction; dropout draws RNG
        trainer = FusedOptTrainer(
            model=model,
            args=training_args(out, **common),
            train_dataset=TokenDataset(),
            optimizer_cls_and_kwargs=(fusedopt.AdamW, opt_kwargs),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, model

    full, full_model = run(tmp_path / "full")
    resumed, resumed_model = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    assert not (tmp_path / "resumed" / "checkpoint-3").exists()  # it trained steps 4-6 only
    for key in ("loss", "grad_norm", "learning_rate"):  # the resumed log starts with the checkpoint's 3 steps
        assert step_logs(resumed, key) == step_logs(full, key), key
        assert len(step_logs(full, key)) == 6 and (
            key != "grad_norm" or all(step_logs(full, key)) == bool(max_grad_norm)
        )
    assert len(set(step_logs(full, "learning_rate"))) >= 4  # warm-up and decay: the schedule was restored
    a, b = params(full_model), params(resumed_model)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa, sb = fused_optimizer(full.optimizer).state_dict(), fused_optimizer(resumed.optimizer).state_dict()
    for index, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][index][key]), (index, key)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_trainer_resume_from_checkpoint_is_bit_for_bit(tmp_path, fused):
    _resume_is_exact(tmp_path, fused, max_grad_norm=0)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_trainer_resume_from_checkpoint_is_bit_for_bit_with_clipping(tmp_path, fused):
    _resume_is_exact(tmp_path, fused, max_grad_norm=0.5)


def _trainer(out, optimizers=(None, None), opt=None, **args):
    model = tiny_llama()
    return FusedOptTrainer(
        model=model,
        args=training_args(out, max_steps=1, **args),
        train_dataset=TokenDataset(),
        optimizers=optimizers,
        optimizer_cls_and_kwargs=opt,
    )


def test_trainer_refuses_what_it_cannot_do_as_asked(tmp_path):
    # the Trainer's accumulation and the optimizer's disagree under release
    trainer = _trainer(
        tmp_path,
        opt=(fusedopt.AdamW, dict(fused=True, accumulation_steps=1)),
        gradient_accumulation_steps=2,
        max_grad_norm=0,
    )
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2.*accumulation_steps=2"):
        trainer.train()

    # an optimizer built by hand that does not clip as TrainingArguments.max_grad_norm asks
    model = tiny_llama()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = FusedOptTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=1),
        train_dataset=TokenDataset(),
        optimizers=(opt, scheduler),
    )
    with pytest.raises(ValueError, match=r"max_grad_norm=None differs from TrainingArguments.max_grad_norm=1.0"):
        trainer.train()
    before = params(model)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)  # as asked: it trains
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = FusedOptTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=1),
        train_dataset=TokenDataset(),
        optimizers=(opt, scheduler),
    )
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in params(model).items())

    # not a fusedopt optimizer, or none at all
    with pytest.raises(TypeError, match="FusedOptTrainer trains with a fusedopt optimizer, got AdamW"):
        _trainer(tmp_path, opt=(torch.optim.AdamW, {})).train()
    with pytest.raises(ValueError, match="FusedOptTrainer needs its optimizer"):
        _trainer(tmp_path).train()


def test_trainer_takes_unset_hyperparameters_from_training_arguments(tmp_path):
    trainer = _trainer(
        tmp_path, opt=(fusedopt.AdamW, dict(eps=1e-6)), learning_rate=3e-3, adam_beta1=0.8, weight_decay=0.05
    )
    opt = fused_optimizer(trainer.create_optimizer())
    group = opt.param_groups[0]
    assert group["lr"] == 3e-3 and group["betas"] == (0.8, 0.999) and group["eps"] == 1e-6
    assert group["weight_decay"] == 0.05 and opt.param_groups[1]["weight_decay"] == 0.0  # the Trainer's groups
    assert opt.max_grad_norm == 1.0 and not opt.fused


def test_importing_fusedopt_does_not_import_transformers():
    code = (
        "import sys, fusedopt, fusedopt.integrations\n"
        "for name in ('transformers', 'accelerate', 'trl'): assert name not in sys.modules, name"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plain_trainer_refuses_an_accumulation_mismatch_at_the_first_backward(tmp_path):
    """optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True)) under a plain Trainer whose
    gradient_accumulation_steps the optimizer's accumulation_steps does not match: its first backward raises,
    before any parameter changes."""
    for steps, k in ((2, 1), (4, 2), (2, 4)):  # (the Trainer's, the optimizer's)
        model = tiny_llama()
        forwards = []
        model.register_forward_hook(lambda module, args, out, seen=forwards: seen.append(1))
        before = params(model)
        trainer = transformers.Trainer(
            model=model,
            args=training_args(tmp_path, gradient_accumulation_steps=steps),
            train_dataset=TokenDataset(),
            optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True, accumulation_steps=k, max_grad_norm=1.0)),
        )
        with pytest.raises(RuntimeError, match=f"gradient_accumulation_steps={steps} backward passes") as error:
            trainer.train()
        message = str(error.value)
        assert f"has accumulation_steps={k}:" in message and f"Pass accumulation_steps={steps}" in message
        assert "fusedopt.integrations.huggingface.FusedOptTrainer" in message
        assert len(forwards) == 1
        for name, p in params(model).items():
            assert torch.equal(p, before[name]), name
        assert not fused_optimizer(trainer.optimizer).state

    # given the Trainer's accumulation, a plain Trainer trains as FusedOptTrainer (without clipping in either:
    # no norm is logged, where the plain Trainer's own would be a 0 from the released gradients)
    plain, plain_model = train(
        transformers.Trainer,
        tmp_path / "plain",
        opt_kwargs=dict(fused=True, accumulation_steps=2, lr=1e-2, max_grad_norm=None),
        gradient_accumulation_steps=2,
        max_grad_norm=0,
    )
    ours, ours_model = train(
        FusedOptTrainer, tmp_path / "ours", opt_kwargs=dict(fused=True), gradient_accumulation_steps=2, max_grad_norm=0
    )
    assert all(n is None for n in step_logs(plain, "grad_norm") + step_logs(ours, "grad_norm"))
    assert step_logs(plain, "loss") == step_logs(ours, "loss")
    a, b = params(plain_model), params(ours_model)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_mixin_must_come_before_the_trainer():
    from fusedopt.integrations.huggingface import FusedOptTrainerMixin

    with pytest.raises(TypeError, match=r"put FusedOptTrainerMixin before the Trainer"):

        class Wrong(transformers.Trainer, FusedOptTrainerMixin):
            pass

    class Right(FusedOptTrainerMixin, transformers.Trainer):
        pass

    assert Right._clip_grad_norm is FusedOptTrainerMixin._clip_grad_norm


def test_trainer_hands_its_grad_scaler_to_a_releasing_optimizer(tmp_path):
    """fp16 loss scaling (a GradScaler set on the accelerator, as fp16=True does on a GPU): the releasing
    optimizer unscales with the Trainer's scaler and trains as fused=False under the same scaler."""
    results = []
    for fused in (True, False):
        model = tiny_llama()
        trainer = FusedOptTrainer(
            model=model,
            args=training_args(tmp_path / str(fused), max_grad_norm=1e4),  # configured, never clips
            train_dataset=TokenDataset(),
            optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(state_bits=32, fused=fused)),
        )
        scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        trainer.train()
        opt = fused_optimizer(trainer.optimizer)
        assert opt.grad_scaler is (scaler if fused else None)
        assert scaler.state_dict()["_growth_tracker"] == 6  # it scaled and stepped all 6 steps, none skipped
        assert scaler.get_scale() == 2.0**12 and int(opt.num_skipped_updates) == 0
        results.append((params(model), step_logs(trainer, "loss")))
    (fused_params, fused_losses), (plain_params, plain_losses) = results
    assert fused_losses == plain_losses
    for name in fused_params:
        assert torch.equal(fused_params[name], plain_params[name]), name

    # an optimizer holding another scaler is refused
    model = tiny_llama()
    opt = fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=1.0, grad_scaler=torch.amp.GradScaler("cpu"))
    trainer = FusedOptTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=1),
        train_dataset=TokenDataset(),
        optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)),
    )
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="grad_scaler is not the GradScaler the Trainer scales the loss with"):
        trainer.train()


class _OutOfMemoryOnce(torch.autograd.Function):
    """Identity; its backward raises the allocator's error (the message accelerate's
    find_executable_batch_size looks for) in the second backward pass, the one that releases."""

    calls = raised = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _OutOfMemoryOnce.calls += 1
        if _OutOfMemoryOnce.calls == 2:
            _OutOfMemoryOnce.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return grad


def test_auto_find_batch_size_retries_an_out_of_memory_recomputation_under_reentrant_checkpointing(tmp_path):
    """Gradient checkpointing as transformers does it by default (``use_reentrant=True``) with the embedding,
    final norm and head frozen: every release hook runs in a layer's nested backward, and the out-of-memory
    error comes in the recomputation of the first layer, after the second layer's nested backward updated
    it. The optimizer closes that step, and the retry with a smaller batch trains to the end."""
    recomputations = []

    def fail_in_recomputation(module, args, out):
        if torch.is_grad_enabled():  # reentrant checkpointing runs the first forward without gradients
            recomputations.append(len(recomputations))
            if len(recomputations) == 4:  # the second step's second micro-batch, the one that updates
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return out

    model = tiny_llama(torch.bfloat16)
    for module in (model.model.embed_tokens, model.model.norm, model.lm_head):
        module.requires_grad_(False)
    model.enable_input_require_grads()  # the layers' input carries gradients into the checkpoints
    model.model.layers[0].mlp.register_forward_hook(fail_in_recomputation)
    args = training_args(
        tmp_path, max_steps=6, max_grad_norm=1.0, per_device_train_batch_size=4, auto_find_batch_size=True,
        gradient_accumulation_steps=2, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )  # fmt: skip
    trainer = FusedOptTrainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(n=40),
        optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True, state_bits=8, min_compress_numel=0)),
    )
    with pytest.warns(UserWarning, match=r"stopped early.*; [1-9]\d* parameter update\(s\)") as record:
        trainer.train()
    assert len(recomputations) > 4 and sum("stopped early" in str(w.message) for w in record) == 1
    assert trainer.state.global_step == 6 and trainer.state.train_batch_size == 3  # retried with 0.9 x 4
    opt = fused_optimizer(trainer.optimizer)
    assert opt.num_interrupted_steps == 1
    # one step before the failure and six in the retry, which runs on the same optimizer; the second layer,
    # updated by the failed pass, one more
    steps = {name: int(opt.state[p]["step"]) for name, p in model.named_parameters() if p.requires_grad}
    assert {name for name, n in steps.items() if n == 8} == {n for n in steps if ".layers.1." in n}
    assert all(n == 7 for name, n in steps.items() if ".layers.1." not in name)


def test_auto_find_batch_size_retries_an_out_of_memory_backward_and_resumes_bit_for_bit(tmp_path):
    """``auto_find_batch_size=True``: an out-of-memory error inside a releasing backward, after the layers
    above the fault were updated, makes the Trainer start again with a smaller batch on the same
    optimizer. The optimizer closes the failed step at the retry's first backward; training runs to
    the end, and its checkpoint resumes bit for bit."""
    opt_kwargs = dict(fused=True, state_bits=8, min_compress_numel=0)
    common = dict(
        max_steps=6, save_strategy="steps", save_steps=3, max_grad_norm=1.0, per_device_train_batch_size=4,
        auto_find_batch_size=True, gradient_accumulation_steps=2,
    )  # fmt: skip

    def run(out, resume=None, fail=False):
        model = tiny_llama(torch.bfloat16)
        if fail:  # between the second layer's MLP and the rest of the model
            model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: _OutOfMemoryOnce.apply(out))
        trainer = FusedOptTrainer(
            model=model,
            args=training_args(out, **common),
            train_dataset=TokenDataset(n=40),
            optimizer_cls_and_kwargs=(fusedopt.AdamW, opt_kwargs),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, model

    _OutOfMemoryOnce.calls = _OutOfMemoryOnce.raised = 0
    with pytest.warns(UserWarning, match=r"stopped early.*; [1-9]\d* parameter update\(s\)") as record:
        full, full_model = run(tmp_path / "full", fail=True)
    assert _OutOfMemoryOnce.raised == 1 and sum("stopped early" in str(w.message) for w in record) == 1
    assert full.state.global_step == 6 and full.state.train_batch_size == 3  # retried with 0.9 x 4
    opt = fused_optimizer(full.optimizer)
    assert opt.num_interrupted_steps == 1
    resumed, resumed_model = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    assert resumed.state.global_step == 6 and resumed.state.train_batch_size == 3
    for key in ("loss", "grad_norm"):
        assert step_logs(resumed, key) == step_logs(full, key), key
    a, b = params(full_model), params(resumed_model)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa, sb = opt.state_dict(), fused_optimizer(resumed.optimizer).state_dict()
    assert sb["fusedopt"]["num_interrupted_steps"] == 1  # saved in the checkpoint
    for index, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][index][key]), (index, key)
