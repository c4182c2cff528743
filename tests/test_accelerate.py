"""fusedopt in an accelerate loop (``fusedopt.integrations.accelerate``): ``Accelerator(cpu=True,
gradient_accumulation_steps=2)``, ``with accelerator.accumulate(model):``, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` when ``accelerator.sync_gradients``, ``optimizer.step()`` and ``zero_grad()``
on every micro-batch (accelerate skips them inside a window), two epochs of 5 micro-batches (a short last
window each).

* ``setup(accelerator, optimizer)`` takes the accumulation into the optimizer: ``fused=True`` then trains
  bit for bit as ``fused=False``, and ``accelerator.clip_grad_norm_`` returns the optimizer's norm (never 0).
* With clipping that changes the run, ``fused=False`` equals torch's clipping by accelerate of an optimizer
  that does not clip; ``fused=True``'s clipping is the optimizer's own, whether the loop asks for the norm
  or not.
* fp16: the accelerator's GradScaler is handed over; ``fused=True`` equals ``fused=False`` under it.
* Without ``setup``: an accumulation mismatch is refused at the first backward, before any update, naming
  ``Accelerator(gradient_accumulation_steps=2)`` and ``setup``; a matching loop warns once that
  ``accelerator.clip_grad_norm_`` finds no gradients; a GradientState left over from an earlier loop does not
  refuse a plain loop.
* What ``setup`` and the routed clipping cannot do as asked is refused, naming the fix.
* ``find_executable_batch_size`` that builds a new optimizer over the same model at each try: the dropped
  optimizers say what their failed passes left in the parameters; without ``free_memory()`` the next one
  is refused, naming it.
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import OutOfMemory, tiny_llama

accelerate = pytest.importorskip("accelerate")

from accelerate.state import GradientState  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.integrations.accelerate import setup  # noqa: E402


@pytest.fixture(autouse=True)
def _no_accumulation_left():
    """GradientState is shared by every Accelerator (and Trainer) of the process: a test that stops inside an
    accumulation window must not leave it there for the next."""
    yield
    GradientState()._set_sync_gradients(True)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def loader(n: int = 10, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_equal(a, b):
    for name in a:
        assert torch.equal(a[name], b[name]), name


def train(
    fused: bool,
    clip: float | None = None,
    opt_clip="same",
    set_up: bool = True,
    steps: int = 2,
    epochs: int = 2,
    scaler=None,
    ask_norm: bool = True,
    **opt_kwargs,
):
    """The accelerate loop; returns the model, the norms clip_grad_norm_ returned and the optimizer.
    ``clip``: the loop's max_norm (None: it never calls clip_grad_norm_); ``opt_clip``: the optimizer's
    max_grad_norm (``"same"``: ``clip``)."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)
    if scaler is not None:  # as fp16 does on a GPU
        accelerator.scaler = scaler
    model = mlp()
    opt_clip = clip if opt_clip == "same" else opt_clip
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=fused, max_grad_norm=opt_clip, **opt_kwargs)
    model, prepared, data = accelerator.prepare(model, opt, loader())
    if set_up:
        assert setup(accelerator, prepared) is opt
    norms, train.opt_norms = [], []  # the latter: the optimizer's grad_norm after each step
    for _ in range(epochs):
        for x, y in data:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip is not None and ask_norm:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
                prepared.step()
                if accelerator.sync_gradients and opt.max_grad_norm is not None:
                    train.opt_norms.append(float(opt.grad_norm))
                prepared.zero_grad()
    return model, norms, opt


@pytest.fixture(scope="module")
def unclipped():
    """fused=False with clipping configured, never reached: weights, norms and the clipping threshold (the
    median norm, so clipping there changes some steps and not others)."""
    model, norms, _ = train(fused=False, clip=1e4)
    assert len(norms) == 6  # 3 steps (2 + 2 + 1 micro-batches) per epoch
    return params(model), norms, statistics.median(norms)


def test_setup_takes_the_accumulation_and_fused_equals_unfused(unclipped):
    unfused_params, unfused_norms, _ = unclipped
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusedopt")  # set up: nothing to warn about
        model, norms, opt = train(fused=True, clip=1e4)
    assert opt.accumulation_steps == 2  # from the accelerator
    assert all(n > 0 for n in norms)  # the optimizer's norm, not the 0 of released gradients
    torch.testing.assert_close(norms, unfused_norms, rtol=1e-5, atol=0)
    assert_equal(params(model), unfused_params)
    assert all(int(state["step"]) == 6 for state in opt.state.values())  # 6 updates, the short windows included


