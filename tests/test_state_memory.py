"""A parameter's state tensors of one dtype share one allocation (fusedopt/state_memory.py),
with the same values as separately allocated zeros, through checkpoints too."""

import io

import pytest
import torch

import fusedopt
from fusedopt.master import correction_zeros
from fusedopt.state_memory import ALIGN_BYTES

SHAPES = [(), (0,), (1,), (37, 41), (3, 1000)]
CONFIGS = [
    dict(state_bits=8, master_weight_bits=24),
    dict(state_bits=4, master_weight_bits=32),
    dict(state_bits=16, master_weight_bits=None),
    dict(state_bits=32, master_weight_bits=24),
]


def _fresh(shape, config, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
    opt = fusedopt.AdamW([w], min_compress_numel=0, **config)
    return w, opt


@pytest.mark.parametrize("config", CONFIGS)
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


@pytest.mark.parametrize("config", CONFIGS[:2])
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
    opt2 = fusedopt.AdamW([w2], min_compress_numel=0, **config)
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
