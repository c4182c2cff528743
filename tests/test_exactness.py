"""Exact state (state_bits=32) on fp32 parameters is the torch algorithm itself.

AdamW equals torch.optim.AdamW and SGD equals torch.optim.SGD to fp32 round-off
(rtol 1e-5, atol 1e-7, the README's exactness promise), over many steps, with several parameter groups, in both
``fused`` modes; Lion equals the published update written out here. Every moment is
compared too, not just the parameters.
"""

import pytest
import torch
from cases import algorithm_cases, cross, dtype_cases, format_cases
from helpers import assert_params_close, groups, inputs, loss_fn, train, twins

import fusedopt

N_STEPS = 40


def _compare_state(ref_opt, opt, keys):
    pairs = list(
        zip((p for g in ref_opt.param_groups for p in g["params"]), (p for g in opt.param_groups for p in g["params"]))
    )
    assert len(pairs) == 5  # make_model's parameters: none left out of the comparison
    for p_ref, p in pairs:
        for key in keys:
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[p_ref][key], rtol=1e-5, atol=1e-7)
        # every step counted (torch.optim.SGD keeps no step: then N_STEPS alone is the reference)
        assert float(opt.state[p]["step"]) == N_STEPS
        if "step" in ref_opt.state[p_ref]:
            assert float(ref_opt.state[p_ref]["step"]) == N_STEPS


ADAMW_CASES = [
    dict(),
    dict(weight_decay=0.1, betas=(0.8, 0.99)),
    dict(maximize=True, eps=1e-6),
    dict(lr=1e-2, weight_decay=0.0),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kwargs", ADAMW_CASES)
def test_adamw_equals_torch(fused, kwargs):
    ref_model, model = twins()
    second = dict(lr=3e-3, weight_decay=0.05, betas=(0.85, 0.98))
    ref = torch.optim.AdamW(groups(ref_model, **second), **{"lr": 5e-3, **kwargs})
    opt = fusedopt.AdamW(groups(model, **second), **{"lr": 5e-3, **kwargs}, state_bits=32, fused=fused)
    xs = inputs(N_STEPS)
    train(ref_model, ref, xs)
    train(model, opt, xs)
    assert_params_close(ref_model, model)
    _compare_state(ref, opt, ["exp_avg", "exp_avg_sq"])
    # the trajectory really moved (a no-op optimizer would also "match" a no-op reference)
    assert not torch.equal(model[0].weight, twins()[0][0].weight)


SGD_CASES = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(momentum=0.8, nesterov=True, weight_decay=0.02),
    dict(momentum=0.9, maximize=True),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_equals_torch(fused, kwargs):
    ref_model, model = twins()
    second = dict(lr=2e-2, weight_decay=0.03)
    ref = torch.optim.SGD(groups(ref_model, **second), **{"lr": 5e-2, **kwargs})
    opt = fusedopt.SGD(groups(model, **second), **{"lr": 5e-2, **kwargs}, state_bits=32, fused=fused)
    xs = inputs(N_STEPS)
    train(ref_model, ref, xs)
    train(model, opt, xs)
    assert_params_close(ref_model, model)
    if kwargs.get("momentum"):
        _compare_state(ref, opt, ["momentum_buffer"])


def _lion_published(params, grads_per_step, lr, betas, weight_decay):
    """Lion as published (Chen et al. 2023, Algorithm 2), one tensor at a time, in fp64."""
    params = [p.detach().double().clone() for p in params]
    moments = [torch.zeros_like(p) for p in params]
    beta1, beta2 = betas
    for grads in grads_per_step:
        for p, m, g in zip(params, moments, grads):
            g = g.double()
            update = (beta1 * m + (1 - beta1) * g).sign()
            p.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)
            m.mul_(beta2).add_(g, alpha=1 - beta2)
    return params


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_lion_equals_published_update(fused, weight_decay):
    # Gradients are fixed per step (independent of the trajectory) so the fp64 reference and
    # the fp32 optimizer see the same inputs; sign() makes the update exact up to the decay.
    gen = torch.Generator().manual_seed(3)
    shapes = [(17, 9), (33,), (5, 3)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(N_STEPS)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = fusedopt.Lion(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay, state_bits=32, fused=fused)
    for step_grads in grads:
        loss = sum((p * g).sum() for p, g in zip(params, step_grads))
        loss.backward()
        opt.step()
        opt.zero_grad()
    expected = _lion_published(init, grads, 1e-3, (0.9, 0.99), weight_decay)
    for p, e, start in zip(params, expected, init):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-7)
        assert not torch.equal(p.detach(), start)