def test_clip_grad_norm_goes_through_the_optimizer(unclipped):
    unfused_params, _, clip = unclipped
    # torch's clipping by accelerate, of an optimizer that does not clip
    ref_model, ref_norms, _ = train(fused=False, clip=clip, opt_clip=None, set_up=False)
    assert any(n > clip for n in ref_norms) and any(n < clip for n in ref_norms)
    model, norms, _ = train(fused=False, clip=clip)  # set up: the norm here, the clipping in step(), once
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(train.opt_norms, norms, rtol=1e-5, atol=0)  # step() saw unclipped gradients
    ours, ref = params(model), params(ref_model)
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)
    assert max((ours[n] - unfused_params[n]).abs().max().item() for n in ours) > 1e-4  # clipping mattered

    fused_model, fused_norms, opt = train(fused=True, clip=clip)
    assert all(n > 0 for n in fused_norms)  # the optimizer's norm of each step, as it clipped by it:
    full = [0, 1, 3, 4]  # windows of 2, updated inside backward: its grad_norm itself
    assert [fused_norms[i] for i in full] == [train.opt_norms[i] for i in full]
    # the windows of 1 that end each epoch leave their update to step(): their norm, from the same gradients
    torch.testing.assert_close(fused_norms, train.opt_norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(fused_norms[0], ref_norms[0], rtol=1e-5, atol=0)  # the same first gradients
    silent_model, _, _ = train(fused=True, clip=clip, ask_norm=False)  # the optimizer clips on its own
    assert_equal(params(fused_model), params(silent_model))
    assert max((params(fused_model)[n] - unfused_params[n]).abs().max().item() for n in ours) > 1e-4


def test_setup_hands_the_fp16_scaler_over(unclipped):
    results = []
    for fused in (True, False):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        # clipping configured, never reached; the loop asks for the norm with fused=True (accelerate's own
        # unscaling, which the fused=False norm needs, runs only with CUDA fp16)
        model, norms, opt = train(fused=fused, clip=1e4 if fused else None, opt_clip=1e4, scaler=scaler)
        assert opt.grad_scaler is (scaler if fused else None)
        if fused:  # the unscaled norm, the short windows' too
            torch.testing.assert_close(norms, unclipped[1], rtol=1e-5, atol=0)
        assert scaler.state_dict()["_growth_tracker"] == 6 and scaler.get_scale() == 2.0**12  # none skipped
        assert int(opt.num_skipped_updates) == 0
        results.append(params(model))
    assert_equal(*results)

    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")
    opt = fusedopt.AdamW(mlp().parameters(), fused=True, max_grad_norm=1.0, grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="grad_scaler is not the GradScaler the accelerator scales the loss with"):
        setup(accelerator, opt)


def test_without_setup_an_accumulation_mismatch_is_refused_at_the_first_backward():
    # accelerator.backward(loss), or loss.backward() inside accumulate (the Accelerator is not seen: accelerate's
    # GradientState says the backward only accumulates); an optimizer accumulating less or more than accelerate
    for direct, k in ((False, 1), (True, 1), (False, 4)):
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = mlp()
        forwards = []
        model.register_forward_hook(lambda module, args, out, seen=forwards: seen.append(1))
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, accumulation_steps=k, max_grad_norm=1.0)
        model, prepared, data = accelerator.prepare(model, opt, loader())
        before = params(model)
        with pytest.raises(RuntimeError, match=r"Accelerator\(gradient_accumulation_steps=2\)") as error:
            for x, y in data:
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward() if direct else accelerator.backward(loss)
                    prepared.step()
                    prepared.zero_grad()
        message = str(error.value)
        assert f"has accumulation_steps={k}:" in message and "Pass accumulation_steps=2" in message
        assert "fusedopt.integrations.accelerate.setup" in message
        assert len(forwards) == 1  # the first micro-batch
        assert_equal(params(model), before)
        assert not opt.state and all(p.grad is None for p in model.parameters())


def test_without_setup_a_releasing_optimizer_warns_once_that_clip_grad_norm_finds_nothing():
    with pytest.warns(UserWarning, match=r"not given to fusedopt.integrations.accelerate.setup") as record:
        _, norms, _ = train(fused=True, clip=1.0, set_up=False, steps=1, epochs=1)
    assert sum("setup(accelerator, optimizer)" in str(w.message) for w in record) == 1
    assert norms == [0.0] * 5  # what accelerate's own clip_grad_norm_ returns under release


