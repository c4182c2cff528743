"""fp16 loss scaling with ``torch.amp.GradScaler`` (``fusedopt/loss_scaling.py``), on the CPU scaler.

The scale is a power of two, so unscaling is exact in fp32: a scaled run without overflow must equal
the unscaled run bit for bit. ``fused=True`` (with ``grad_scaler=``) must equal ``fused=False``; an
overflow skips the parameter holding it and makes the scaler back off in both modes; a scaler the
releasing optimizer does not know is refused at the first ``step()``."""

import pytest
import torch
from cases import format_cases
from helpers import inputs, loss_fn, make_model

import fusedopt


def _run(*, fused, scaler=None, register=True, steps=5, overflow_at=None, max_grad_norm=None, **options):
    model = make_model(seed=0)
    opt = fusedopt.AdamW(
        model.parameters(),
        lr=1e-2,
        fused=fused,
        max_grad_norm=max_grad_norm,
        grad_scaler=scaler if (fused and register) else None,
        **options,
    )
    scales = []
    for step, x in enumerate(inputs(steps)):
        loss = loss_fn(model, x)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            if step == overflow_at:  # an inf in the first layer's weight gradient only
                model[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("inf")))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if step == overflow_at:
                model[0].weight._backward_hooks.clear()
        opt.zero_grad()
    return model, opt, scales


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_scaled_run_equals_the_unscaled_run(fused):
    plain, _, _ = _run(fused=fused, state_bits=32)
    scaled, _, scales = _run(fused=fused, scaler=_scaler(), state_bits=32)
    assert scales[-1] > 2.0**12  # the scale grew: the steps were taken as unskipped
    for p, q in zip(plain.parameters(), scaled.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fmt", format_cases())
def test_fused_true_with_a_scaler_equals_fused_false_with_a_scaler(fmt):
    a, opt_a, scales_a = _run(fused=False, scaler=_scaler(), **fmt.kwargs)
    b, opt_b, scales_b = _run(fused=True, scaler=_scaler(), **fmt.kwargs)
    assert scales_a == scales_b
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_an_overflow_skips_its_parameter_and_the_scaler_backs_off(fused):
    model, opt, scales = _run(fused=fused, scaler=_scaler(), steps=3, overflow_at=2, state_bits=32)
    reference, _, _ = _run(fused=fused, scaler=_scaler(), steps=2, state_bits=32)
    assert scales[-1] == scales[-2] * 0.5  # backed off at the overflowing step
    assert int(opt.num_skipped_updates) == 1
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # the first layer's weight kept its value of two steps; everything else took the third step
        assert torch.equal(p, q) == (name == "0.weight"), name


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_clipping_sees_unscaled_gradients(fused):
    plain, opt_plain, _ = _run(fused=fused, max_grad_norm=0.05, state_bits=32)
    scaled, opt_scaled, _ = _run(fused=fused, scaler=_scaler(), max_grad_norm=0.05, state_bits=32)
    assert torch.equal(opt_plain.grad_norm, opt_scaled.grad_norm)
    assert float(opt_plain.grad_norm) > 0.05  # it clipped
    for p, q in zip(plain.parameters(), scaled.parameters()):
        assert torch.equal(p, q)


def test_a_scaler_unknown_to_a_releasing_optimizer_is_refused_at_the_first_step():
    with pytest.raises(RuntimeError, match="Pass grad_scaler=scaler to the optimizer"):
        _run(fused=True, scaler=_scaler(), register=False, steps=1)


def test_a_registered_scaler_needs_scaler_step_while_gradients_wait():
    """Accumulation leaves gradients for step(); stepping directly would update them scaled."""
    model = make_model(seed=0)
    scaler = _scaler()
    opt = fusedopt.AdamW(model.parameters(), fused=True, accumulation_steps=2, grad_scaler=scaler)
    scaler.scale(loss_fn(model, inputs(1)[0])).backward()
    with pytest.raises(RuntimeError, match=r"call scaler.step\(optimizer\)"):
        opt.step()


def test_a_registered_scaler_that_never_scaled_is_named():
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), fused=True, grad_scaler=_scaler())  # alive: its hooks stay
    with pytest.raises(RuntimeError, match="grad_scaler has no scale yet"):
        loss_fn(model, inputs(1)[0]).backward()
    assert opt.grad_scaler is not None


def test_grad_scaler_must_be_a_grad_scaler():
    with pytest.raises(ValueError, match="Invalid grad_scaler"):
        fusedopt.AdamW(make_model().parameters(), fused=True, grad_scaler=2.0)
