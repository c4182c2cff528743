"""Checkpoints: exact round trips, resume = no interruption, dtypes kept, conversions and refusals."""

import copy
import functools

import pytest
import torch
from cases import config, config_cases, formats
from helpers import assert_params_close, assert_params_equal, groups, inputs, save_load, train, twins

import fusedopt

# Chosen combinations, not the product: each algorithm, each dtype, exact and bf16 state, with and
# without master weights, and every state format once (8- and 4-bit resumes: test_codecs_quantized)
CONFIGS = config_cases(
    config("adamw", 32, torch.float32),
    config("adamw", 16, torch.bfloat16, None, min_compress_numel=0),
    config("adamw", 32, torch.bfloat16, None),
    config("sgd-momentum", 16, torch.float16, None, min_compress_numel=0),
    config("lion", 16, torch.float32, min_compress_numel=0),
)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", CONFIGS)
def test_resume_continues_the_same_trajectory_bit_for_bit(case, fused):
    opt_cls, dtype, kwargs = case.cls, case.dtype, case.kwargs
    xs = inputs(10, dtype=dtype)
    straight, resumed = twins(dtype=dtype)
    opt = opt_cls(groups(straight, lr=2e-3), lr=1e-2, seed=5, fused=fused, **kwargs)
    train(straight, opt, xs)

    first = opt_cls(groups(resumed, lr=2e-3), lr=1e-2, seed=5, fused=fused, **kwargs)
    train(resumed, first, xs[:4])
    saved = save_load({"model": resumed.state_dict(), "opt": first.state_dict()})
    del first
    model = copy.deepcopy(resumed)
    model.load_state_dict(saved["model"])
    # a fresh optimizer with a different seed: the checkpoint's seed wins
    second = opt_cls(groups(model, lr=2e-3), lr=1e-2, seed=99, fused=fused, **kwargs)
    second.load_state_dict(saved["opt"])
    assert second.seed == 5
    train(model, second, xs[4:])
    assert_params_equal(straight, model)
    for p, q in zip(straight.parameters(), model.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, second.state[q][key]), key
            assert value.dtype == second.state[q][key].dtype


def test_state_keeps_fp32_dtype_for_bf16_parameters():
    """torch.optim.Optimizer.load_state_dict would cast fp32 moments to the bf16 parameter dtype."""
    model, _ = twins(dtype=torch.bfloat16)
    opt = fusedopt.AdamW(model.parameters(), state_bits=32, master_weight_bits=None)
    train(model, opt, inputs(2, dtype=torch.bfloat16))
    saved = save_load(opt.state_dict())
    other = fusedopt.AdamW(model.parameters(), state_bits=32, master_weight_bits=None)
    other.load_state_dict(saved)
    for p in model.parameters():
        assert other.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(other.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        # loaded state is a copy: stepping one optimizer does not move the other's state
        assert other.state[p]["exp_avg"].data_ptr() != opt.state[p]["exp_avg"].data_ptr()


def test_saved_options_win_and_missing_ones_keep_the_optimizers():
    model, _ = twins()
    opt = fusedopt.AdamW(groups(model, lr=3e-3), lr=1e-2, state_bits=16, min_compress_numel=0)
    train(model, opt, inputs(2))
    saved = opt.state_dict()
    other = fusedopt.AdamW(groups(model), lr=5e-2, state_bits=32, min_compress_numel=0)
    other.load_state_dict(saved)
    assert other.param_groups[1]["lr"] == 3e-3 and other.param_groups[0]["lr"] == 1e-2
    assert all(g["state_bits"] == 16 for g in other.param_groups)
    assert other.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16
    train(model, other, inputs(2))  # and it continues in the saved configuration
    assert other.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16


def test_torch_adamw_checkpoint_loads_and_continues_like_torch():
    a, b = twins()
    ref = torch.optim.AdamW(groups(a, lr=3e-3), lr=1e-2, weight_decay=0.1)
    train(a, ref, inputs(5))
    b.load_state_dict(a.state_dict())
    opt = fusedopt.AdamW(groups(b, lr=3e-3), lr=1e-2, weight_decay=0.1, state_bits=32)
    opt.load_state_dict(save_load(ref.state_dict()))
    assert opt.param_groups[0]["state_bits"] == 32  # torch's groups have none: the optimizer's own
    xs = inputs(10, seed=4)
    train(a, ref, xs)
    train(b, opt, xs)
    assert_params_close(a, b)


def test_torch_adamw_checkpoint_into_bf16_state_reports_the_rounding():
    a, b = twins()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train(a, ref, inputs(3))
    opt = fusedopt.AdamW(b.parameters(), state_bits=16, min_compress_numel=0)
    with pytest.warns(UserWarning, match=r"converted .* with rounding.*max abs error"):
        opt.load_state_dict(ref.state_dict())
    for pa, pb in zip(a.parameters(), b.parameters()):
        exact = ref.state[pa]["exp_avg"]
        loaded = opt.state[pb]["exp_avg"]
        if pb.ndim == 1:  # 1-D tensors keep exact fp32 moments under any state_bits
            assert torch.equal(loaded, exact)
            continue
        assert loaded.dtype == torch.bfloat16
        torch.testing.assert_close(loaded.float(), exact, rtol=2**-7, atol=0)


def test_fusedopt_exact_state_loads_into_torch_adamw():
    a, b = twins()
    opt = fusedopt.AdamW(a.parameters(), lr=1e-2, state_bits=32)
    train(a, opt, inputs(3))
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2)
    ref.load_state_dict(save_load(opt.state_dict()))
    xs = inputs(5, seed=8)
    train(a, opt, xs)
    train(b, ref, xs)
    assert_params_close(a, b)


