"""The test-case registry (tests/cases.py) covers what the library offers."""

import pytest
import torch
from cases import (
    ALGORITHMS,
    DTYPES,
    FORMATS,
    algorithm_cases,
    config,
    cross,
    dtype_cases,
    format_cases,
    master_cases,
)

import fusedopt
from fusedopt.codecs import STATE_BITS_FORMATS


def test_every_public_optimizer_has_a_case():
    public = {getattr(fusedopt, name) for name in fusedopt.__all__}
    classes = {c for c in public if isinstance(c, type) and issubclass(c, fusedopt.FusedOptimizer)}
    classes.discard(fusedopt.FusedOptimizer)
    assert classes and classes <= {a.cls for a in ALGORITHMS}


@pytest.mark.parametrize("algo", algorithm_cases())
def test_every_algorithm_case_keeps_state(algo):
    """Each case's options exercise the class's state: its slots are there after a step."""
    assert set(algo.slots) <= set(algo.cls.slots) and algo.slots
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = algo.make([w], state_bits=32)
    w.grad = torch.randn(8, 8)
    opt.step()
    assert set(algo.slots) <= set(opt.state[w])
    assert any(not torch.equal(opt.state[w][s], torch.zeros(8, 8)) for s in algo.slots)


def test_formats_are_the_registered_state_bits():
    assert {(f.bits, f.name) for f in FORMATS} == set(STATE_BITS_FORMATS.items())
    assert [f.quantized for f in FORMATS] == [STATE_BITS_FORMATS[f.bits].startswith("block") for f in FORMATS]


def test_cross_concatenates_values_and_joins_ids():
    cases = cross(algorithm_cases("adamw", "lion"), format_cases(8), dtype_cases(*DTYPES[:2]), master_cases(None))
    assert [c.id for c in cases] == [
        "adamw-state8-fp32-no-master",
        "adamw-state8-bf16-no-master",
        "lion-state8-fp32-no-master",
        "lion-state8-bf16-no-master",
    ]
    assert all(len(c.values) == 4 for c in cases)
    assert cases[3].values[1:] == (FORMATS[2], torch.bfloat16, None)


def test_config_kwargs_and_id():
    c = config("sgd-nesterov", 16, torch.float16, None, min_compress_numel=0)
    assert c.cls is fusedopt.SGD
    assert c.kwargs == dict(momentum=0.9, nesterov=True, state_bits=16, master_weight_bits=None, min_compress_numel=0)
    assert c.id == "sgd-nesterov-state16-fp16-no-master-min_compress_numel=0"
    assert "master_weight_bits" not in config("adamw", 32, torch.float32).kwargs  # the default
