"""Bad input gets an error that names the problem, at construction or at the step."""

import pytest
import torch

import fusedopt


def _w(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(*shape, dtype=dtype))


CONSTRUCTION_ERRORS = [
    (fusedopt.AdamW, dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (fusedopt.AdamW, dict(lr=torch.tensor(1e-3)), "as a Tensor is not supported"),
    (fusedopt.AdamW, dict(lr="0.1"), r"Invalid learning rate: '0.1' \(expected a float, got str\)"),
    (fusedopt.AdamW, dict(eps=-1e-8), "Invalid epsilon value"),
    (fusedopt.AdamW, dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    (fusedopt.AdamW, dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
    (fusedopt.AdamW, dict(betas=(0.9,)), "Invalid betas"),
    (fusedopt.AdamW, dict(weight_decay=-0.1), "Invalid weight_decay value"),
    (fusedopt.AdamW, dict(lr=float("nan")), "Invalid learning rate"),
    (fusedopt.AdamW, dict(lr=float("inf")), "Invalid learning rate: inf"),
    (fusedopt.AdamW, dict(eps=float("inf")), "Invalid epsilon value: inf"),
    (fusedopt.AdamW, dict(weight_decay=float("inf")), "Invalid weight_decay value: inf"),
    (fusedopt.AdamW, dict(amsgrad=True), "amsgrad=True is not supported"),
    (fusedopt.AdamW, dict(foreach=True), "foreach=True is not supported"),
    (fusedopt.AdamW, dict(capturable=True), "capturable=True is not supported"),
    (fusedopt.AdamW, dict(differentiable=True), "differentiable=True is not supported"),
    (fusedopt.AdamW, dict(state_bits=7), "Invalid state_bits: 7"),
    (fusedopt.AdamW, dict(state_bits=True), "Invalid state_bits"),
    (fusedopt.AdamW, dict(state_bits=32, master_weight_bits=16), "Invalid master_weight_bits: 16"),
    (fusedopt.AdamW, dict(state_bits=32, min_compress_numel=-1), "Invalid min_compress_numel"),
    (fusedopt.AdamW, dict(state_bits=32, accumulation_steps=0), "Invalid accumulation_steps: 0"),
    (fusedopt.AdamW, dict(state_bits=32, accumulation_steps=2.5), "Invalid accumulation_steps"),
    (fusedopt.AdamW, dict(state_bits=32, seed=-3), "Invalid seed"),
    (fusedopt.AdamW, dict(state_bits=32, fused="yes"), "Invalid fused"),
    (fusedopt.AdamW, dict(state_bits=32, maximize=1), "Invalid maximize"),
    (fusedopt.SGD, dict(momentum=-0.5), "Invalid momentum value"),
    (fusedopt.SGD, dict(momentum=float("inf")), "Invalid momentum value: inf"),
    (fusedopt.SGD, dict(dampening=float("inf")), "Invalid dampening value: inf"),
    (fusedopt.Lion, dict(lr=float("inf")), "Invalid learning rate: inf"),
    (fusedopt.SGD, dict(nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
    (fusedopt.SGD, dict(momentum=0.9, dampening=0.1, nesterov=True), "Nesterov momentum requires"),
    (fusedopt.SGD, dict(foreach=True), "foreach=True is not supported"),
    (fusedopt.Lion, dict(betas=(0.9, 1.5)), "Invalid beta parameter at index 1"),
    (fusedopt.Lion, dict(weight_decay=-1), "Invalid weight_decay value"),
]


@pytest.mark.parametrize("opt_cls,kwargs,match", CONSTRUCTION_ERRORS)
def test_invalid_options_are_refused(opt_cls, kwargs, match):
    kwargs = {"state_bits": 32, **kwargs}
    with pytest.raises(ValueError, match=match):
        opt_cls([_w(4, 4)], **kwargs)


def test_off_values_of_refused_options_are_accepted():
    fusedopt.AdamW([_w(3, 3)], amsgrad=False, foreach=None, capturable=False, differentiable=False, state_bits=32)
    fusedopt.AdamW([_w(3, 3)], foreach=False, state_bits=32)
    fusedopt.SGD([_w(3, 3)], foreach=None, differentiable=False, state_bits=32)


@pytest.mark.parametrize("key,value", [("fused", True), ("accumulation_steps", 2), ("seed", 1)])
def test_optimizer_wide_options_in_a_group_are_refused(key, value):
    with pytest.raises(ValueError, match=f"'{key}' is an optimizer-wide option"):
        fusedopt.AdamW([{"params": [_w(3, 3)], key: value}], state_bits=32)


def test_invalid_group_option_is_refused_and_the_group_not_added():
    opt = fusedopt.AdamW([_w(3, 3)], state_bits=32)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [_w(2, 2)], "lr": -1})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [_w(2, 2)], "state_bits": 16, "lr": 1e-2})
    assert opt.param_groups[1]["state_bits"] == 16


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "key,value,match",
    [("lr", float("nan"), "Invalid learning rate: nan"), ("weight_decay", float("inf"), "Invalid weight_decay value")],
)
def test_hyperparameters_changed_between_steps_are_validated(fused, key, value, match):
    """A scheduler or the user sets a group's value after construction: the next update raises
    before it touches anything, and the optimizer goes on once the value is valid again."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(33, 17)
    opt = fusedopt.AdamW(model.parameters(), state_bits=8, min_compress_numel=0, fused=fused)
    x = torch.randn(5, 33, generator=gen)
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    good = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=match):  # fused=True: from backward's first hook
        model(x).square().sum().backward()
        opt.step()
    for p, before, saved in zip(model.parameters(), params, state):
        assert torch.equal(p, before)
        assert all(torch.equal(v, saved[k]) for k, v in opt.state[p].items())
    opt.param_groups[0][key] = good
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(model.parameters(), params))
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [2, 2]


@pytest.mark.parametrize(
    "key,value",
    [("amsgrad", True), ("foreach", True), ("capturable", True), ("differentiable", True),
     ("decoupled_weight_decay", False)],
)  # fmt: skip
def test_a_refused_option_set_in_a_group_is_refused_not_ignored(key, value):
    """The constructor refuses these options; a group may carry any key: given in a group, added with one, or
    set in one between steps, refused the same way (the step before it updates anything)."""
    with pytest.raises(ValueError, match=f"sets {key}={value}"):
        fusedopt.AdamW([{"params": [_w(3, 3)], key: value}], state_bits=32)
    opt = fusedopt.AdamW([_w(3, 3)], state_bits=32)
    with pytest.raises(ValueError, match=f"sets {key}={value}"):
        opt.add_param_group({"params": [_w(2, 2)], key: value})
    assert len(opt.param_groups) == 1
    w = opt.param_groups[0]["params"][0]
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=f"sets {key}={value}"):
        opt.step()
    assert torch.equal(w, before) and w not in opt.state
    del opt.param_groups[0][key]
    opt.step()
    assert not torch.equal(w, before)


def test_a_complex_gradient_of_a_real_parameter_is_refused():
    w = _w(3)
    opt = fusedopt.AdamW([w], state_bits=32)
    w.grad = torch.zeros(3)
    w.grad.data = torch.tensor([1 + 5j, 2j, -1])  # as torch.optim, which raises on it; the real part alone is no update
    before = w.detach().clone()
    with pytest.raises(ValueError, match="a gradient of dtype torch.complex64 for a torch.float32 parameter"):
        opt.step()
    assert torch.equal(w, before)


def test_same_parameter_twice_is_refused():
    w = _w(3, 3)
    with pytest.raises(ValueError, match="same parameter more than once"):
        fusedopt.AdamW([w, w], state_bits=32)
    with pytest.raises(ValueError, match="more than one parameter group"):
        fusedopt.AdamW([{"params": [w]}, {"params": [w]}], state_bits=32)


@pytest.mark.parametrize(
    "param,match",
    [
        (torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64)), "complex parameters are not supported"),
        (_w(3, 3, dtype=torch.float64), "torch.float64 are not supported"),
    ],
)
def test_unsupported_parameters_are_refused(param, match):
    with pytest.raises(ValueError, match=match):
        fusedopt.AdamW([param], state_bits=32)


def test_empty_parameter_list_is_refused():
    with pytest.raises(ValueError, match="empty parameter list"):
        fusedopt.AdamW([], state_bits=32)


@pytest.mark.parametrize("fused", [False, True])
def test_sparse_gradients_are_refused(fused):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = fusedopt.AdamW(emb.parameters(), state_bits=32, fused=fused)
    before = emb.weight.clone()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("state_bits", [32, 8])
def test_master_weight_bits_is_ignored_for_fp32_parameters(state_bits):
    """Every setting is accepted for fp32 parameters and changes nothing: no correction in the state,
    the parameter is its own master, and the updates are the same bit for bit."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 96, generator=gen)
    grads = [torch.randn(64, 96, generator=gen) for _ in range(3)]
    runs = []
    for bits in (24, 32, None):
        w = torch.nn.Parameter(w0.clone())
        opt = fusedopt.AdamW([w], state_bits=state_bits, master_weight_bits=bits, min_compress_numel=0)
        assert opt.param_groups[0]["master_weight_bits"] == bits
        for g in grads:
            w.grad = g.clone()
            opt.step()
        assert "master_correction" not in opt.state[w]
        assert torch.equal(opt.master_weight(w), w.detach())
        runs.append((w.detach(), opt.state[w]))
    (w24, state24), *others = runs
    assert not torch.equal(w24, w0)  # it trained
    for w, state in others:
        assert torch.equal(w, w24)
        assert state.keys() == state24.keys()
        for key, value in state.items():
            assert torch.equal(value, state24[key]), key


