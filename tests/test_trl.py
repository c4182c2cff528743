"""fusedopt under TRL's ``SFTTrainer`` (``fusedopt.integrations.trl``), on a tiny Llama built from a config and
a word-level tokenizer built in memory (nothing downloaded), with TRL's defaults (gradient checkpointing on)
but fp32 (``bf16=False``), gradient accumulation 2 and ``max_grad_norm``.

* ``FusedOptSFTTrainer`` trains with ``fused=True`` bit for bit as with ``fused=False`` (clipping configured,
  not reached), takes the accumulation and ``max_grad_norm`` from the ``SFTConfig``, and logs the optimizer's
  ``grad_norm`` (not 0).
* With clipping that changes the run: ``fused=False`` equals a plain ``SFTTrainer`` clipping with torch's
  ``clip_grad_norm_``; ``fused=True`` is the releasing optimizer's own clipping, bit for bit (a plain
  ``SFTTrainer`` driving that optimizer, whose logged grad_norm is routed to the optimizer's).
* The first thing a TRL user tries, a plain ``SFTTrainer`` with ``optimizer_cls_and_kwargs=(fusedopt.AdamW,
  dict(fused=True, max_grad_norm=1.0))``: with accumulation it is refused at the first backward, before any
  update, naming ``gradient_accumulation_steps`` and ``FusedOptSFTTrainer``; without, it trains, clipping and
  logging the norm through the optimizer; an optimizer that does not clip under its max_grad_norm is refused.
* TRL's other trainers take ``FusedOptTrainerMixin`` (``DPOTrainer`` here).
"""

from __future__ import annotations

import statistics
import warnings

import helpers
import pytest
import torch

trl = pytest.importorskip("trl")

import datasets  # noqa: E402  (TRL's dependencies)
import tokenizers  # noqa: E402
import transformers  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.integrations.huggingface import FusedOptTrainerMixin, fused_optimizer  # noqa: E402
from fusedopt.integrations.trl import FusedOptSFTTrainer  # noqa: E402

VOCAB = 32  # <pad>, <eos> and 30 words


@pytest.fixture(autouse=True)
def _no_accumulation_left():
    """accelerate's GradientState is shared by the process: a Trainer refused inside an accumulation window
    must not leave it there for the next test."""
    yield
    from accelerate.state import GradientState

    GradientState()._set_sync_gradients(True)


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def token_dataset(n: int = 16, seq_len: int = 10):
    """Pre-tokenized (``input_ids``): SFTTrainer only adds labels and truncates."""
    ids = torch.randint(2, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(0))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def tiny_llama():
    return helpers.tiny_llama(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1)


def sft_config(out, **overrides):
    kwargs = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        bf16=False,  # TRL's default is bf16 autocast: fp32 for bit-for-bit comparisons
        seed=0,
    )
    kwargs.update(overrides)
    return trl.SFTConfig(**kwargs)


class RecordNorms(transformers.TrainerCallback):
    """The optimizer's grad_norm after each optimizer step."""

    def __init__(self):
        self.norms = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.norms.append(float(fused_optimizer(optimizer).grad_norm))


