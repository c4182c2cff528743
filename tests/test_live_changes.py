"""Changes made to a live optimizer: settings, ``p.data`` and ``param_groups`` edited between steps.

What fusedopt cannot apply is refused before anything is written (parameters, state, step
counts, release counts stay as they were, and training goes on once the change is undone);
what torch.optim follows (reordered or removed groups) is followed.
"""

import pytest
import torch

import fusedopt


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8)).to(dtype)


def _backward(model):
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(1), dtype=next(model.parameters()).dtype)
    model(x).float().square().mean().backward()


def _snapshot(params, opt):
    """Each parameter's value and state, to compare with later (``_assert_unchanged``)."""
    return {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params}


def _assert_unchanged(opt, snapshot, params=None):
    for p in snapshot if params is None else params:
        value, state = snapshot[p]
        assert p.dtype == value.dtype and torch.equal(p, value)
        assert opt.state[p].keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in opt.state[p].items())


def _set_group(opt, key, value):
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    return lambda: opt.param_groups[0].__setitem__(key, old)


def _set_data(params, make):
    params = list(params)
    old = [p.data for p in params]
    for p in params:
        p.data = make(p.data)

    def undo():
        for p, data in zip(params, old):
            p.data = data
            if p.grad is not None and p.grad.shape != p.shape:
                p.grad = None  # the refused backward's, for the changed parameter

    return undo


# (optimizer, its options, parameter dtype, the change (returns its undo), what the error says)
LIVE_CHANGES = {
    "master_weight_bits None -> 24": (
        fusedopt.AdamW,
        dict(master_weight_bits=None),
        torch.bfloat16,
        lambda model, opt: _set_group(opt, "master_weight_bits", 24),
        "has no 'master_correction'",
    ),
    "master_weight_bits 24 -> None": (
        fusedopt.AdamW,
        dict(master_weight_bits=24),
        torch.bfloat16,
        lambda model, opt: _set_group(opt, "master_weight_bits", None),
        "holds a master_correction that master_weight_bits=None does not keep",
    ),
    "state_bits 8 -> 4": (
        fusedopt.AdamW,
        dict(),
        torch.bfloat16,
        lambda model, opt: _set_group(opt, "state_bits", 4),
        r"holds 'exp_avg.codes' as torch.uint8 \(\d+, \d+\), not torch.uint8 \(\d+,\)",
    ),
    "SGD momentum 0 -> 0.9": (
        fusedopt.SGD,
        dict(momentum=0.0),
        torch.float32,
        lambda model, opt: _set_group(opt, "momentum", 0.9),
        "has no 'momentum_buffer.*or momentum, changed",
    ),
    "model cast to bf16": (
        fusedopt.AdamW,
        dict(),
        torch.float32,
        lambda model, opt: _set_data(model.parameters(), lambda t: t.bfloat16()),
        "torch.bfloat16 parameter of shape .* has no 'master_correction'",
    ),
    "parameter of another shape": (  # a bias (40,) made (1, 40): the forward still broadcasts it
        fusedopt.AdamW,
        dict(state_bits=32),
        torch.float32,
        lambda model, opt: _set_data([model[0].bias], lambda t: t[None]),
        r"holds 'exp_avg' as torch.float32 \(40,\), not torch.float32 \(1, 40\)",
    ),
}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("change", list(LIVE_CHANGES))
def test_a_change_the_state_cannot_follow_is_refused_before_anything_is_written(change, fused):
    opt_cls, options, dtype, make_change, match = LIVE_CHANGES[change]
    model = _model(dtype)
    opt = opt_cls(model.parameters(), lr=1e-2, min_compress_numel=0, fused=fused, **options)
    _backward(model)
    opt.step()
    opt.zero_grad()
    snapshot = _snapshot(model.parameters(), opt)
    undo = make_change(model, opt)
    with pytest.raises(ValueError, match=match):  # fused=True: from backward's hook
        _backward(model)
        opt.step()
    undo()
    refused = [p for p in model.parameters() if torch.equal(p, snapshot[p][0])]
    if fused:
        # Gradient release updates each parameter as its gradient comes: those before the refused
        # one were updated; the refused one is untouched, and the backward pass stopped there
        # (docs/semantics.md, "Failed steps"): its gradient is dropped with the step it failed.
        assert refused and all(p.grad is None for p in model.parameters())
        _assert_unchanged(opt, snapshot, refused)
        with pytest.warns(UserWarning, match="stopped early"):
            opt.step()  # closes the failed step: nothing of it is applied
        _assert_unchanged(opt, snapshot, refused)
    else:
        _assert_unchanged(opt, snapshot)  # no parameter, state or step count of either layer
        opt.step()  # the refused step's gradients are still there: applied now
    opt.zero_grad()
    _backward(model)  # fused=True: the refused gradient was not counted as this backward's
    opt.step()
    assert all(not torch.equal(p, snapshot[p][0]) for p in model.parameters())
    assert all(int(opt.state[p]["step"]) > 1 for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True])
