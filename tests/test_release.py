"""Gradient release (fused=True): updates inside backward, freed gradients, accumulation, hooks."""

import gc
import weakref

import pytest
import torch
from cases import LOW_DTYPES, dtype_cases
from helpers import assert_params_equal, groups, inputs, loss_fn, make_model, spawned_rank, train, twins

import fusedopt


def test_update_happens_during_backward_and_frees_gradients():
    model, _ = twins()
    before = [p.clone() for p in model.parameters()]
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=32, fused=True)
    loss_fn(model, inputs(1)[0]).backward()
    for p, b in zip(model.parameters(), before):
        assert p.grad is None
        assert not torch.equal(p, b)  # already updated, before step()
    opt.step()
    for p in model.parameters():
        assert float(opt.state[p]["step"]) == 1


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("closure", [False, True])
def test_fused_accumulation_equals_unfused(k, closure):
    a, b = twins()
    oa = fusedopt.AdamW(groups(a, lr=3e-3), lr=1e-2, state_bits=32)
    ob = fusedopt.AdamW(groups(b, lr=3e-3), lr=1e-2, state_bits=32, fused=True, accumulation_steps=k)
    xs = inputs(4 * k)
    train(a, oa, xs, micro_batches=k, closure=closure)
    train(b, ob, xs, micro_batches=k, closure=closure)
    assert_params_equal(a, b)


def test_gradients_accumulate_until_the_kth_backward():
    model, _ = twins()
    _opt = fusedopt.SGD(model.parameters(), lr=0.1, momentum=0.9, state_bits=32, fused=True, accumulation_steps=3)
    before = [p.clone() for p in model.parameters()]
    xs = inputs(3)
    for x in xs[:2]:
        loss_fn(model, x).backward()
    for p, b in zip(model.parameters(), before):
        assert p.grad is not None and torch.equal(p, b)
    loss_fn(model, xs[2]).backward()
    for p, b in zip(model.parameters(), before):
        assert p.grad is None and not torch.equal(p, b)


def test_second_backward_before_step_is_an_error():
    model, _ = twins()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=32, fused=True)
    x = inputs(1)[0]
    loss_fn(model, x).backward()
    after_first = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="already applied"):
        loss_fn(model, x).backward()
    for p, q in zip(model.parameters(), after_first):
        assert torch.equal(p, q)  # never a silent double update
    opt.step()  # as the error says: the refused backward's gradient is not applied either
    for p, q in zip(model.parameters(), after_first):
        assert torch.equal(p, q)
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    loss_fn(model, x).backward()  # after step() a new window starts


