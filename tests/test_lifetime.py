"""An optimizer's lifetime: dropping it frees it at once, and copies of it are refused.

The parts of an optimizer (state store, update dispatcher, gradient pipeline, gradient release)
refer to it weakly: a dropped optimizer is freed when its last reference goes, not when Python's
cycle collector next runs. Until then a ``fused=True`` one would keep updating the model inside
backward, and a new one on the same parameters (a retry after an out-of-memory error) would be
refused. The tests run with the cycle collector off, so that only reference counting frees anything.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import pickle
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
from helpers import inputs, loss_fn, make_model, save_load, train

import fusedopt

ALGORITHMS = ["AdamW", "SGD", "Lion", "Adafactor"]


def _make(name: str, params, fused: bool, **kwargs):
    extra = {"momentum": 0.9} if name == "SGD" else {}
    return getattr(fusedopt, name)(params, fused=fused, max_grad_norm=1.0, **extra, **kwargs)


@contextlib.contextmanager
def _reference_counting_only():
    """The cycle collector off: what is freed is freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises as an out-of-memory error would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("simulated out of memory in backward")


def _failing_loss(model, x):
    """``loss_fn`` with a failure between the model's layers: backward reaches the second layer and the
    extra parameter (their release hooks run), then fails before the first layer's gradients."""
    hidden = _FailingBackward.apply(model[1](model[0](x)))
    out = model[2](hidden)
    return (out.float() ** 2).mean() + (model.extra.float() @ out.t().float()).sin().mean()


def _assert_no_optimizer_hooks(model) -> None:
    """A backward leaves every gradient in place and updates nothing: no release hook runs."""
    model.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, inputs(1, seed=7, dtype=model[0].weight.dtype)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    model.zero_grad(set_to_none=True)


def _assert_a_new_releasing_optimizer_trains(model, **kwargs) -> None:
    """A new fused=True optimizer can take the parameters over, and updates them inside backward; once
    dropped, it is freed at once too."""
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=1.0, **kwargs)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, inputs(1, seed=8, dtype=model[0].weight.dtype)[0]).backward()
    assert all(p.grad is None for p in model.parameters())  # released
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()
    opt.zero_grad()
    ref = weakref.ref(opt)
    del opt
    assert ref() is None


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_dropped_optimizer_is_freed_at_once_and_takes_its_hooks_with_it(name, fused):
    model = make_model()
    with _reference_counting_only():
        opt = _make(name, model.parameters(), fused)
        train(model, opt, inputs(2))
        ref = weakref.ref(opt)
        del opt
        assert ref() is None
        _assert_no_optimizer_hooks(model)
        _assert_a_new_releasing_optimizer_trains(model)


