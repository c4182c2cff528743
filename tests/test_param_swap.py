"""A parameter put in place of another in ``param_groups`` (as accelerate's ``prepare()`` puts each
FSDP2-sharded parameter in place of the unsharded one) takes it over: its index (the stream of
stochastic rounding), its state, its release hook. Anything else is refused, changing nothing.
Two processes under FSDP2: ``tests/test_fsdp.py``, ``_swapped_for_shards``."""

import gc
import weakref

import pytest
import torch

import fusedopt

OPTIONS = dict(lr=1e-2, weight_decay=0.1, min_compress_numel=0)  # bf16 weights, 8-bit state, a correction


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8)).to(torch.bfloat16)


def _backward(model, step):
    device = next(model.parameters()).device
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(step)).to(device, torch.bfloat16)
    model(x).float().square().mean().backward()


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        _backward(model, step)
        opt.step()
        opt.zero_grad()


def _swap(model, opt, which, make=None):
    """Put a new parameter (a copy, or ``make(old)``) in place of each parameter ``which`` names, in the
    model and in ``param_groups[0]`` (in place, as accelerate does); returns the old ones."""
    old = []
    for i in which:
        name, p = list(model.named_parameters())[i]
        module, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        new = torch.nn.Parameter(p.detach().clone()) if make is None else make(p)
        setattr(module, attr, new)
        position = next(j for j, q in enumerate(opt.param_groups[0]["params"]) if q is p)
        opt.param_groups[0]["params"][position] = new
        old.append(p)
    return old


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("reloaded", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_parameters_swapped_before_the_first_step_are_taken_over(fused, reloaded):
    """Swapped before any step (accelerate's flow): the new parameters train as if the optimizer had been
    built on them, bit for bit; the old ones are left alone, their hooks removed. ``reloaded``: the
    optimizer's own state_dict loaded first, which replaces the group dicts (accelerate's
    ``AcceleratedOptimizer`` does it): the groups are the same, by their order."""
    model = _model()
    opt = fusedopt.AdamW(model.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    indices = [opt.param_index(p) for p in model.parameters()]
    if reloaded:
        group = opt.param_groups[0]
        opt.load_state_dict(opt.state_dict())
        assert opt.param_groups[0] is not group
    old = _swap(model, opt, [0, 2, 3])  # both weights and the last bias; the first bias stays
    before = [p.detach().clone() for p in old]
    reference = _model()
    reference_opt = fusedopt.AdamW(reference.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    _train(model, opt, 3)
    _train(reference, reference_opt, 3)
    _assert_same(_params(model), _params(reference))
    _assert_same(_state(opt), _state(reference_opt))
    assert [opt.param_index(p) for p in model.parameters()] == indices
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())
    assert all(torch.equal(p, b) and not opt.state.get(p) for p, b in zip(old, before))
    if fused:  # each new parameter is hooked: updated inside backward, its gradient released
        now = _params(model)
        _backward(model, 3)
        assert all(p.grad is None and not torch.equal(p, q) for p, q in zip(model.parameters(), now))
        opt.step()
    sum(p.float().sum() for p in old).backward()  # the old ones: no hook, never updated
    opt.step()
    assert all(p.grad is not None and torch.equal(p, b) for p, b in zip(old, before))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_parameters_swapped_after_steps_keep_their_state(fused, in_place):
    """Swapped between steps for parameters laid out the same (copies): state, index and hook follow,
    and training goes on exactly as without the swap. The old parameters stay alive (the test holds
    them): a list edited in place is then found when a new parameter is first looked up (with
    fused=True that first update runs in step()), a new list at the next sync."""
    runs = []
    for swapped in (True, False):
        model = _model()
        opt = fusedopt.AdamW(model.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
        _train(model, opt, 2)
        old = []
        if swapped:
            if not in_place:
                opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])
            old = _swap(model, opt, [0, 1, 2])
        _train(model, opt, 2, first=2)
        runs.append((_params(model), _state(opt)))
        if swapped:
            assert all(not opt.state.get(p) for p in old)  # the state moved
            assert all(int(opt.state[p]["step"]) == 4 for p in model.parameters())
    _assert_same(runs[0][0], runs[1][0])
    _assert_same(runs[0][1], runs[1][1])


def _refused(opt, match):
    """The optimizer refuses its edited groups at the next step (outside backward) and changes nothing."""
    with pytest.raises((ValueError, RuntimeError), match=match):
        opt.step()


@pytest.mark.parametrize("fused", [False, True])
def test_a_swap_that_cannot_be_taken_over_is_refused_and_changes_nothing(fused):
    model = _model()
    opt = fusedopt.AdamW(model.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    group = opt.param_groups[0]["params"]
    first = group[0]
    cases = [  # (the replacement of param_groups[0]['params'][0], the error)
        (
            torch.nn.Parameter(torch.zeros(40, 25, dtype=torch.bfloat16)),
            r"\[0\] was replaced by a parameter of shape \(40, 25\) where one of shape \(40, 24\) stood",
        ),
        (torch.nn.Parameter(torch.zeros(40, 24, dtype=torch.float64)), "dtype torch.float64 are not supported"),
    ]
    if fused:
        hooked = torch.nn.Parameter(torch.zeros(40, 24, dtype=torch.bfloat16))
        other = fusedopt.AdamW([hooked], fused=True, max_grad_norm=None)
        cases.append((hooked, "already carries the gradient-release hook of another"))
    for new, match in cases:
        group[0] = new
        _refused(opt, match)
        group[0] = first
    # appended, or listed twice: not in place of anything
    group.append(torch.nn.Parameter(torch.zeros(3)))
    _refused(opt, r"not added through the constructor or add_param_group\(\)")
    group[-1] = group[1]
    _refused(opt, r"not added through the constructor or add_param_group\(\)")
    del group[-1]
    # in place of a parameter still in the group (the first weight moved to the last position)
    group[0], group[-1] = torch.nn.Parameter(first.detach().clone()), first
    _refused(opt, r"not added through the constructor or add_param_group\(\)")
    group[0], group[-1] = first, list(model.parameters())[-1]
    # nothing changed: every hook in place, and training equals an optimizer that saw none of it
    for step in range(2):
        _backward(model, step)
        assert all((p.grad is None) == fused for p in model.parameters())
        opt.step()
        opt.zero_grad()
    reference = _model()
    reference_opt = fusedopt.AdamW(reference.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    _train(reference, reference_opt, 2)
    _assert_same(_params(model), _params(reference))
    _assert_same(_state(opt), _state(reference_opt))
    if fused:
        assert other.param_groups[0]["params"][0] is hooked


@pytest.mark.parametrize("fused", [False, True])
def test_state_does_not_move_to_a_parameter_laid_out_otherwise(fused):
    """State exists and the replacement has another dtype: refused (the state was laid out for the old
    parameter), and training goes on once the swap is undone."""
    model = _model()
    opt = fusedopt.AdamW(model.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    _train(model, opt, 1)
    snapshot = _state(opt)
    group = opt.param_groups[0]["params"]
    opt.param_groups[0]["params"] = [torch.nn.Parameter(group[0].detach().float()), *group[1:]]  # a new list
    _refused(
        opt,
        "has optimizer state already: the state was laid out for the old parameter "
        r"\(dtype torch.bfloat16, now torch.float32\)",
    )
    opt.param_groups[0]["params"] = group
    _assert_same(_state(opt), snapshot)
    _train(model, opt, 1, first=1)
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True])
def test_parameters_swapped_out_are_freed_at_once(fused):
    """The optimizer holds its parameters weakly: those accelerate takes out of ``param_groups`` (FSDP2
    has just moved them to the GPU) are freed when the last other reference goes, before any sync.
    accelerate's steps: a placeholder in place of each parameter, the model's parameters replaced
    (by ``fully_shard``), then a new list of the new parameters."""
    gc.disable()  # reference counting alone
    try:
        model = _model()
        opt = fusedopt.AdamW(model.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
        refs = [weakref.ref(p) for p in model.parameters()]
        names = {p.data_ptr(): name for name, p in model.named_parameters()}
        params = opt.param_groups[0]["params"]
        for i in range(len(params)):
            key = params[i].data_ptr()
            params[i] = torch.empty(1, dtype=params[i].dtype)
            params[i].data_ptr = key
        new = {}
        for key, name in names.items():
            layer, attr = name.split(".")
            new[key] = torch.nn.Parameter(getattr(model[int(layer)], attr).detach().clone())
            setattr(model[int(layer)], attr, new[key])
        assert all(ref() is None for ref in refs)
        opt.param_groups[0]["params"] = [new[p.data_ptr] for p in params]
    finally:
        gc.enable()
    reference = _model()
    reference_opt = fusedopt.AdamW(reference.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    _train(model, opt, 2)
    _train(reference, reference_opt, 2)
    _assert_same(_params(model), _params(reference))
    _assert_same(_state(opt), _state(reference_opt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [False, True])
def test_parameters_swapped_for_gpu_copies_train_with_the_kernels(fused):
    """accelerate's FSDP2 on GPUs: the optimizer is built on the model on the CPU, and the parameters it
    is handed are on the GPU. The skipped-update counter follows them (the kernels add to it), and
    training equals an optimizer built on the GPU parameters, bit for bit."""
    model = _model()
    opt = fusedopt.AdamW(model.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    new = {name: torch.nn.Parameter(p.detach().cuda()) for name, p in model.named_parameters()}
    for name, p in new.items():
        layer, attr = name.split(".")
        setattr(model[int(layer)], attr, p)
    opt.param_groups[0]["params"] = list(new.values())
    reference = _model().cuda()
    reference_opt = fusedopt.AdamW(reference.parameters(), fused=fused, max_grad_norm=None, **OPTIONS)
    _train(model, opt, 3)
    _train(reference, reference_opt, 3)
    assert opt.num_skipped_updates.is_cuda and int(opt.num_skipped_updates) == 0
    _assert_same(_params(model), _params(reference))
    _assert_same(_state(opt), _state(reference_opt))