def sft(trainer_cls, out, opt_kwargs, callbacks=(), **config):
    model = tiny_llama()
    trainer = trainer_cls(
        model=model,
        args=sft_config(out, **config),
        train_dataset=token_dataset(),
        processing_class=tokenizer(),
        optimizer_cls_and_kwargs=(fusedopt.AdamW, opt_kwargs),
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer, model


def step_logs(trainer, key):
    return [entry.get(key) for entry in trainer.state.log_history if "loss" in entry]


def params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_equal(a, b):
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def unfused(tmp_path_factory):
    """FusedOptSFTTrainer, fused=False, clipping configured but never reached: its weights, losses and norms."""
    trainer, model = sft(FusedOptSFTTrainer, tmp_path_factory.mktemp("unfused"), dict(fused=False), max_grad_norm=1e4)
    return params(model), step_logs(trainer, "loss"), step_logs(trainer, "grad_norm")


def test_fused_sft_trainer_equals_unfused_and_logs_the_optimizers_grad_norm(tmp_path, unfused):
    unfused_params, unfused_losses, unfused_norms = unfused
    record = RecordNorms()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusedopt")  # nothing to warn about: no plain Trainer here
        trainer, model = sft(FusedOptSFTTrainer, tmp_path, dict(fused=True), callbacks=[record], max_grad_norm=1e4)
    opt = fused_optimizer(trainer.optimizer)
    assert opt.fused and opt.accumulation_steps == 2 and opt.max_grad_norm == 1e4  # from the SFTConfig
    assert trainer.state.global_step == 4
    norms = step_logs(trainer, "grad_norm")
    assert norms == record.norms and all(n > 0 for n in norms)  # the optimizer's norm, logged
    torch.testing.assert_close(norms, unfused_norms, rtol=1e-5, atol=0)
    assert step_logs(trainer, "loss") == unfused_losses
    assert_equal(params(model), unfused_params)


def test_sft_trainer_clips_through_the_optimizer(tmp_path, unfused):
    unfused_params, _, unfused_norms = unfused
    clip = statistics.median(unfused_norms)  # clips some steps, not others
    # fused=False: the optimizer clips as torch's clip_grad_norm_ in a plain SFTTrainer would
    ref, ref_model = sft(trl.SFTTrainer, tmp_path / "ref", dict(fused=False, lr=1e-2), max_grad_norm=clip)
    ref_norms = step_logs(ref, "grad_norm")
    assert any(n > clip for n in ref_norms) and any(n < clip for n in ref_norms)
    record = RecordNorms()
    ours, ours_model = sft(FusedOptSFTTrainer, tmp_path / "ours", dict(fused=False), [record], max_grad_norm=clip)
    torch.testing.assert_close(record.norms, ref_norms, rtol=1e-5, atol=0)  # it saw the unclipped gradients
    assert step_logs(ours, "grad_norm") == record.norms
    a, b = params(ours_model), params(ref_model)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)
    assert max((a[n] - unfused_params[n]).abs().max().item() for n in a) > 1e-4  # clipping changed the run

    # fused=True: the releasing optimizer's own clipping (against its estimate of the global norm), bit for
    # bit as under a plain SFTTrainer that leaves clipping to it, whose norm for its log is routed to the optimizer
    record = RecordNorms()
    fused, fused_model = sft(FusedOptSFTTrainer, tmp_path / "fused", dict(fused=True), [record], max_grad_norm=clip)
    norms = step_logs(fused, "grad_norm")
    assert norms == record.norms and all(n > 0 for n in norms)
    torch.testing.assert_close(norms[0], ref_norms[0], rtol=1e-5, atol=0)  # the same first gradients
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusedopt")
        plain, plain_model = sft(
            trl.SFTTrainer,
            tmp_path / "plain",
            dict(fused=True, accumulation_steps=2, lr=1e-2, max_grad_norm=clip),
            max_grad_norm=0,
        )
    assert step_logs(plain, "grad_norm") == norms  # the optimizer's norm, not the 0 of the released gradients
    assert step_logs(plain, "loss") == step_logs(fused, "loss")
    assert_equal(params(fused_model), params(plain_model))
    assert max((params(fused_model)[n] - unfused_params[n]).abs().max().item() for n in a) > 1e-4


def test_plain_sft_trainer_with_a_releasing_optimizer(tmp_path):
    """The issue's setup: a plain SFTTrainer given optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True,
    max_grad_norm=1.0)). With accumulation it is refused at the first backward, before anything is updated."""
    forwards = []
    model = tiny_llama()
    model.register_forward_hook(lambda module, args, out: forwards.append(1))
    before = params(model)
    trainer = trl.SFTTrainer(
        model=model,
        args=sft_config(tmp_path),
        train_dataset=token_dataset(),
        processing_class=tokenizer(),
        optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True, max_grad_norm=1.0)),
    )
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps=2") as error:
        trainer.train()
    message = str(error.value)
    assert "accumulation_steps=2" in message and "fusedopt.integrations.trl.FusedOptSFTTrainer" in message
    assert len(forwards) == 1  # the first micro-batch's backward
    assert_equal(params(model), before)
    assert not fused_optimizer(trainer.optimizer).state  # no update, no state

    # without accumulation it trains; its clipping (SFTConfig's max_grad_norm=1.0, the optimizer's) and the norm
    # it logs go through the optimizer
    record = RecordNorms()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusedopt")
        plain, _ = sft(
            trl.SFTTrainer,
            tmp_path / "plain",
            dict(fused=True, max_grad_norm=1.0),
            [record],
            gradient_accumulation_steps=1,
        )
    norms = step_logs(plain, "grad_norm")
    assert plain.state.global_step == 4 and norms == record.norms and all(n > 0 for n in norms)

    # an optimizer that does not clip under a Trainer that does: refused at the first step, naming the setting
    with pytest.raises(ValueError, match=r"max_grad_norm=None.*TrainingArguments.max_grad_norm"):
        sft(trl.SFTTrainer, tmp_path / "none", dict(fused=True, max_grad_norm=None), gradient_accumulation_steps=1)


