"""The rotated state formats on CUDA: no kernel branch yet, so FUSEDOPT_BACKEND=auto runs the PyTorch
reference (the same update as FUSEDOPT_BACKEND=reference) and triton refuses them; the reference on
CUDA rounds as on the CPU (same counter-based draws, elementwise fp32 operations)."""

import pytest
import torch

import fusedopt

pytestmark = pytest.mark.gpu


def _run(device, backend, monkeypatch, fmt, steps=3):
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 80, generator=gen).to(device=device, dtype=torch.bfloat16))
    opt = fusedopt.AdamW([w], lr=1e-2, min_compress_numel=0, state_format=fmt)
    for _ in range(steps):
        w.grad = torch.randn(48, 80, generator=gen).to(device=device, dtype=torch.bfloat16)
        opt.step()
    return w.detach(), opt.state[w]


@pytest.mark.parametrize("fmt", ["rot8", "rot4", "rot2"])
def test_auto_runs_the_reference_on_cuda_and_triton_refuses(fmt, monkeypatch):
    auto, state = _run("cuda", "auto", monkeypatch, fmt)
    reference, _ = _run("cuda", "reference", monkeypatch, fmt)
    assert torch.equal(auto, reference)
    assert state["exp_avg.codes"].is_cuda and state["exp_avg.scales"].dtype == torch.float32
    with pytest.raises(RuntimeError, match=f"no branch for the state format '{fmt}'"):
        _run("cuda", "triton", monkeypatch, fmt)


@pytest.mark.parametrize("fmt", ["rot8", "rot4"])
def test_one_update_on_cuda_rounds_as_on_the_cpu(fmt, monkeypatch):
    cuda, cuda_state = _run("cuda", "auto", monkeypatch, fmt, steps=1)
    cpu, cpu_state = _run("cpu", "auto", monkeypatch, fmt, steps=1)
    for key in ("exp_avg.codes", "exp_avg_sq.codes"):
        same = (cuda_state[key].cpu() == cpu_state[key]).float().mean().item()
        assert same > 0.999, (key, same)
    torch.testing.assert_close(cuda_state["exp_avg.scales"].cpu(), cpu_state["exp_avg.scales"], rtol=1e-6, atol=0)