def test_a_refused_group_stops_the_whole_step(fused):
    """Group 1's state cannot be read: group 0, listed first, is not updated either (a retry would
    otherwise update it twice from one gradient)."""
    model = _model()
    opt = fusedopt.AdamW(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], min_compress_numel=0, fused=fused
    )
    _backward(model)
    opt.step()
    opt.zero_grad()
    snapshot = _snapshot(model.parameters(), opt)
    opt.param_groups[1]["state_bits"] = 4
    with pytest.raises(ValueError, match="group's state_bits"):
        _backward(model)
        opt.step()
    if not fused:  # fused=True updates parameters as their gradients come: group 0's came later
        _assert_unchanged(opt, snapshot)
    opt.param_groups[1]["state_bits"] = 8
    if fused:  # the refused backward stopped at group 1's weight (its bias keeps fp32 moments: updated)
        with pytest.warns(UserWarning, match="stopped early.*; 1 parameter update"):
            opt.step()
    else:
        opt.step()  # the gradients are still there: step() applies them
    opt.zero_grad()
    _backward(model)
    opt.step()
    # fused=False: step 1, the refused one (retried), step 3. fused=True: step 1, the failed step (the bias's
    # update kept, the rest skipped), step 3
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == ([2, 2, 2, 3] if fused else [3] * 4)


def test_a_gradient_of_another_shape_is_refused():
    """``p.grad.data = ...`` can give a gradient of another shape: it would broadcast in PyTorch and
    be read out of bounds by the kernel."""
    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = fusedopt.AdamW([w], state_bits=32)
    w.grad = torch.randn(4, 8)
    w.grad.data = torch.ones(8)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"a gradient of shape \(8,\) for a parameter of shape \(4, 8\)"):
        opt.step()
    assert torch.equal(w, before) and not opt.state[w]


@pytest.mark.parametrize("fused", [False, True])
def test_reordered_and_removed_groups_are_followed_as_torch_does(fused):
    """Each parameter keeps its own group's settings whatever the order of ``param_groups``; a
    group removed from it is no longer updated (its gradient stays, as torch leaves it)."""
    models = [_model() for _ in range(2)]

    def groups(model):
        return [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[1].parameters(), "lr": 0.1}]

    ours = fusedopt.AdamW(groups(models[0]), state_bits=32, fused=fused)
    theirs = torch.optim.AdamW(groups(models[1]))
    for opt in (ours, theirs):
        opt.param_groups.reverse()
    for model, opt in zip(models, (ours, theirs)):
        _backward(model)
        opt.step()
        opt.zero_grad()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    first = [p.detach().clone() for p in models[0][0].parameters()]
    for opt in (ours, theirs):
        del opt.param_groups[1]  # the lr=0 group, after the reversal
        opt.param_groups[0]["lr"] = 0.01
    for model, opt in zip(models, (ours, theirs)):
        _backward(model)
        opt.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    # the removed group: untouched, its gradient left in place (fused=True: its hook is removed)
    assert all(torch.equal(p, b) and p.grad is not None for p, b in zip(models[0][0].parameters(), first))


