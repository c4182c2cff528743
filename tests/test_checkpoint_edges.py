"""Checkpoints at the edges of normal use: state read before a first update, a group edited live, a model
whose dtype changed between save and load, options torch.optim lacks, empty Adafactor parameters."""

import warnings

import pytest
import torch
from cases import ALGORITHM
from helpers import random_steps, save_load

import fusedopt


def _same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("algo", ["adamw", "lion", "adafactor", "sgd-momentum"])
def test_state_read_before_a_first_update_saves_and_loads(algo):
    """opt.state[p] makes an empty entry (a defaultdict, as in torch): it is no state, in the checkpoint too."""
    params = [torch.randn(64, 96, requires_grad=True), torch.randn(96, requires_grad=True)]
    opt = ALGORITHM[algo].make(params, lr=1e-2)
    random_steps(opt, params[:1], 2)
    assert opt.state[params[1]].get("step") is None  # the user's look leaves {} behind
    saved = save_load(opt.state_dict())
    assert list(saved["state"]) == [0]
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = ALGORITHM[algo].make(twin_params, lr=1e-2)
    twin.load_state_dict(saved)
    random_steps(opt, params, 2, seed=2)
    random_steps(twin, twin_params, 2, seed=2)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        _same_state(opt.state[p], twin.state[q])


def test_a_torch_checkpoint_with_an_empty_entry_loads():
    params = [torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)]
    ref = torch.optim.AdamW(params, lr=1e-2)
    params[0].grad = torch.ones(8)
    ref.step()
    ref.state[params[1]]  # noqa: B018  (makes the empty entry)
    opt = fusedopt.AdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2, state_bits=32)
    opt.load_state_dict(ref.state_dict())
    assert [bool(opt.state.get(p)) for p in opt.param_groups[0]["params"]] == [True, False]


@pytest.mark.parametrize(
    "change",
    [{"state_bits": 4}, {"state_bits": 32}, {"min_compress_numel": 0}, {"state_format": "norm2-root4"}],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_state_dict_after_a_live_group_change_is_refused_until_it_is_undone(change):
    """A saved state is labelled with its group's formats: saved after a live edit, it could not be read.
    Refused, naming the way (edit the saved group); undone, it saves, and the edit then converts on load."""
    params = [torch.randn(64, 96, requires_grad=True)]
    # 6144 elements: compressed, but for the change of min_compress_numel (from uncompressed)
    opt = fusedopt.AdamW(params, lr=1e-2, min_compress_numel=8192 if "min_compress_numel" in change else 4096)
    random_steps(opt, params, 2)
    group = opt.param_groups[0]
    before = {key: group[key] for key in change}
    group.update(change)
    with pytest.raises(ValueError, match=r"state_dict\(\): .*was made for the parameter.*Set the group's option back"):
        opt.state_dict()
    group.update(before)
    saved = save_load(opt.state_dict())
    saved["param_groups"][0].update(change)
    other = fusedopt.AdamW([params[0].detach().clone().requires_grad_()], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a lossy conversion says so
        other.load_state_dict(saved)
    assert all(other.param_groups[0][key] == value for key, value in change.items())
    random_steps(other, other.param_groups[0]["params"], 1)


def _bf16_fp16_run(dtype, master_weight_bits=24):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64).to(dtype))
    model = torch.nn.Module()
    model.w = w
    opt = fusedopt.AdamW([w], lr=1e-3, master_weight_bits=master_weight_bits, state_bits=32)
    random_steps(opt, [w], 3)
    return model, opt