def test_a_left_over_gradient_state_does_not_refuse_a_plain_loop():
    """accelerate's sync_gradients left False (a Trainer's loop stopped inside an accumulation window) with no
    accumulation configured: a plain loop of a releasing optimizer, accumulating on its own, is not refused;
    nor is one after a finished loop that accumulated."""
    accelerate.Accelerator(cpu=True)  # gradient_accumulation_steps=1
    GradientState()._set_sync_gradients(False)
    model = mlp()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, accumulation_steps=2, max_grad_norm=None)
    before = params(model)
    for i, (x, y) in enumerate(loader()):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    assert all(not torch.equal(p, before[n]) for n, p in params(model).items())

    # an Accelerator accumulating over 2 made earlier, its loop finished: a plain loop updating at every
    # backward (accumulation_steps=1) is not refused either
    accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    GradientState()._set_sync_gradients(True)
    model = mlp()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=None)
    before = params(model)
    for x, y in loader():
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(p, before[n]) for n, p in params(model).items())


def test_setup_and_routed_clipping_refuse_what_they_cannot_do():
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    with pytest.raises(TypeError, match="setup\\(\\) takes a fusedopt optimizer"):
        setup(accelerator, torch.optim.AdamW(mlp().parameters()))
    opt = fusedopt.AdamW(mlp().parameters(), fused=True, accumulation_steps=3, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"accumulation_steps=3 differs from Accelerator\(gradient_accumulation_steps"):
        setup(accelerator, opt)
    opt.remove_hooks()

    def clip_after_backward(fused, opt_clip, max_norm, params_of=None, norm_type=2):
        model = mlp()
        opt = fusedopt.AdamW(model.parameters(), fused=fused, max_grad_norm=opt_clip)
        setup(accelerator, opt)
        x = torch.randn(2, 8)
        for _ in range(2):  # the releasing update comes at the second backward
            accelerator.backward(model(x).square().mean())
        target = model.parameters() if params_of is None else params_of(model)
        try:
            return accelerator.clip_grad_norm_(target, max_norm, norm_type=norm_type)
        finally:
            opt.remove_hooks()

    assert float(clip_after_backward(True, 1.0, 1.0)) > 0  # as asked: the optimizer's norm
    assert float(clip_after_backward(True, 1.0, float("inf"))) > 0  # the norm only
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0: gradient release.*build it with max_grad_norm=0.5"):
        clip_after_backward(True, 1.0, 0.5)
    with pytest.raises(ValueError, match=r"max_grad_norm=None: gradient release.*build it with max_grad_norm=1.0"):
        clip_after_backward(True, None, 1.0)
    with pytest.raises(ValueError, match=r"would clip twice.*build it with max_grad_norm=0.5"):
        clip_after_backward(False, 1.0, 0.5)
    with pytest.raises(ValueError, match="part of a fusedopt optimizer's parameters"):
        clip_after_backward(True, 1.0, 1.0, params_of=lambda model: model[0].parameters())
    with pytest.raises(ValueError, match="norm_type=1"):
        clip_after_backward(True, 1.0, 1.0, norm_type=1)
    # fused=False without clipping in the optimizer: accelerate clips as usual
    assert float(clip_after_backward(False, None, 1.0)) > 0

    model = mlp()
    opt = fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=1.0)
    setup(accelerator, opt)
    with pytest.raises(ValueError, match="clip_grad_value_ of a fusedopt optimizer with fused=True"):
        accelerator.clip_grad_value_(model.parameters(), 0.1)


