"""Pipelined update launches (kernels/update.py ``PIPELINE_PROGRAMS_PER_SM``): fewer programs than tiles,
each loading its next tile while it updates one, give the same bits as one program per tile.

In the interpreter a pipelined launch has 2 programs per "SM", as if the CPU had 2: the sizes below
take 4 to 6 tiles, so every program loops, and a last partial tile is masked.
"""

import pytest
import torch

import fusedopt
from fusedopt.kernels import update

# 5143 elements (odd: element by element) and 4608 (vector accesses); on a GPU more tiles than its SMs
SHAPES = {"cpu": [(37, 139), (48, 96)], "cuda": [(517, 1039), (512, 1024)]}
CONFIGS = [
    pytest.param(fusedopt.AdamW, torch.bfloat16, {}, id="adamw-default"),
    pytest.param(fusedopt.AdamW, torch.bfloat16, {"state_bits": 4, "master_weight_bits": None}, id="adamw-4bit"),
    pytest.param(fusedopt.AdamW, torch.bfloat16, {"state_format": "norm2-root4"}, id="adamw-norm2-root4"),
    pytest.param(
        fusedopt.AdamW,
        torch.bfloat16,
        {"state_format": "norm2-root4", "master_weight_bits": None},
        id="adamw-norm2-root4-nomaster",
    ),
    pytest.param(fusedopt.AdamW, torch.float32, {"state_bits": 32, "master_weight_bits": 32}, id="adamw-fp32"),
    pytest.param(fusedopt.SGD, torch.float16, {"momentum": 0.9, "nesterov": True, "state_bits": 16}, id="sgd-fp16"),
    pytest.param(fusedopt.Lion, torch.bfloat16, {"betas": (0.9, 0.99)}, id="lion"),
]


def _train(monkeypatch, device, opt_cls, dtype, kwargs, per_sm, fused=False, steps=3, poison_step=None, tile=None):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "0")
    monkeypatch.setattr(update, "PIPELINE_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(update, "PIPELINE_TILE", tile)
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES[device]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]
    initial = [p.detach().cpu().clone() for p in params]
    opt = opt_cls(params, lr=1e-2, fused=fused, **{"min_compress_numel": 0, **kwargs})
    programs = []
    real = update.PreparedUpdate.launch

    def recording(self, *args, **kw):
        programs.append((self.programs, self.configs[0].constexprs["PIPELINED"]))
        return real(self, *args, **kw)

    with monkeypatch.context() as patched:
        patched.setattr(update.PreparedUpdate, "launch", recording)
        _steps(params, opt, shapes, gen, device, dtype, fused, steps, poison_step)
    state = [{k: v.cpu() for k, v in opt.state[p].items()} for p in params]
    final = [p.detach().cpu() for p in params]
    assert all(not torch.equal(p, p0) for p, p0 in zip(final, initial))  # updated: two no-ops are identical too
    return final, state, programs


def _steps(params, opt, shapes, gen, device, dtype, fused, steps, poison_step):
    for i in range(steps):
        grads = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
        if i == poison_step:
            grads[0][3, 5] = float("nan")
        if fused:
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
        else:
            for p, g in zip(params, grads):
                p.grad = g
        if i % opt.accumulation_steps == opt.accumulation_steps - 1:
            opt.step()
            opt.zero_grad()


def _assert_identical(a, b):
    for pa, pb in zip(a[0], b[0]):
        assert torch.equal(pa, pb)
    for sa, sb in zip(a[1], b[1]):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("opt_cls,dtype,kwargs", CONFIGS)
def test_a_pipelined_launch_gives_the_bits_of_one_program_per_tile(monkeypatch, device, opt_cls, dtype, kwargs):
    alone = _train(monkeypatch, device, opt_cls, dtype, kwargs, None)
    pipelined = _train(monkeypatch, device, opt_cls, dtype, kwargs, 1)
    sms = 2 if device == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count
    assert {p for p, on in pipelined[2]} == {sms} and all(on for _, on in pipelined[2])
    assert all(p > sms and not on for p, on in alone[2]), alone[2]  # more tiles than the pipelined programs
    _assert_identical(alone, pipelined)


@pytest.mark.parametrize("opt_cls,dtype,kwargs", [CONFIGS[0], CONFIGS[3]])
def test_a_pipelined_launch_of_another_tile_gives_the_same_bits(monkeypatch, device, opt_cls, dtype, kwargs):
    alone = _train(monkeypatch, device, opt_cls, dtype, kwargs, None)
    pipelined = _train(monkeypatch, device, opt_cls, dtype, kwargs, 1, tile=(512, 2))
    assert all(on for _, on in pipelined[2])
    _assert_identical(alone, pipelined)


@pytest.mark.parametrize("fused", [False, True])
def test_a_pipelined_launch_with_clipping_accumulation_and_a_skipped_step(monkeypatch, device, fused):
    """The clipping coefficient, an accumulated gradient and a non-finite gradient's skip (status) reach
    every tile of a pipelined launch."""
    kwargs = {"max_grad_norm": 0.5}
    if fused:
        kwargs["accumulation_steps"] = 2
    args = (device, fusedopt.AdamW, torch.bfloat16, kwargs)
    alone = _train(monkeypatch, *args, None, fused=fused, steps=6, poison_step=2)
    pipelined = _train(monkeypatch, *args, 1, fused=fused, steps=6, poison_step=2)
    assert pipelined[2] and all(on for _, on in pipelined[2])
    steps = 3 if fused else 6
    assert [float(s["step"]) for s in pipelined[1]] == [steps - 1, steps]  # the poisoned update skipped
    _assert_identical(alone, pipelined)