def test_changing_state_bits_of_a_live_group_is_refused():
    w = _w(64, 96)
    opt = fusedopt.AdamW([w], state_bits=8, min_compress_numel=0)
    w.grad = torch.randn_like(w)
    opt.step()
    opt.param_groups[0]["state_bits"] = 32
    before = w.clone()
    with pytest.raises(ValueError, match="has no 'exp_avg'.*group's state_bits, state_format, min_compress_numel"):
        opt.step()
    assert torch.equal(w, before)
    # the supported way: through a checkpoint, which converts (8-bit codes decode exactly to fp32)
    opt.param_groups[0]["state_bits"] = 8
    saved = opt.state_dict()
    decoded = opt.torch_state_dict()["state"][0]["exp_avg_sq"]
    saved["param_groups"][0]["state_bits"] = 32
    opt.load_state_dict(saved)
    assert opt.state[w]["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(opt.state[w]["exp_avg_sq"], decoded)
    opt.step()


def test_a_used_up_parameter_generator_is_named():
    model = torch.nn.Linear(4, 4)
    params = model.parameters()
    fusedopt.AdamW(params)  # uses the generator up
    with pytest.raises(ValueError, match="a generator can be iterated only once"):
        fusedopt.AdamW(params)
    with pytest.raises(ValueError, match="empty parameter list"):  # an empty list keeps torch's message
        fusedopt.AdamW([])