def test_the_first_optimizer_of_a_process_is_freed_at_once():
    """torch's first optimizer of a process imports torch._dynamo, which leaves a cycle through its
    callers' frames: a fresh process, the cycle collector off from the start."""
    code = """
import gc, weakref
gc.disable()
import torch, fusedopt
model = torch.nn.Linear(8, 4)
opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=None)
ref = weakref.ref(opt)
del opt
assert ref() is None, "the first optimizer outlived del"
model(torch.randn(3, 8)).square().mean().backward()
assert all(p.grad is not None for p in model.parameters()), "a dropped optimizer's hook released a gradient"
fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=None)  # takes the parameters over
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_optimizer_dropped_after_a_failed_backward_is_freed_at_once(name, fused):
    """A retry after an out-of-memory error in backward: drop the optimizer, build a new one."""
    model = make_model()
    with _reference_counting_only():
        opt = _make(name, model.parameters(), fused)
        train(model, opt, inputs(1))
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            _failing_loss(model, inputs(1, seed=5)[0]).backward()
        assert model[0].weight.grad is None  # backward stopped before the first layer
        ref = weakref.ref(opt)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            del opt
        assert ref() is None
        # a releasing optimizer says what its unclosed failed step left in the parameters
        assert sum("was dropped" in str(w.message) for w in record) == int(fused)
        _assert_no_optimizer_hooks(model)
        _assert_a_new_releasing_optimizer_trains(model)


def test_a_dropped_optimizer_is_freed_at_once_after_accumulation_scaling_and_a_checkpoint():
    """The parts that only some settings use: accumulation buffers, a GradScaler's record, a loaded
    checkpoint (its state converted to another format), an update hook."""
    model = make_model(dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    xs = inputs(4, dtype=torch.bfloat16)
    with _reference_counting_only():
        opt = fusedopt.AdamW(
            model.parameters(), fused=True, max_grad_norm=1.0, accumulation_steps=2, grad_scaler=scaler
        )
        handle = opt.register_update_hook(contextlib.nullcontext)
        for x in xs:
            scaler.scale(loss_fn(model, x)).backward()
            if opt.held_gradients():
                continue  # the first micro-batch of two
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        saved = save_load(opt.state_dict())
        saved["param_groups"][0]["state_bits"] = 16  # converted as it loads
        opt.load_state_dict(saved)
        ref = weakref.ref(opt)
        del opt
        assert ref() is None
        handle.remove()  # (a handle outliving its optimizer is harmless)
        _assert_no_optimizer_hooks(model)
        _assert_a_new_releasing_optimizer_trains(model)


def _bucketable_model():
    """Sizes the kernel's buckets take (multiples of 16 elements), in ``loss_fn``'s layout."""
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    model.extra = torch.nn.Parameter(torch.randn(16, 5, generator=gen))
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def test_a_dropped_optimizer_with_held_bucketed_kernel_updates_is_freed_at_once(monkeypatch):
    """The kernel path: prepared launches, built buckets, updates held for a bucket when backward fails."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    model = _bucketable_model()
    with _reference_counting_only():
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=1.0, min_compress_numel=0)
        train(model, opt, inputs(3))
        assert opt._dispatch._built  # updates ran in buckets
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            _failing_loss(model, inputs(1, seed=5)[0]).backward()
        ref = weakref.ref(opt)
        with pytest.warns(UserWarning, match="was dropped"):
            del opt
        assert ref() is None
        _assert_no_optimizer_hooks(model)
        _assert_a_new_releasing_optimizer_trains(model, min_compress_numel=0)


# --- copies --------------------------------------------------------------------------------


def _torch_save(opt):
    torch.save(opt, io.BytesIO())


COPIES = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps, "torch.save": _torch_save}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("how", list(COPIES))
def test_copying_or_pickling_an_optimizer_is_refused_naming_state_dict(how, fused):
    model = make_model()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=fused, max_grad_norm=1.0)
    train(model, opt, inputs(1))
    with pytest.raises(TypeError, match=r"cannot be copied or pickled .* Save optimizer\.state_dict\(\)"):
        COPIES[how](opt)
    # the way that works: the state dict, loaded into a new optimizer on the model
    saved = save_load(opt.state_dict())
    del opt
    fresh = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=fused, max_grad_norm=1.0)
    fresh.load_state_dict(saved)
    train(model, fresh, inputs(1))
    assert float(fresh.state[model[0].weight]["step"]) == 2


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_refuses_a_copy(name):
    opt = _make(name, make_model().parameters(), False)
    with pytest.raises(TypeError, match=rf"fusedopt\.{name} optimizer cannot be copied"):
        copy.deepcopy(opt)


def test_a_dropped_optimizer_is_freed_at_once_while_a_framework_is_imported():
    """With accelerate imported, release's first hook looks for the framework driving it (its frames):
    that look must leave no reference behind."""
    pytest.importorskip("accelerate.state")
    model = make_model()
    with _reference_counting_only():
        opt = _make("AdamW", model.parameters(), True)
        train(model, opt, inputs(2))
        ref = weakref.ref(opt)
        del opt
        assert ref() is None
        _assert_no_optimizer_hooks(model)
