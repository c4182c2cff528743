"""On CUDA, an algorithm or a state format without a kernel branch falls back to the reference
under FUSEDOPT_BACKEND=auto (it once raised KeyError in the kernel layer) and is refused under triton."""

import pytest
import torch
from plugins.linear_codec import NAME as LINEAR8
from plugins.sign_sgd import SignSGD

import fusedopt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _step(make, backend, monkeypatch):
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 80, generator=gen).cuda())
    opt = make(w)
    g = torch.randn(48, 80, generator=gen).cuda()
    for _ in range(3):
        w.grad = g.clone()
        opt.step()
    return w.detach()


@pytest.mark.parametrize(
    "make",
    [
        lambda w: SignSGD([w], lr=1e-2, min_compress_numel=0),
        lambda w: fusedopt.AdamW([w], lr=1e-2, min_compress_numel=0, state_format=LINEAR8),
    ],
    ids=["algorithm", "state_format"],
)
def test_without_a_kernel_branch_auto_runs_the_reference_on_cuda(make, monkeypatch):
    auto = _step(make, "auto", monkeypatch)
    reference = _step(make, "reference", monkeypatch)
    assert torch.equal(auto, reference)
    with pytest.raises(RuntimeError, match="no branch for"):
        _step(make, "triton", monkeypatch)
