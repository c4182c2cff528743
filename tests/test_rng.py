"""The counter-based hash: reference and Triton agree bit for bit, and the bits are usable."""

import pytest
import torch

from fusedopt import rng
from fusedopt.kernels.hashing import launch_uniform_bits

CASES = [(0, 0, rng.STREAM_PARAM, 1), (123456789, 7, rng.STREAM_SHARED, 3), (2**40 + 5, 2**31 + 5, 17, 1_000_000)]


@pytest.mark.parametrize("seed,index,stream,step", CASES)
@pytest.mark.parametrize("numel", [1, 1023, 3001])
def test_triton_hash_matches_reference_bit_for_bit(device, seed, index, stream, step, numel):
    key = rng.host_key(seed, index, stream)
    step_t = torch.tensor(float(step), device=device)
    ref = rng.uniform_bits(key, step_t, torch.Size([numel]), device)
    tri = launch_uniform_bits(key, step_t, numel, device)
    assert torch.equal(ref, tri)


def test_indices_beyond_two_to_the_32_agree(device):
    """Tensors over 2**32 elements: the high index bits enter the hash identically."""
    key, step = rng.host_key(9, 3, rng.STREAM_SHARED), torch.tensor(4.0, device=device)
    first = 2**32 - 700
    idx = torch.arange(first, first + 1500, dtype=torch.int64, device=device)
    ref = rng.element_bits(rng.step_hash(key, step), idx)
    tri = launch_uniform_bits(key, step, 1500, device, first=first)
    assert torch.equal(ref, tri)
    assert not torch.equal(ref[:700], ref[700 : 700 + 700])  # no wrap-around repetition


def test_tensor_and_integer_paths_agree():
    """The int64-tensor emulation of uint32 arithmetic equals exact Python-integer arithmetic."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)
    values[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
    expected = torch.tensor([rng.fmix32(int(v)) for v in values.tolist()])
    assert torch.equal(rng.fmix32(values), expected)
    # the fast int32 path (wrapping multiplication, masked shifts) on the same bit patterns
    assert torch.equal(rng._fmix32_int32(values.to(torch.int32)).to(torch.int64) & rng.MASK32, expected)
    assert int(rng.fmix32(values).max()) < 2**32 and int(rng.fmix32(values).min()) >= 0


def test_bits_are_uniform_and_keys_independent():
    step = torch.tensor(5.0)
    n = 1 << 16
    base = rng.uniform_bits(rng.host_key(0, 0, 1), step, torch.Size([n]), "cpu")
    u = base.double() / 2**32
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005
    for bit in (0, 7, 15, 16, 31):  # every bit position is a fair coin
        assert abs(((base >> bit) & 1).double().mean().item() - 0.5) < 0.01
    # neighbours are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.02
    others = [
        rng.uniform_bits(rng.host_key(1, 0, 1), step, torch.Size([n]), "cpu"),  # seed
        rng.uniform_bits(rng.host_key(0, 1, 1), step, torch.Size([n]), "cpu"),  # parameter index
        rng.uniform_bits(rng.host_key(0, 0, 2), step, torch.Size([n]), "cpu"),  # stream
        rng.uniform_bits(rng.host_key(0, 0, 1), step + 1, torch.Size([n]), "cpu"),  # step
    ]
    for other in others:
        assert (other == base).double().mean().item() < 1e-3
    again = rng.uniform_bits(rng.host_key(0, 0, 1), step, torch.Size([n]), "cpu")
    assert torch.equal(again, base)


def test_bits_follow_row_major_element_index():
    step = torch.tensor(2.0)
    key = rng.host_key(3, 1, 16)
    flat = rng.uniform_bits(key, step, torch.Size([12]), "cpu")
    shaped = rng.uniform_bits(key, step, torch.Size([3, 4]), "cpu")
    assert torch.equal(shaped.flatten(), flat)