def test_other_trl_trainers_take_the_mixin(tmp_path):
    """DPOTrainer with FusedOptTrainerMixin: accumulation and clipping through a releasing optimizer, its norm
    logged; the same trainer without the mixin is refused at the first backward."""

    class FusedOptDPOTrainer(FusedOptTrainerMixin, trl.DPOTrainer):
        pass

    words = [f"w{i}" for i in range(VOCAB - 2)]
    rows = [
        {
            "prompt": " ".join(words[i : i + 4]),
            "chosen": " " + " ".join(words[i + 4 : i + 7]),
            "rejected": " " + " ".join(words[i + 10 : i + 13]),
        }
        for i in range(8)
    ]
    config = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        bf16=False,
        max_grad_norm=1.0,
        seed=0,
    )

    def dpo(cls, model=None, **optimizer):
        return cls(
            model=model or tiny_llama(),
            ref_model=tiny_llama(),  # (TRL would load it by the model's name)
            args=trl.DPOConfig(**config),
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer(),
            **optimizer,
        )

    # TRL's DPOTrainer takes no optimizer_cls_and_kwargs: the mixin does
    trainer = dpo(FusedOptDPOTrainer, optimizer_cls_and_kwargs=(fusedopt.AdamW, dict(fused=True)))
    trainer.train()
    opt = fused_optimizer(trainer.optimizer)
    assert opt.fused and opt.accumulation_steps == 2 and opt.max_grad_norm == 1.0
    norms = step_logs(trainer, "grad_norm")
    assert len(norms) == 2 and all(n > 0 for n in norms)

    model = tiny_llama()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=1.0)
    trainer = dpo(trl.DPOTrainer, model, optimizers=(opt, None))
    with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps=2.*MyTrainer\(FusedOptTrainerMixin, trl"):
        trainer.train()


def assert_same_state(a, b, where="state_dict"):
    """Two optimizer state_dicts (nested dicts, lists and tensors) equal bit for bit, dtypes included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_sft_trainer_resume_with_clipping_is_bit_for_bit(tmp_path, fused):
    """FusedOptSFTTrainer with accumulation 2, clipping that changes the run, 8-bit moments and bf16 weights
    (with their correction), resumed from checkpoint-3 of 6: the resumed run's logged losses, grad norms and
    learning rates, its weights and its whole optimizer state_dict (with fused=True, the clipping history
    release estimates the global norm from) equal the uninterrupted run's bit for bit, and each logged
    grad_norm is the optimizer's."""
    opt_kwargs = dict(fused=fused, state_bits=8, min_compress_numel=0)

    def run(out, clip, resume=None):
        record = RecordNorms()
        model = tiny_llama().to(torch.bfloat16)  # bf16 weights (bf16=False: no autocast)
        trainer = FusedOptSFTTrainer(
            model=model,
            args=sft_config(out, max_steps=6, save_strategy="steps", save_steps=3, max_grad_norm=clip),
            train_dataset=token_dataset(),
            processing_class=tokenizer(),
            optimizer_cls_and_kwargs=(fusedopt.AdamW, opt_kwargs),
            callbacks=[record],
        )
        trainer.train(resume_from_checkpoint=resume)
        assert step_logs(trainer, "grad_norm")[-len(record.norms) :] == record.norms  # the optimizer's norm
        return trainer, model, record.norms

    unclipped, unclipped_model, _ = run(tmp_path / "unclipped", clip=1e4)  # configured, never reached
    # clips every step, the first resumed one included: under release its clipping estimates the global norm
    # from the history saved in checkpoint-3 (without it, from the gradients seen so far: another update)
    clip = min(step_logs(unclipped, "grad_norm")) / 2
    full, full_model, full_seen = run(tmp_path / "full", clip)
    opt = fused_optimizer(full.optimizer)
    assert opt.fused == fused and opt.max_grad_norm == clip and opt.accumulation_steps == (2 if fused else 1)
    assert all(p.dtype == torch.bfloat16 for p in full_model.parameters())
    assert len(full_seen) == 6
    norms = step_logs(full, "grad_norm")
    assert norms[0] == step_logs(unclipped, "grad_norm")[0]  # the same first gradients
    assert all(n > clip for n in norms)  # every update clipped
    a, u = params(full_model), params(unclipped_model)
    changed = sum(int((a[n] != u[n]).sum()) for n in a) / sum(p.numel() for p in a.values())
    assert changed > 0.5  # clipping changed the run: most bf16 weights differ from the unclipped run's (~0.9)

    resumed, resumed_model, resumed_seen = run(tmp_path / "resumed", clip, str(tmp_path / "full" / "checkpoint-3"))
    assert resumed.state.global_step == 6 and len(resumed_seen) == 3  # it trained steps 4-6 only
    assert not (tmp_path / "resumed" / "checkpoint-3").exists()
    for key in ("loss", "grad_norm", "learning_rate"):  # the resumed log starts with the checkpoint's 3 steps
        logged = step_logs(full, key)
        assert len(logged) == 6 and all(v is not None for v in logged), key
        assert step_logs(resumed, key) == logged, key
    assert len(set(step_logs(full, "learning_rate"))) >= 4  # warm-up and decay: the schedule was restored
    assert_equal(params(resumed_model), a)
    assert_same_state(fused_optimizer(resumed.optimizer).state_dict(), opt.state_dict())