def test_torch_sgd_checkpoint_loads_into_fusedopt_sgd():
    a, b = twins()
    ref = torch.optim.SGD(a.parameters(), lr=1e-2, momentum=0.9)
    train(a, ref, inputs(3))
    b.load_state_dict(a.state_dict())
    opt = fusedopt.SGD(b.parameters(), lr=1e-2, momentum=0.9, state_bits=32)
    opt.load_state_dict(ref.state_dict())
    xs = inputs(5, seed=8)
    train(a, ref, xs)
    train(b, opt, xs)
    assert_params_close(a, b)


def test_counters_and_seed_are_saved():
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = fusedopt.AdamW([w], state_bits=32, seed=11)
    w.grad = torch.full_like(w, float("nan"))
    opt.step()
    saved = save_load(opt.state_dict())
    assert saved["fusedopt"]["seed"] == 11 and int(saved["fusedopt"]["num_skipped_updates"]) == 1
    other = fusedopt.AdamW([w], state_bits=32)
    other.load_state_dict(saved)
    assert int(other.num_skipped_updates) == 1 and other.seed == 11


def _broken(mutate):
    model, _ = twins()
    opt = fusedopt.AdamW(model.parameters(), state_bits=32)
    train(model, opt, inputs(2))
    saved = copy.deepcopy(opt.state_dict())
    mutate(saved)
    return model, opt, saved


def _drop_moment(sd):
    del sd["state"][0]["exp_avg_sq"]


def _bad_shape(sd):
    sd["state"][0]["exp_avg"] = torch.zeros(3, 3)


def _unknown_entry(sd):
    sd["state"][0]["max_exp_avg_sq"] = torch.zeros(1)


def _amsgrad(sd):
    sd["param_groups"][0]["amsgrad"] = True


def _other_algorithm(sd):
    sd["fusedopt"]["algorithm"] = "sgd"


def _group_count(sd):
    sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))


def _bad_step(sd):
    sd["state"][1]["step"] = torch.tensor(-1.0)


def _bad_state_bits(sd):
    sd["param_groups"][0]["state_bits"] = 12


def _drop_first_moment(sd):  # exp_avg_sq's entries are there: "exp_avg" is not a prefix match
    del sd["state"][0]["exp_avg"]


def _no_counter(sd):
    del sd["fusedopt"]["num_skipped_updates"]


def _text_seed(sd):
    sd["fusedopt"]["seed"] = "abc"


def _negative_seed(sd):
    sd["fusedopt"]["seed"] = -5


def _coupled_weight_decay(sd):  # as torch.optim.Adam saves it
    sd["param_groups"][0]["decoupled_weight_decay"] = False


def _other_shapes(sd):  # the two weights' states swapped (the model's parameters in another order)
    sd["fusedopt"]["shapes"][0], sd["fusedopt"]["shapes"][2] = sd["fusedopt"]["shapes"][2], sd["fusedopt"]["shapes"][0]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (_drop_moment, "lacks 'exp_avg_sq'"),
        (_bad_shape, "cannot be converted"),
        (_unknown_entry, "does not keep"),
        (_amsgrad, "amsgrad"),
        (_other_algorithm, "'sgd' state"),
        (_group_count, "number of parameter groups"),
        (_bad_step, "invalid step"),
        (_bad_state_bits, "Invalid state_bits"),
        (_drop_first_moment, "lacks 'exp_avg'"),
        (_no_counter, "invalid num_skipped_updates: None"),
        (_text_seed, "invalid seed: 'abc'"),
        (_negative_seed, "invalid seed: -5"),
        (_coupled_weight_decay, "torch.optim.Adam with weight_decay"),
        (_other_shapes, "not the ones it was saved from"),
    ],
)
def test_incompatible_checkpoints_are_refused_and_leave_the_optimizer_intact(mutate, match):
    model, opt, saved = _broken(mutate)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert before["param_groups"] == after["param_groups"]
    for i, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][i][key], value)


