"""A parameter's state tensors of one dtype share one allocation (fusedopt/state_memory.py),
with the same values as separately allocated zeros, through checkpoints too."""

import io

import pytest
import torch
from cases import config, master_cases

import fusedopt
from fusedopt.master import correction_zeros
from fusedopt.state_memory import ALIGN_BYTES

SHAPES = [(), (0,), (1,), (37, 41), (3, 1000)]
# AdamW on bf16 parameters (two moments, a correction): every state format and master setting once
CONFIGS = [
    config("adamw", 8, torch.bfloat16, 24),
    config("adamw", 4, torch.bfloat16, 32),
    config("adamw", 16, torch.bfloat16, None),
    config("adamw", 32, torch.bfloat16, 24),
]


def _fresh(shape, config):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen).to(config.dtype))
    opt = config.make([w], min_compress_numel=0)
    return w, opt


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
@pytest.mark.parametrize("shape", SHAPES)
def test_fresh_state_equals_separate_zeros_and_shares_one_buffer_per_dtype(shape, config):
    w, opt = _fresh(shape, config)
    state = opt.ensure_state(w)
    group = opt.param_groups[0]
    expected = {}
    for slot, codec in opt.codecs(w, group).items():
        expected.update({slot + s: t for s, t in codec.zeros(w.shape, w.device).items()})
    expected.update(correction_zeros(w, group["master_weight_bits"]))
    assert set(state) == set(expected) | {"step"}
    storages = {}
    for key, t in expected.items():
        got = state[key]
        assert got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous(), key
        assert torch.equal(got, t), key
        assert got.data_ptr() % ALIGN_BYTES == 0 or got.numel() == 0, key
        storages.setdefault(got.dtype, set()).add(got.untyped_storage().data_ptr())
    assert all(len(ptrs) == 1 for ptrs in storages.values()), storages


# the quantized formats: codes and scales packed in one uint8 storage, which torch.save must keep
@pytest.mark.parametrize("config", CONFIGS[:2], ids=repr)
def test_packed_state_survives_torch_save_and_load(config):
    w, opt = _fresh((37, 41), config)
    for _ in range(3):
        w.grad = torch.randn_like(w)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # views of one storage with one dtype: allowed
    buffer.seek(0)
    saved = torch.load(buffer)
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = config.make([w2], min_compress_numel=0)
    opt2.load_state_dict(saved)
    for key, t in opt.state[w].items():
        assert torch.equal(opt2.state[w2][key], t), key
    codes = [t for k, t in opt2.state[w2].items() if k.endswith((".codes", ".scales"))]
    assert len({t.untyped_storage().data_ptr() for t in codes}) == 1  # packed again on load
    for _ in range(2):  # and both go on identically
        g = torch.randn_like(w)
        w.grad, w2.grad = g, g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(w, w2)


def _model(dtype=torch.bfloat16, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    shapes = [(37, 41), (5,), (3, 1000), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]


def _train(opt, params, steps, seed=2):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        opt.step()


def _correction_storages(opt, params):
    return {opt.state[p]["master_correction"].untyped_storage().data_ptr() for p in params if p in opt.state}


@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_corrections_of_all_trainable_parameters_share_one_buffer(bits):
    params = _model()
    frozen = torch.nn.Parameter(torch.randn(7, 9).to(torch.bfloat16), requires_grad=False)
    opt = fusedopt.AdamW([*params, frozen], master_weight_bits=bits, min_compress_numel=0)
    _train(opt, params, 3)
    assert len(_correction_storages(opt, params)) == 1
    dtype = torch.int8 if bits == 24 else torch.int16
    for p in params:
        corr = opt.state[p]["master_correction"]
        assert corr.dtype == dtype and corr.shape == p.shape and corr.data_ptr() % ALIGN_BYTES == 0
    assert any(bool((opt.state[p]["master_correction"] != 0).any()) for p in params)  # it carries bits
    # a parameter frozen when the buffer was built, trained later, allocates its own
    frozen.requires_grad_(True)
    frozen.grad = torch.randn(frozen.shape).to(frozen.dtype)
    opt.step()
    assert opt.state[frozen]["master_correction"].untyped_storage().data_ptr() not in _correction_storages(opt, params)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_shared_and_separate_corrections_update_identically(bits, device):
    shared, separate = _model(device=device), _model(device=device)
    opt = fusedopt.AdamW(shared, master_weight_bits=bits, min_compress_numel=0)
    opt_separate = fusedopt.AdamW(separate, master_weight_bits=bits, min_compress_numel=0)
    opt_separate._corrections.view = lambda *args: None  # every correction allocates its own
    _train(opt, shared, 4)
    _train(opt_separate, separate, 4)
    assert len(_correction_storages(opt, shared)) == 1
    assert len(_correction_storages(opt_separate, separate)) == len(separate)
    for p, q in zip(shared, separate):
        assert torch.equal(p, q)
        for key, t in opt.state[p].items():
            assert torch.equal(t, opt_separate.state[q][key]), key


def test_a_state_created_again_starts_from_a_zero_correction():
    params = _model()
    opt = fusedopt.AdamW(params, min_compress_numel=0)
    _train(opt, params, 2)
    shared = opt.state[params[0]]["master_correction"]
    assert bool((shared != 0).any())
    del opt.state[params[0]]
    again = opt.ensure_state(params[0])["master_correction"]
    assert again.data_ptr() == shared.data_ptr() and not bool(again.any())
    assert torch.equal(opt.master_weight(params[0]), params[0].float())


@pytest.mark.parametrize("bits_after", master_cases(24, 32))
def test_shared_corrections_survive_a_checkpoint_and_a_failed_load(bits_after):
    params = _model()
    opt = fusedopt.AdamW(params, min_compress_numel=0)
    _train(opt, params, 3)
    masters = [opt.master_weight(p) for p in params]
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    # a load that fails on the last parameter changes nothing, not even the earlier corrections
    bad = {**saved, "state": {**saved["state"], 3: {**saved["state"][3], "step": torch.tensor(-1.0)}}}
    with pytest.raises(ValueError, match="invalid step count"):
        opt.load_state_dict(bad)
    assert all(torch.equal(opt.master_weight(p), m) for p, m in zip(params, masters))
    # into a fresh optimizer, possibly with wider corrections: same masters, one shared buffer again
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = fusedopt.AdamW(params2, min_compress_numel=0, master_weight_bits=bits_after)
    if bits_after == 32:
        saved["param_groups"][0]["master_weight_bits"] = 32  # the checkpoint's groups rule
    opt2.load_state_dict(saved)
    assert all(torch.equal(opt2.master_weight(p2), m) for p2, m in zip(params2, masters))
    assert len(_correction_storages(opt2, params2)) == 1
    dtype = torch.int8 if bits_after == 24 else torch.int16
    assert all(opt2.state[p]["master_correction"].dtype == dtype for p in params2)
    _train(opt, params, 2, seed=5)
    _train(opt2, params2, 2, seed=5)
    if bits_after == 24:
        assert all(torch.equal(p, p2) for p, p2 in zip(params, params2))
