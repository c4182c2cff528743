"""The kernels' direct launch (kernels/launcher.py) updates exactly as Triton's own launch does.

Run on the H200 (`pytest -m gpu tests/gpu`). Each case trains the same parameters with the
same gradients twice, once with every launch through ``kernel[grid](...)`` and once with the
direct launcher, and asserts bit-identical parameters and state. The cases cover every
kernel family, odd sizes, a gradient whose pointer is not 16-byte aligned (its own
specialisation), and accumulated gradients (another constexpr configuration).

Fast tier (tests/gpu/README.md): the AdamW cases (every state format, dtype and master-weight
setting) and accumulated gradients; SGD's and Lion's cases (the same launch arguments, another
algorithm switch) are ``gpu_long``.
"""

import pytest
import torch
from cases import config

from fusedopt.kernels import update

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# chosen combinations: every kernel family, state format, dtype and master-weight setting at least once
CONFIGS = [
    config("adamw", 8, torch.bfloat16, 24),
    config("adamw", 4, torch.bfloat16, None),
    config("adamw", 32, torch.float32),
    config("adamw", 16, torch.float16, 32),
    config("sgd-nesterov", 8, torch.bfloat16, 24),
    config("sgd-momentum", 8, torch.bfloat16, 24),
    config("lion", 8, torch.bfloat16, 24),
]
TIERED_CONFIGS = [pytest.param(c, marks=() if c.algorithm.id == "adamw" else pytest.mark.gpu_long) for c in CONFIGS]
SHAPES = [(1,), (31,), (4097,), (257, 1031)]


def _train(opt_cls, dtype, kwargs, direct: bool, accumulation_steps: int = 1):
    launchers = update._launch_check, update._launch_update
    saved = [launcher.usable for launcher in launchers]
    for launcher in launchers:
        launcher.usable = direct and launcher.usable
    try:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to("cuda", dtype)) for s in SHAPES]
        fused = accumulation_steps > 1
        opt = opt_cls(params, lr=1e-3, min_compress_numel=0, fused=fused, accumulation_steps=accumulation_steps,
                      **kwargs)  # fmt: skip
        for step in range(4):
            for _ in range(accumulation_steps):
                for i, p in enumerate(params):
                    g = torch.randn(p.numel() + 1, generator=gen).to("cuda", dtype)
                    # odd steps: a gradient starting one element into its buffer (not 16-byte aligned)
                    g = g[1:] if (step + i) % 2 else g[:-1]
                    if fused:  # through autograd, so the release hooks see it
                        (p * g.view_as(p)).sum().backward()
                    else:
                        p.grad = g.view_as(p)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return [p.detach().cpu() for p in params], [{k: v.cpu() for k, v in opt.state[p].items()} for p in params]
    finally:
        for launcher, was in zip(launchers, saved):
            launcher.usable = was


def _assert_identical(a, b):
    (params_a, states_a), (params_b, states_b) = a, b
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa.view(-1).view(torch.uint8), pb.view(-1).view(torch.uint8))
    for sa, sb in zip(states_a, states_b):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key].reshape(-1).view(torch.uint8), sb[key].reshape(-1).view(torch.uint8)), key


def test_direct_launch_is_usable_here():
    assert update._launch_check.usable and update._launch_update.usable


@pytest.mark.parametrize("case", TIERED_CONFIGS, ids=repr)
def test_direct_launch_updates_as_triton_does(case):
    opt_cls, dtype, kwargs = case.cls, case.dtype, case.kwargs
    _assert_identical(_train(opt_cls, dtype, kwargs, direct=False), _train(opt_cls, dtype, kwargs, direct=True))


def test_direct_launch_with_accumulated_gradients():
    opt_cls, dtype, kwargs = CONFIGS[0].cls, CONFIGS[0].dtype, CONFIGS[0].kwargs
    a = _train(opt_cls, dtype, kwargs, direct=False, accumulation_steps=2)
    b = _train(opt_cls, dtype, kwargs, direct=True, accumulation_steps=2)
    _assert_identical(a, b)
    assert update._launch_update.compiled  # the direct path did run