def test_sgd_checkpoint_into_adamw_is_refused():
    model, _ = twins()
    sgd = fusedopt.SGD(model.parameters(), momentum=0.9, state_bits=32)
    train(model, sgd, inputs(1))
    with pytest.raises(ValueError, match="'sgd' state"):
        fusedopt.AdamW(model.parameters(), state_bits=32).load_state_dict(sgd.state_dict())
    ref = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, ref, inputs(1))
    with pytest.raises(ValueError, match="'momentum', an option of another optimizer"):
        fusedopt.AdamW(model.parameters(), state_bits=32).load_state_dict(ref.state_dict())


def test_own_group_keys_and_a_schedulers_initial_lr_round_trip():
    """Keys torch.optim keeps in a group are kept: a user's own, and the initial_lr an LR scheduler
    resumes from (``StepLR(opt, ..., last_epoch=N)`` after loading needs it)."""
    model, resumed = twins()
    opt = fusedopt.AdamW([{"params": model.parameters(), "name": "all"}], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        train(model, opt, inputs(1))
        scheduler.step()
    saved = save_load(opt.state_dict())
    other = fusedopt.AdamW(resumed.parameters(), lr=0.1)
    other.load_state_dict(saved)
    assert other.param_groups[0]["name"] == "all" and other.param_groups[0]["initial_lr"] == 0.1
    resumed_scheduler = torch.optim.lr_scheduler.StepLR(other, step_size=2, gamma=0.5, last_epoch=3)
    train(resumed, other, inputs(1))
    resumed_scheduler.step()
    train(model, opt, inputs(1))
    scheduler.step()
    assert other.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.025


def test_four_bit_state_of_another_parameter_with_the_same_size_is_refused():
    """4-bit codes and scales are flat: the saved shapes tell a (48, 32) parameter's state from a
    (32, 48) one's."""
    a, b = torch.nn.Parameter(torch.randn(48, 32)), torch.nn.Parameter(torch.randn(32, 48))
    opt = fusedopt.AdamW([a, b], state_bits=4, min_compress_numel=0)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    saved = save_load(opt.state_dict())
    swapped = fusedopt.AdamW([b, a], state_bits=4, min_compress_numel=0)
    with pytest.raises(ValueError, match=r"shape \(48, 32\) for parameter 0 \(shape \(32, 48\)\)"):
        swapped.load_state_dict(saved)
    assert not swapped.state


# the float formats: the bound below is for exact and bf16 moments (8- and 4-bit exports decode
# through the codec, checked in test_codecs_quantized)
@pytest.mark.parametrize("state_bits", [f.bits for f in formats(quantized=False)])
def test_export_to_torch_adamw_decodes_the_moments(state_bits):
    a, b = twins()
    opt = fusedopt.AdamW(a.parameters(), lr=1e-2, state_bits=state_bits, min_compress_numel=0)
    train(a, opt, inputs(3))
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2)
    exported = save_load(opt.torch_state_dict())
    ref.load_state_dict(exported)
    for pa, pb in zip(a.parameters(), b.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert ref.state[pb][key].dtype == torch.float32
            assert torch.equal(ref.state[pb][key], opt.state[pa][key].float())
        assert float(ref.state[pb]["step"]) == 3
    assert "state_bits" not in exported["param_groups"][0]
    xs = inputs(4, seed=3)
    train(a, opt, xs)
    train(b, ref, xs)
    assert_params_close(a, b, rtol=1e-2 if state_bits == 16 else 1e-5, atol=1e-4 if state_bits == 16 else 1e-7)


def test_export_sgd_and_refuse_lion():
    a, b = twins()
    opt = fusedopt.SGD(a.parameters(), lr=1e-2, momentum=0.9, state_bits=32)
    train(a, opt, inputs(2))
    b.load_state_dict(a.state_dict())
    ref = torch.optim.SGD(b.parameters(), lr=1e-2, momentum=0.9)
    ref.load_state_dict(opt.torch_state_dict())
    xs = inputs(3, seed=5)
    train(a, opt, xs)
    train(b, ref, xs)
    assert_params_close(a, b)
    with pytest.raises(ValueError, match="no counterpart"):
        fusedopt.Lion(a.parameters(), state_bits=32).torch_state_dict()


def test_format_one_checkpoint_with_square_level_codes_is_refused_not_misread():
    """Checkpoint format 1 stored 8-bit moments on q**2 levels (the removed format ``block8-square``), in
    the same layout as today's minifloat codes: copying them would silently change every moment, so
    such a checkpoint is refused, naming the format. Its 4-bit and fp32 moments alone would load."""
    w, opt = _trained(state_bits=8, seed=3, steps=3)
    saved = copy.deepcopy(opt.state_dict())
    saved["fusedopt"]["format"] = 1
    del saved["fusedopt"]["codecs"]  # format 1 did not record codec names
    fresh = fusedopt.AdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-2, state_bits=8, min_compress_numel=0)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of .* 'block8-square', which was removed from fusedopt"):
        fresh.load_state_dict(copy.deepcopy(saved))
    assert not fresh.state
    saved["fusedopt"]["format"] = 2  # the same codes as format 2 are minifloat codes: they load
    fresh.load_state_dict(saved)
    (p,) = fresh.param_groups[0]["params"]
    assert all(torch.equal(fresh.state[p][k], opt.state[w][k]) for k in opt.state[w])