def test_lion_maximize_negates_the_gradient():
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(6, 5, generator=gen)
    g = torch.randn(6, 5, generator=gen)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oa = fusedopt.Lion([a], lr=1e-2, state_bits=32, maximize=True)
    ob = fusedopt.Lion([b], lr=1e-2, state_bits=32)
    for _ in range(5):
        (a * g).sum().backward()
        (b * -g).sum().backward()
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    assert torch.equal(a, b)
    assert not torch.equal(a, w0)


@pytest.mark.parametrize("algo,fmt,dtype", cross(algorithm_cases(), format_cases(), dtype_cases()))
def test_fused_and_unfused_are_bit_identical(algo, fmt, dtype):
    """One algorithm, one hash: release mode changes when the update runs, not what it computes."""
    a, b = twins(dtype=dtype)
    kwargs = dict(lr=1e-2, master_weight_bits=None, min_compress_numel=0, seed=7, **fmt.kwargs)
    oa = algo.make(a.parameters(), fused=False, **kwargs)
    ob = algo.make(b.parameters(), fused=True, **kwargs)
    xs = inputs(8, dtype=dtype)
    train(a, oa, xs)
    train(b, ob, xs)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        assert oa.state[pa].keys() == ob.state[pb].keys()
        assert {key.split(".")[0] for key in oa.state[pa]} == {"step", *algo.slots_of(pa.shape)}  # all compared
        for key in oa.state[pa]:
            assert torch.equal(oa.state[pa][key], ob.state[pb][key]), key
    assert not torch.equal(a[0].weight, twins(dtype=dtype)[0][0].weight)


def test_step_is_a_noop_without_gradients_and_for_frozen_params():
    model, _ = twins()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.clone()
    opt = fusedopt.AdamW(model.parameters(), state_bits=32)
    before = [p.clone() for p in model.parameters()]
    opt.step()  # no gradients at all
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    loss_fn(model, inputs(1)[0]).backward()
    opt.step()
    assert torch.equal(model[0].weight, frozen)
    assert model[0].weight not in opt.state
    assert not torch.equal(model[2].weight, before[2])


def test_zero_size_and_scalar_parameters():
    empty = torch.nn.Parameter(torch.randn(0, 4))
    scalar = torch.nn.Parameter(torch.tensor(1.5))
    ref_scalar = torch.nn.Parameter(torch.tensor(1.5))
    opt = fusedopt.AdamW([empty, scalar], lr=0.1, state_bits=32)
    ref = torch.optim.AdamW([ref_scalar], lr=0.1)
    for _ in range(3):
        (empty.sum() + scalar**2).backward()
        (ref_scalar**2).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    torch.testing.assert_close(scalar, ref_scalar, rtol=1e-5, atol=1e-7)
    assert empty.shape == (0, 4)
    assert float(opt.state[empty]["step"]) == 3


def test_global_rng_is_untouched_and_runs_are_reproducible():
    def run(seed, check_rng=False):
        model, _ = twins(dtype=torch.bfloat16)  # nn.Linear's init draws from the global RNG
        xs = inputs(4, dtype=torch.bfloat16)
        opt = fusedopt.AdamW(
            model.parameters(), state_bits=16, master_weight_bits=None, min_compress_numel=0, seed=seed
        )
        rng_before = torch.get_rng_state()
        train(model, opt, xs)
        if check_rng:
            assert torch.equal(torch.get_rng_state(), rng_before)
        return [p.clone() for p in model.parameters()]

    first = run(0, check_rng=True)
    torch.manual_seed(1234)  # a different global seed changes nothing
    again = run(0)
    other = run(1)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert any(not torch.equal(x, y) for x, y in zip(first, other))


def test_loss_goes_down_with_lr_scheduler():
    model, _ = twins()
    opt = fusedopt.AdamW(groups(model, lr=1e-2), lr=2e-2, state_bits=16, min_compress_numel=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    x = inputs(1)[0]
    first = loss_fn(model, x).item()
    for _ in range(30):
        loss_fn(model, x).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert loss_fn(model, x).item() < first
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-2 * 0.5**6)