def test_a_parameter_put_into_a_group_directly_is_refused():
    model = _model()
    opt = fusedopt.AdamW(model[0].parameters())
    opt.param_groups[0]["params"].append(model[1].weight)
    _backward(model)
    before = _snapshot(model.parameters(), opt)
    with pytest.raises(ValueError, match=r"not added through the constructor or add_param_group\(\)"):
        opt.step()
    _assert_unchanged(opt, before)


def test_a_refused_parameter_group_is_not_added():
    """``add_param_group`` of a parameter another fused optimizer releases: refused, and not left
    half-added (the group would otherwise be updated by ``step()``)."""
    a, b = torch.nn.Parameter(torch.randn(5, 5)), torch.nn.Parameter(torch.randn(5, 5))
    first = fusedopt.AdamW([a], fused=True)
    second = fusedopt.AdamW([b], fused=True)
    with pytest.raises(RuntimeError, match="already carries the gradient-release hook of another"):
        second.add_param_group({"params": [a], "lr": 0.5})
    assert len(second.param_groups) == 1
    before = a.detach().clone()
    a.grad = torch.randn(5, 5)
    second.step()
    assert torch.equal(a, before)
    first.step()
    assert not torch.equal(a, before)


def test_an_empty_first_group_is_accepted():
    w = torch.nn.Parameter(torch.randn(3, 3))
    opt = fusedopt.AdamW([{"params": []}, {"params": [w]}], state_bits=32)
    w.grad = torch.randn(3, 3)
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(w, before)


def test_a_hook_whose_update_fails_does_not_count_the_gradient(monkeypatch):
    """An update that raises inside a release hook (e.g. out of memory creating its state) leaves
    the backward count as it was: after the error, the next backward updates as usual."""
    model = _model()
    opt = fusedopt.AdamW(model.parameters(), fused=True)
    update = opt.update_param

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(opt, "update_param", update)
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(opt, "update_param", fail_once)
    with pytest.raises(RuntimeError, match="simulated"):
        _backward(model)
    assert not any(opt.state[p] for p in model.parameters())  # the first update failed: nothing was written
    opt.zero_grad()
    _backward(model)
    opt.step()
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [1] * 4


def test_a_removed_group_whose_gradients_come_first_in_backward():
    """fused=True: the first hook after step() finds the groups edited; if its own parameter was
    removed, it leaves the gradient and the rest of backward updates the parameters still held."""
    model = _model()
    opt = fusedopt.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], fused=True)
    _backward(model)
    opt.step()
    del opt.param_groups[1]  # the last layer: its gradients are the first ones backward makes
    last = [p.detach().clone() for p in model[1].parameters()]
    first = [p.detach().clone() for p in model[0].parameters()]
    _backward(model)
    opt.step()
    assert all(torch.equal(p, b) and p.grad is not None for p, b in zip(model[1].parameters(), last))
    assert all(not torch.equal(p, b) and p.grad is None for p, b in zip(model[0].parameters(), first))
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [2, 2, 1, 1]


def test_a_group_added_after_remove_hooks_is_not_released():
    """After ``remove_hooks()`` the optimizer behaves as fused=False, groups added later too."""
    w, v = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
    opt = fusedopt.AdamW([w], fused=True)
    opt.remove_hooks()
    opt.add_param_group({"params": [v]})
    (w.sum() + v.sum()).backward()
    assert w.grad is not None and v.grad is not None  # nothing was released in backward
    opt.step()
    assert [int(opt.state[p]["step"]) for p in (w, v)] == [1, 1]
    other = fusedopt.AdamW([v], fused=True)  # v carries no hook of opt's: another may release it
    opt.zero_grad()
    v.sum().backward()
    assert v.grad is None and int(other.state[v]["step"]) == 1