@pytest.mark.parametrize("saved_dtype, dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_a_master_correction_of_another_dtype_is_refused_and_the_documented_way_works(saved_dtype, dtype):
    """A correction counts in steps of its parameter's dtype; read under the other 16-bit dtype it would
    move every master. Refused, the optimizer as it was; the way the error names carries the master over."""
    model, opt = _bf16_fp16_run(saved_dtype)
    master = opt.master_weight(model.w)
    fp32 = fusedopt.master_state_dict(model, opt)
    saved = save_load({"model": model.state_dict(), "opt": opt.state_dict(), "fp32": fp32})
    assert saved["opt"]["state"][0]["master_correction"].any()

    new = torch.nn.Module()
    new.w = torch.nn.Parameter(torch.empty(64, 64, dtype=dtype))
    new.load_state_dict(saved["model"])
    new_opt = fusedopt.AdamW([new.w], lr=1e-3, master_weight_bits=24, state_bits=32)
    with pytest.raises(ValueError, match=rf"saved for {str(saved_dtype)[6:]} parameters; this one is {str(dtype)[6:]}"):
        new_opt.load_state_dict(saved["opt"])
    assert not new_opt.state

    del saved["opt"]["state"][0]["master_correction"]
    new_opt.load_state_dict(saved["opt"])
    fusedopt.load_master_state_dict(new, new_opt, saved["fp32"])
    error = (new_opt.master_weight(new.w) - master).abs().max().item()
    assert error < (5e-5 if dtype == torch.bfloat16 else 1e-12)  # int8 on bf16 keeps 15 bits; fp16 19
    _same_state(
        {k: v for k, v in new_opt.state[new.w].items() if k != "master_correction"},
        {k: v for k, v in opt.state[model.w].items() if k != "master_correction"},
    )


def test_a_master_correction_of_the_same_dtype_loads():
    model, opt = _bf16_fp16_run(torch.bfloat16)
    saved = save_load(opt.state_dict())
    assert saved["fusedopt"]["dtypes"] == {0: "bfloat16"}
    w = torch.nn.Parameter(model.w.detach().clone())
    other = fusedopt.AdamW([w], lr=1e-3, master_weight_bits=24, state_bits=32)
    other.load_state_dict(saved)
    assert torch.equal(other.master_weight(w), opt.master_weight(model.w))


@pytest.mark.parametrize("option", [{"beta1": 0.9}, {"beta1": 0.9, "beta3": 0.999}, {"growth_limit": 1.01}])
def test_torch_export_of_adafactor_options_torch_lacks_is_refused(option):
    params = [torch.randn(6, 7, requires_grad=True)]
    opt = fusedopt.Adafactor(params, **option)
    random_steps(opt, params, 1)
    with pytest.raises(ValueError, match=rf"sets {next(iter(option))}=.*torch.optim.Adafactor does not have"):
        opt.torch_state_dict()
    fusedopt.Adafactor([torch.randn(6, 7, requires_grad=True)]).torch_state_dict()  # without them: exported


@pytest.mark.parametrize("options", [{}, {"beta1": 0.9, "beta3": 0.999, "growth_limit": 1.01}], ids=["plain", "came"])
def test_adafactor_with_an_empty_parameter_keeps_finite_state_and_saves(options):
    """A parameter with no elements is not updated (a mean over no rows would be 0/0), and the others are
    updated as without it."""
    shapes = [(0, 64), (64, 0), (0,), (6, 7)]
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    alone = [params[-1].detach().clone().requires_grad_()]
    opt = fusedopt.Adafactor(params, state_bits=32, **options)
    ref = fusedopt.Adafactor(alone, state_bits=32, **options)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grad = torch.randn(6, 7, generator=g)
        for p in params:
            p.grad = grad.clone() if p.shape == grad.shape else torch.zeros(p.shape)
        alone[0].grad = grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(params[-1], alone[0])
    for p in params:
        for key, value in opt.state[p].items():
            assert torch.isfinite(value).all(), key
    other = fusedopt.Adafactor([p.detach().clone().requires_grad_() for p in params], state_bits=32, **options)
    other.load_state_dict(save_load(opt.state_dict()))


def _group_removed_run(params, steps, seed_from, opt=None, fused=False):
    if opt is None:
        opt = fusedopt.AdamW(
            [{"params": [p]} for p in params], lr=1e-3, master_weight_bits=24, fused=fused, max_grad_norm=0.5
        )
        del opt.param_groups[0]  # the remaining parameters keep their indices: 1 and 2
    for s in range(seed_from, seed_from + steps):
        g = torch.Generator().manual_seed(s)
        sum(
            (p.float() * torch.randn(p.shape, generator=g)).sin().sum()
            for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"]
        ).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _bf16_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 64, generator=g).bfloat16()) for _ in range(3)]


@pytest.mark.parametrize("fused", [False, True])
def test_a_resume_after_a_group_was_removed_is_exact(fused):
    """Each parameter's index seeds its stochastic rounding; a removed group leaves the others theirs, and
    the checkpoint keeps them, so an optimizer built on the remaining groups resumes exactly."""
    whole = _bf16_params()
    _group_removed_run(whole, 6, 0, fused=fused)
    first = _bf16_params()
    opt = _group_removed_run(first, 3, 0, fused=fused)
    saved = save_load({"w": [p.detach() for p in first], "opt": opt.state_dict()})
    assert saved["opt"]["fusedopt"]["indices"] == {0: 1, 1: 2}
    resumed = [torch.nn.Parameter(t.clone()) for t in saved["w"]]
    new = fusedopt.AdamW(
        [{"params": [p]} for p in resumed[1:]], lr=1e-3, master_weight_bits=24, fused=fused, max_grad_norm=0.5
    )
    new.load_state_dict(saved["opt"])
    assert [new.param_index(p) for p in resumed[1:]] == [1, 2]
    _group_removed_run(resumed, 3, 3, opt=new)
    for p, q in zip(whole[1:], resumed[1:]):
        assert torch.equal(p, q)
    extra = torch.nn.Parameter(torch.zeros(4))
    new.add_param_group({"params": [extra]})
    assert new.param_index(extra) == 3  # above every index in use: no stream is shared


def test_an_invalid_indices_entry_is_refused():
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(2)]
    opt = fusedopt.AdamW(params, lr=1e-3)
    random_steps(opt, params, 1)
    saved = save_load(opt.state_dict())
    saved["fusedopt"]["indices"] = {0: 5, 1: 5}
    with pytest.raises(ValueError, match="invalid indices entry"):
        fusedopt.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params]).load_state_dict(saved)