def test_parameters_below_k_are_updated_by_step():
    """A parameter used in only some micro-batches never reaches k: step() updates it."""

    def run(fused):
        torch.manual_seed(0)
        trunk, head_a, head_b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 2), torch.nn.Linear(6, 2)
        params = [*trunk.parameters(), *head_a.parameters(), *head_b.parameters()]
        opt = fusedopt.AdamW(params, lr=1e-2, state_bits=32, fused=fused, accumulation_steps=3 if fused else 1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for micro in range(3):
                h = trunk(torch.randn(4, 6, generator=gen))
                out = head_b(h) if micro == 0 else head_a(h)
                out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return params

    for p, q in zip(run(False), run(True)):
        assert torch.equal(p, q)


def test_bf16_accumulation_keeps_contributions_below_one_ulp():
    """15 micro-batches adding 1e-3 to a gradient of 1.0: bf16 round-to-nearest loses them all."""
    k, n = 16, 8192

    def applied_gradient(fused):
        w = torch.nn.Parameter(torch.zeros(64, n // 64, dtype=torch.bfloat16))
        opt = fusedopt.SGD(
            [w], lr=1.0, state_bits=32, master_weight_bits=None, fused=fused, accumulation_steps=k if fused else 1
        )
        for micro in range(k):
            ((w.float() * (1.0 if micro == 0 else 1e-3)).sum()).backward()
        opt.step()
        return -w.float().mean().item()  # p = 0 - lr * g, stochastically rounded: mean = g

    assert applied_gradient(False) == pytest.approx(1.0, abs=1e-6)  # torch's bf16 accumulation
    assert applied_gradient(True) == pytest.approx(1.015, rel=2e-3)


@pytest.mark.parametrize("dtype", dtype_cases(*LOW_DTYPES))  # the dtypes accumulated by the optimizer
def test_chunked_accumulation_equals_one_whole_rounding(monkeypatch, dtype):
    """The accumulation runs in chunks (bounded temporaries) and in place, with the same bits as
    rounding the whole tensor at once: element i always draws the hash of index i."""
    from fusedopt import reference, rng
    from fusedopt.rounding import round_stochastic

    gen = torch.Generator().manual_seed(5)
    buffer = (torch.randn(37, 29, generator=gen) * 1e-2).to(dtype)
    grad = (torch.randn(37, 29, generator=gen) * 1e-4).to(dtype)
    step = torch.tensor(3.0)
    key = rng.host_key(7, 2, rng.STREAM_GRAD_ACCUM + 1)
    whole = round_stochastic(buffer.float() + grad.float(), rng.uniform_bits(key, step, grad.shape, grad.device), dtype)
    monkeypatch.setattr(reference, "ACCUMULATION_CHUNK", 100)  # 1073 elements: 11 chunks, the last partial
    target = buffer.clone()
    out = reference.accumulate_low_precision(target, grad, seed=7, index=2, micro_batch=1, step=step)
    assert out is target  # in place
    assert torch.equal(out, whole)
    assert not torch.equal(out, buffer)  # the gradient did land


def test_hooks_survive_load_state_dict_add_param_group_and_schedulers():
    a, b = twins()
    extra_a = torch.nn.Parameter(torch.randn(4, 4))
    extra_b = torch.nn.Parameter(extra_a.detach().clone())
    oa = fusedopt.AdamW(groups(a), lr=1e-2, state_bits=32)
    ob = fusedopt.AdamW(groups(b), lr=1e-2, state_bits=32, fused=True)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.5)
    xs = inputs(12)

    def run(model, opt, sched, extra, x):
        (loss_fn(model, x) + (extra * x[:, :4]).sum()).backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    for x in xs[:3]:
        run(a, oa, sa, extra_a, x)
        run(b, ob, sb, extra_b, x)
    ob.load_state_dict(ob.state_dict())  # replaces the group dicts
    oa.load_state_dict(oa.state_dict())
    oa.add_param_group({"params": [extra_a], "lr": 5e-3})
    ob.add_param_group({"params": [extra_b], "lr": 5e-3})
    for x in xs[3:]:
        run(a, oa, sa, extra_a, x)
        run(b, ob, sb, extra_b, x)
    assert_params_equal(a, b)
    assert torch.equal(extra_a, extra_b)
    assert ob.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**6)
    # still releasing: after a backward every gradient is gone
    (loss_fn(b, xs[0]) + extra_b.sum()).backward()
    assert all(p.grad is None for p in [*b.parameters(), extra_b])


def test_remove_hooks_falls_back_to_unfused():
    model, _ = twins()
    opt = fusedopt.AdamW(model.parameters(), state_bits=32, fused=True)
    opt.remove_hooks()
    before = [p.clone() for p in model.parameters()]
    loss_fn(model, inputs(1)[0]).backward()
    for p, b in zip(model.parameters(), before):
        assert p.grad is not None and torch.equal(p, b)
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert not torch.equal(p, b)


def test_one_live_releasing_optimizer_per_parameter():
    model = make_model()
    first = fusedopt.AdamW(model.parameters(), state_bits=32, fused=True)
    with pytest.raises(RuntimeError, match="already carries the gradient-release hook"):
        fusedopt.AdamW(model.parameters(), state_bits=32, fused=True)
    fusedopt.AdamW(model.parameters(), state_bits=32)  # an unfused one is fine
    first.remove_hooks()
    second = fusedopt.AdamW(model.parameters(), state_bits=32, fused=True)
    del second
    gc.collect()
    fusedopt.AdamW(model.parameters(), state_bits=32, fused=True)  # the collected one let go


def test_optimizer_and_model_can_be_garbage_collected():
    model = make_model()
    opt = fusedopt.AdamW(model.parameters(), state_bits=32, fused=True)
    train(model, opt, inputs(2))
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    kept = model  # the model outlives the optimizer: its hooks must go with the optimizer
    del opt
    gc.collect()
    assert opt_ref() is None
    loss_fn(kept, inputs(1)[0]).backward()
    assert all(p.grad is not None for p in kept.parameters())  # nothing releases any more
    del kept, model
    gc.collect()
    assert model_ref() is None


@pytest.mark.parametrize("fused", [False, True])
def test_non_finite_gradient_skips_that_parameter_only(fused):
    model, _ = twins()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=32, fused=fused)
    train(model, opt, inputs(2))
    snapshot = {p: (p.clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in model.parameters()}
    poisoned = model[2].weight
    handle = poisoned.register_hook(lambda g: torch.where(torch.rand_like(g) < 0.1, float("nan"), g))
    loss_fn(model, inputs(1, seed=9)[0]).backward()
    opt.step()
    handle.remove()
    assert int(opt.num_skipped_updates) == 1
    value, state = snapshot[poisoned]
    assert torch.equal(poisoned, value)
    for k, v in state.items():
        assert torch.equal(opt.state[poisoned][k], v), k
    for p in model.parameters():
        assert torch.isfinite(p).all()
        if p is not poisoned:
            assert not torch.equal(p, snapshot[p][0])
            assert float(opt.state[p]["step"]) == 3
        if fused:
            assert p.grad is None  # the skipped parameter's gradient is freed too
    opt.zero_grad()
    loss_fn(model, inputs(1, seed=9)[0]).backward()
    opt.step()
    assert not torch.equal(poisoned, value)  # and it trains again once gradients are finite
    assert int(opt.num_skipped_updates) == 1


def test_inf_gradient_is_skipped_for_bf16_state():
    w = torch.nn.Parameter(torch.randn(64, 80))
    opt = fusedopt.AdamW([w], state_bits=16, fused=True)
    before = w.clone()
    (w * float("inf")).sum().backward()
    assert torch.equal(w, before) and w.grad is None
    assert int(opt.num_skipped_updates) == 1
    assert float(opt.state[w]["step"]) == 0


def test_zero_grad_during_accumulation_drops_held_gradients():
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    opt = fusedopt.SGD([w], lr=1.0, state_bits=32, master_weight_bits=None, fused=True, accumulation_steps=2)
    w.float().sum().backward()  # held by the optimizer (bf16 accumulation buffer)
    assert w.grad is None
    with pytest.raises(RuntimeError, match="unfinished gradient accumulation"):
        opt.state_dict()
    opt.zero_grad()
    before = w.clone()
    opt.step()  # nothing left to apply
    assert torch.equal(w, before)
    opt.state_dict()  # and nothing left to lose


def _pretend_processes(monkeypatch, n):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args, **kwargs: n)