def _trained(state_bits: int, seed: int, steps: int):
    """A 40 x 50 parameter and the AdamW (every tensor compressed) that took ``steps`` random steps."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(40, 50, generator=gen))
    opt = fusedopt.AdamW([w], lr=1e-2, state_bits=state_bits, min_compress_numel=0)
    for _ in range(steps):
        w.grad = torch.randn(40, 50, generator=gen)
        opt.step()
    return w, opt


def _block4_checkpoint():
    w, opt = _trained(state_bits=4, seed=11, steps=2)
    return w, opt.state_dict()


@pytest.mark.parametrize("slot", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("name", ["rot4", "rot2", "log4", "norm4", "block8-square", "norm2-log4"])
def test_a_checkpoint_naming_a_removed_format_per_moment_is_refused(name, slot):
    """A moment recorded in a removed format (a per-moment name such as ``log4``, or a whole format's):
    refused with an error that names it and says it was removed, what exists now and how to convert."""
    w, saved = _block4_checkpoint()
    saved = copy.deepcopy(saved)
    saved["fusedopt"]["codecs"][0][slot] = name
    other = fusedopt.AdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-2, state_bits=4, min_compress_numel=0)
    with pytest.raises(ValueError) as error:
        other.load_state_dict(saved)
    message = str(error.value)
    assert f"state '{slot}' of parameter 0 (shape (40, 50)) was saved in the state format '{name}'" in message
    assert "was removed from fusedopt" in message
    assert "fp32, bf16, block8, block4, norm2-root4" in message and "older fusedopt" in message
    assert not other.state


@pytest.mark.parametrize("name", ["rot4", "norm2-log4", "norm4-log4", "rot4-log4", "block8-square", "rot8"])
def test_a_checkpoint_whose_group_names_a_removed_format_is_refused(name):
    w, saved = _block4_checkpoint()
    saved = copy.deepcopy(saved)
    saved["param_groups"][0]["state_format"] = name
    other = fusedopt.AdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-2, state_bits=4, min_compress_numel=0)
    with pytest.raises(ValueError, match=rf"Invalid state_format: '{name}' was removed from fusedopt \("):
        other.load_state_dict(saved)
    assert not other.state and other.param_groups[0]["state_format"] is None


@pytest.mark.parametrize("fmt", ["norm2-root4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("into", ["same", "converted"])
def test_a_checkpoint_with_a_corrupt_block_scale_is_refused_and_leaves_the_optimizer_intact(fmt, bad, into):
    """A negative or non-finite block scale would make the moment, then the weights, NaN: it is refused,
    whether the state is copied or converted to the loading optimizer's format."""
    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(300, 7, generator=gen))
    opt = fusedopt.AdamW([p], lr=1e-3, state_format=fmt, min_compress_numel=0)
    for _ in range(2):
        p.grad = torch.randn(300, 7, generator=gen)
        opt.step()
    for slot in ("exp_avg", "exp_avg_sq"):
        saved = copy.deepcopy(opt.state_dict())
        scales = saved["state"][0][slot + ".scales"]
        scales[3] = bad
        other = fmt
        if into == "converted":  # the loading optimizer's format, not the saved one: each moment re-encoded
            other = None
            del saved["param_groups"][0]["state_format"]
        q = torch.nn.Parameter(p.detach().clone())
        target = fusedopt.AdamW([q], lr=1e-3, state_format=other, min_compress_numel=0)
        q.grad = torch.randn(300, 7, generator=gen)
        target.step()
        before = copy.deepcopy(target.state_dict())
        with pytest.raises(
            ValueError, match=rf"state '{slot}' of .* is corrupt: 1 of its {scales.numel()} block scales"
        ):
            target.load_state_dict(saved)
        after = target.state_dict()
        for key, value in before["state"][0].items():
            assert torch.equal(after["state"][0][key], value)


