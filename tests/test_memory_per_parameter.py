"""Bytes per parameter of everything fusedopt keeps, by configuration (the README's table).

Measured on a large bf16 AdamW parameter after one step: the parameter itself plus every
optimizer-state tensor (moments, block scales, master correction; the 4-byte step counter
is per tensor, not per element, and is left out).
"""

import pytest
import torch

import fusedopt

# (state_bits or a state_format name, master_weight_bits) -> persistent bytes per parameter (bf16 weights included)
README_TABLE = {
    (8, 24): 2 + 1 + 2.125,  # the default: 5.125
    (8, 32): 2 + 2 + 2.125,
    (8, None): 2 + 2.125,
    (4, 24): 2 + 1 + 1.125,
    (4, None): 2 + 1.125,
    (16, 24): 2 + 1 + 4,
    (16, None): 2 + 4,
    (32, 32): 2 + 2 + 8,
    ("norm2-root4", 24): 2 + 1 + 0.8125,
    ("norm2-root4", None): 2 + 0.8125,
}


@pytest.mark.parametrize("config", list(README_TABLE))
def test_bytes_per_parameter(config):
    state, master_weight_bits = config
    p = torch.nn.Parameter(torch.randn(256, 1024, dtype=torch.bfloat16))
    format_option = {"state_format": state} if isinstance(state, str) else {"state_bits": state}
    opt = fusedopt.AdamW([p], master_weight_bits=master_weight_bits, **format_option)
    p.grad = torch.randn_like(p)
    opt.step()
    state = {k: v for k, v in opt.state[p].items() if k != "step"}
    nbytes = p.numel() * p.element_size() + sum(t.numel() * t.element_size() for t in state.values())
    assert nbytes / p.numel() == pytest.approx(README_TABLE[config], abs=1e-9), state.keys()


def test_fp32_adamw_reference_point():
    """torch.optim.AdamW on fp32 weights: 4 (weights) + 8 (two fp32 moments) = 12, 16 with an fp32 master."""
    p = torch.nn.Parameter(torch.randn(256, 1024))
    opt = torch.optim.AdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    state = [t for k, t in opt.state[p].items() if k != "step"]
    assert (p.numel() * 4 + sum(t.numel() * t.element_size() for t in state)) / p.numel() == 12


# fusedopt.Adafactor (beta1, state_bits, master_weight_bits) -> bytes per parameter of a large bf16 matrix,
# the factored statistics left out (the table of docs/adafactor.md; they are added below)
ADAFACTOR_TABLE = {
    (None, 8, 24): 2 + 1,
    (None, 8, None): 2,
    (0.9, 8, 24): 2 + 1 + 1.0625,
    (0.9, 4, 24): 2 + 1 + 0.5625,
    (0.9, 32, 32): 2 + 2 + 4,
}


@pytest.mark.parametrize("config", list(ADAFACTOR_TABLE))
def test_adafactor_bytes_per_parameter(config):
    beta1, state_bits, master_weight_bits = config
    rows, cols = 256, 1024
    p = torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.bfloat16))
    opt = fusedopt.Adafactor([p], beta1=beta1, state_bits=state_bits, master_weight_bits=master_weight_bits)
    p.grad = torch.randn_like(p)
    opt.step()
    state = {k: v for k, v in opt.state[p].items() if k != "step"}
    nbytes = p.numel() * p.element_size() + sum(t.numel() * t.element_size() for t in state.values())
    factored = 4 * (rows + cols) / (rows * cols)
    assert nbytes / p.numel() == pytest.approx(ADAFACTOR_TABLE[config] + factored, abs=1e-9), state.keys()