def test_release_is_refused_when_several_processes_train_together(monkeypatch):
    model = make_model()
    _pretend_processes(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="process group of 2 processes.*DistributedDataParallel.*fully_shard"):
        fusedopt.AdamW(model.parameters(), fused=True)
    train(model, fusedopt.AdamW(model.parameters()), inputs(1))  # fused=False is fine
    _pretend_processes(monkeypatch, 1)
    fusedopt.AdamW(model.parameters(), fused=True).remove_hooks()  # so is one process
    _pretend_processes(monkeypatch, 2)
    monkeypatch.setenv("FUSEDOPT_ALLOW_DISTRIBUTED_RELEASE", "1")
    opt = fusedopt.AdamW(model.parameters(), fused=True)  # the user says no gradient is reduced
    before = [p.clone() for p in model.parameters()]
    loss_fn(model, inputs(1)[0]).backward()
    assert all(p.grad is None and not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.remove_hooks()


def test_a_process_group_started_after_construction_stops_the_first_hook(monkeypatch):
    model = make_model()
    opt = fusedopt.AdamW(model.parameters(), fused=True)
    _pretend_processes(monkeypatch, 4)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="process group of 4 processes"):
        loss_fn(model, inputs(1)[0]).backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # nothing was updated
    assert not opt.state


def _construct_in_group(rank, world_size, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    with spawned_rank():
        model = torch.nn.Linear(4, 3)
        try:
            fusedopt.AdamW(model.parameters(), fused=True)
            message = "constructed"
        except RuntimeError as exc:
            message = str(exc)
        with open(f"{out_dir}/rank{rank}.txt", "w") as f:
            f.write(message)


def test_release_is_refused_in_a_real_two_process_group(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_construct_in_group, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert "process group of 2 processes" in (tmp_path / f"rank{rank}.txt").read_text()


def test_a_layer_used_twice_under_non_reentrant_checkpointing_is_updated_once():
    """One Linear applied twice, each time under checkpoint(use_reentrant=False): its hook fires
    once per backward, with the whole gradient, so fused=True equals fused=False bit for bit."""
    from torch.utils.checkpoint import checkpoint

    def run(fused):
        torch.manual_seed(0)
        shared, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        params = [*shared.parameters(), *head.parameters()]
        opt = fusedopt.AdamW(params, lr=1e-2, state_bits=32, fused=fused)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 8, generator=gen)
            h = checkpoint(shared, x, use_reentrant=False)
            h = checkpoint(shared, torch.tanh(h), use_reentrant=False)
            head(h).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return params, opt

    (ours, opt), (theirs, _) = run(True), run(False)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert all(int(opt.state[p]["step"]) == 3 for p in ours)