def test_a_root4_unit_no_encode_writes_is_refused():
    """An encode's unit is at most 2**50 * FRESH_UNIT (v saturates at 2**100). A finite unit far above,
    whose roots square to inf, decodes v = inf and m = level * inf: the next step would write NaN into
    the weights, so it is corrupt like a negative or non-finite one. The largest unit an encode writes
    loads."""
    from fusedopt.codecs.rootgrid import LARGEST_UNIT

    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(300, 7, generator=gen))
    opt = fusedopt.AdamW([p], lr=1e-3, state_format="norm2-root4", min_compress_numel=0)
    for _ in range(2):
        p.grad = torch.randn(300, 7, generator=gen)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg_sq.scales"][3] = 1e30
    q = torch.nn.Parameter(p.detach().clone())
    target = fusedopt.AdamW([q], lr=1e-3, state_format="norm2-root4", min_compress_numel=0)
    with pytest.raises(ValueError, match=r"state 'exp_avg_sq' of .* is corrupt: 1 of its 17 block units are above"):
        target.load_state_dict(saved)
    assert not target.state  # nothing was loaded
    saved["state"][0]["exp_avg_sq.scales"][3] = LARGEST_UNIT
    target.load_state_dict(saved)
    assert target.state[q]["exp_avg_sq.scales"][3] == LARGEST_UNIT


@pytest.mark.parametrize("state_bits", [32, 16])
@pytest.mark.parametrize("source", ["fusedopt", "torch"])
def test_a_checkpoint_with_nan_in_a_plain_moment_is_refused(state_bits, source):
    """NaN in an fp32 / bf16 moment (fusedopt's or torch.optim.AdamW's checkpoint) would reach the weights."""
    gen = torch.Generator().manual_seed(8)
    p = torch.nn.Parameter(torch.randn(40, 3, generator=gen))
    make = (
        torch.optim.AdamW
        if source == "torch"
        else functools.partial(fusedopt.AdamW, state_bits=state_bits, min_compress_numel=0)
    )
    opt = make([p], lr=1e-3)
    p.grad = torch.randn(40, 3, generator=gen)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg"][5, 1] = float("nan")
    q = torch.nn.Parameter(p.detach().clone())
    target = fusedopt.AdamW([q], lr=1e-3, state_bits=state_bits, min_compress_numel=0)
    assert target.codecs(q, target.param_groups[0])["exp_avg"].name == {32: "fp32", 16: "bf16"}[state_bits]
    with pytest.raises(ValueError, match=r"state 'exp_avg' of .* is corrupt: 1 of its 120 values are NaN"):
        target.load_state_dict(saved)
    assert not target.state  # nothing loaded


def test_torch_s_load_state_dict_hooks_run_around_the_load():
    """``register_load_state_dict_pre_hook`` / ``_post_hook`` work as on a torch.optim optimizer: the
    pre-hook may replace what is loaded (the caller's dict stays as it was), the post-hook runs after
    the state is in place."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = fusedopt.AdamW([w], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()
    saved = opt.state_dict()
    q = torch.nn.Parameter(w.detach().clone())
    fresh = fusedopt.AdamW([q], lr=1e-3)
    steps_seen = []

    def pre(optimizer, state_dict):
        assert optimizer is fresh
        return {**state_dict, "param_groups": [{**g, "lr": 0.5} for g in state_dict["param_groups"]]}

    fresh.register_load_state_dict_pre_hook(pre)
    fresh.register_load_state_dict_post_hook(lambda optimizer: steps_seen.append(float(optimizer.state[q]["step"])))
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 0.5 and steps_seen == [1.0]
    assert saved["param_groups"][0]["lr"] == 1e-2