@pytest.mark.parametrize("free", [True, False])
def test_find_executable_batch_size_with_a_new_optimizer_at_each_try(free):
    """accelerate's retry on out of memory, the model built once and the optimizer at each try, as its memory
    example does (with ``accelerator.free_memory()`` first): batches above 4 run out of memory in backward
    after the head's update. Each dropped optimizer warns that its failed pass's 2 updates stay; the try at 4
    trains. Without ``free_memory()`` the accelerator still holds the old optimizer, whose hooks the new one
    would share: refused, naming ``free_memory()``."""
    from accelerate.utils import find_executable_batch_size

    accelerator = accelerate.Accelerator(cpu=True)
    model, tries = mlp(), []

    @find_executable_batch_size(starting_batch_size=8)
    def inner(batch_size):
        tries.append(batch_size)
        if free:
            accelerator.free_memory()
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=None)
        prepared_model, prepared, data = accelerator.prepare(model, opt, loader(n=32, batch=batch_size))
        setup(accelerator, prepared)
        for x, y in data:
            h = prepared_model[1](prepared_model[0](x))
            if len(x) > 4:
                OutOfMemory.armed = True
                h = OutOfMemory.apply(h)
            accelerator.backward(torch.nn.functional.mse_loss(prepared_model[2](h), y))
            prepared.step()
            prepared.zero_grad()
        return opt

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if not free:
            with pytest.raises(RuntimeError, match=r"accelerate's accelerator.free_memory\(\)"):
                inner()
            assert tries == [8, 7]  # refused at the second try (no out-of-memory error: no third)
            accelerator.free_memory()
            gc.collect()
            assert sum("was dropped" in str(w.message) for w in record) == 1  # try 8's optimizer, now dropped
            return
        opt = inner()
    assert tries == [8, 7, 6, 5, 4]
    dropped = [str(w.message) for w in record if "was dropped" in str(w.message)]
    assert len(dropped) == 4 and all("the 2 parameter update(s)" in m for m in dropped)
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [8] * 4


def test_importing_fusedopt_does_not_import_accelerate():
    code = "import sys, fusedopt, fusedopt.integrations; assert 'accelerate' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def train_llama(fused: bool, max_norm: float):
    """The accelerate loop on a tiny Llama: 8 micro-batches of 2 x 16 random tokens, 4 windows of 2;
    ``clip_grad_norm_`` at the optimizer's max_grad_norm. Returns the weights, the norms clip_grad_norm_
    returned (as tensors) and the optimizer's grad_norm after each step."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=fused, max_grad_norm=max_norm)
    model, prepared = accelerator.prepare(model, opt)
    assert setup(accelerator, prepared) is opt and opt.accumulation_steps == (2 if fused else 1)
    gen = torch.Generator().manual_seed(1)
    norms, opt_norms = [], []
    for _ in range(8):
        tokens = torch.randint(0, 64, (2, 16), generator=gen)
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm))
            prepared.step()
            if accelerator.sync_gradients:
                opt_norms.append(opt.grad_norm.clone())
            prepared.zero_grad()
    return params(model), torch.stack(norms), torch.stack(opt_norms)


LLAMA_CLIP = 0.5  # under half of every step's norm here (1.1 to 1.25): every step clips


def test_tiny_llama_clips_through_the_optimizer():
    """A tiny Llama in the accelerate loop with accumulation 2: fused=True's clip_grad_norm_ returns the
    optimizer's norm bit for bit (before clipping, above max_norm at every step) and the update was clipped.
    Unclipped, fused=True equals fused=False bit for bit; clipped, only the first step's norm is equal (the
    same gradients): under release the coefficient comes from a one-pass estimate of the global norm, the
    first step's from the part seen so far (docs/semantics.md, "Clipping"), so the weights are only close."""
    weights, norms, opt_norms = train_llama(fused=True, max_norm=LLAMA_CLIP)
    assert len(norms) == 4 and torch.equal(norms, opt_norms)  # the optimizer's norm of each step
    assert float(norms.min()) > LLAMA_CLIP  # every step clipped

    unclipped, unclipped_norms, _ = train_llama(fused=True, max_norm=1e4)
    unfused_unclipped, unfused_unclipped_norms, _ = train_llama(fused=False, max_norm=1e4)
    assert float(unclipped_norms.max()) < 1e4
    assert torch.equal(unclipped_norms, unfused_unclipped_norms)  # nothing clips: bit for bit
    assert_equal(unclipped, unfused_unclipped)
    assert torch.equal(norms[0], unclipped_norms[0])  # the same first gradients

    def distance(a, b):
        return sum(((a[n] - b[n]) ** 2).sum() for n in a).sqrt().item()

    initial = params(tiny_llama())
    travelled = distance(unclipped, initial)
    assert distance(weights, unclipped) > 0.05 * travelled  # clipping mattered (about 0.12 of it)

    unfused, unfused_norms, _ = train_llama(fused=False, max_norm=LLAMA_CLIP)
    assert float(unfused_norms.min()) > LLAMA_CLIP
    assert torch.equal(norms[0], unfused_norms[0])
    # later norms differ by the weights (measured: 1% at most)
    torch.testing.assert_close(norms, unfused_norms, rtol=0.03, atol=0)
    # measured 0.10 of the distance travelled; torch's exact clipping moves the weights by 0.02 of it
    assert distance(weights, unfused) < 0.2 * travelled
