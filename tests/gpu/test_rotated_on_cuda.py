"""The rotated state formats on CUDA (run on the H200: ``pytest -m gpu tests/gpu/test_rotated_on_cuda.py``).

Their fused kernel (``fusedopt/kernels/rotated.py``) is what ``auto`` runs on CUDA; these tests
hold it to the PyTorch reference:

* the kernel on CUDA against the reference on the CPU, over several steps: parameters within one
  unit in the last place (fp32: 1e-6 + 1e-5 |p|) on at least 99.9% of elements; per moment, blocks
  whose scales agree hold the same codes or neighbouring ones on at most 0.1% of coordinates, and a
  scale differs in at most 1% of blocks (where a block's re-rounding decision flipped). The kernel
  does the reference's IEEE operations in its order, so these are expected to agree bit for bit;
  the test prints how many elements differ.
* bucketed launches equal one launch per parameter on CUDA, bit for bit;
* ``auto`` runs the reference on CUDA, which rounds as on the CPU.
"""

import pytest
import torch

import fusedopt
from fusedopt.codecs.rotated import RotatedCodec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FORMATS = ["rot8", "rot4", "rot2"]
ALGORITHMS = {
    "adamw": (fusedopt.AdamW, {}),
    "lion": (fusedopt.Lion, {}),
    "sgd-momentum": (fusedopt.SGD, {"momentum": 0.9}),
}


def _ulp(x: torch.Tensor) -> torch.Tensor:
    return (torch.nextafter(x, torch.full_like(x, float("inf"))).float() - x.float()).abs()


def _train(device, backend, monkeypatch, fmt, shapes, *, dtype=torch.bfloat16, master=24, fused=False,
           algo="adamw", steps=3, bucket_mb=None):  # fmt: skip
    """Parameters of ``shapes`` after ``steps`` updates from the same start and gradients on any device;
    the gradients change scale by orders of magnitude (blocks re-round), then settle."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    if bucket_mb is not None:
        monkeypatch.setenv("FUSEDOPT_BUCKET_MB", str(bucket_mb))
    cls, kwargs = ALGORITHMS[algo]
    gen = torch.Generator().manual_seed(sum(map(sum, shapes)))
    ws = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in shapes]
    opt = cls(ws, lr=1e-2, min_compress_numel=0, state_format=fmt, master_weight_bits=master, fused=fused, **kwargs)
    for i in range(steps):
        scale = [1e-3, 1.0, 1.0, 0.5][i % 4]
        grads = [(torch.randn(s, generator=gen) * scale).to(device=device, dtype=dtype) for s in shapes]
        if fused:
            sum((w * g).sum() for w, g in zip(ws, grads)).backward()
        else:
            for w, g in zip(ws, grads):
                w.grad = g
        opt.step()
        opt.zero_grad()
    return ws, opt


def _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt):
    """The bounds of the module docstring; returns (elements that differ, codes that differ) for the report."""
    differing = [0, 0]
    for rw, gw in zip(ref_ws, got_ws):
        r, g = rw.detach().cpu(), gw.detach().cpu()
        if r.dtype == torch.float32:
            bad = (g - r).abs() > 1e-6 + 1e-5 * r.abs()
        else:
            bad = (g.float() - r.float()).abs() > _ulp(r)
        assert bad.double().mean().item() <= 1e-3
        differing[0] += int((r != g).sum())
        rs, gs = ref_opt.state[rw], {k: v.cpu() for k, v in got_opt.state[gw].items()}
        assert float(gs["step"]) == float(rs["step"])
        for slot, codec in ref_opt.codecs(rw, ref_opt.param_groups[0]).items():
            assert isinstance(codec, RotatedCodec)
            same = rs[slot + ".scales"] == gs[slot + ".scales"]
            assert (~same).double().mean().item() <= 0.01, slot
            a, b = codec.unpack(rs[slot + ".codes"])[same], codec.unpack(gs[slot + ".codes"])[same]
            assert a.numel() and (a - b).abs().max().item() <= 1, slot
            assert (a != b).double().mean().item() <= 1e-3, slot
            differing[1] += int((a != b).sum()) + int((~same).sum()) * 256
    return differing


@pytest.mark.parametrize("fused", [False, True], ids=["step", "release"])
# (bf16 without a correction: tests/test_kernels.py in the interpreter; one compile less per format here)
@pytest.mark.parametrize("dtype,master", [(torch.float32, None), (torch.bfloat16, 24)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_on_cuda_matches_the_cpu_reference(monkeypatch, fmt, dtype, master, fused):
    # whole blocks over many programs; an odd size with a padded last block; one padded block
    shapes = [(1000, 1024), (777, 1001), (3, 5)]
    ref_ws, ref_opt = _train("cpu", "reference", monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    got_ws, got_opt = _train("cuda", "triton", monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    differing = _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt)
    print(f"{fmt} {dtype} master={master} fused={fused}: parameters differ {differing[0]}, codes {differing[1]}")


@pytest.mark.parametrize("algo", ["lion", "sgd-momentum"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_lion_and_sgd_momentum_on_cuda_match_the_cpu_reference(monkeypatch, fmt, algo):
    shapes = [(777, 1001), (3, 5)]
    ref_ws, ref_opt = _train("cpu", "reference", monkeypatch, fmt, shapes, algo=algo)
    got_ws, got_opt = _train("cuda", "triton", monkeypatch, fmt, shapes, algo=algo)
    differing = _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt)
    print(f"{fmt} {algo}: parameters differ {differing[0]}, codes {differing[1]}")


@pytest.mark.parametrize("fused", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_buckets_on_cuda_are_bit_identical_to_one_launch_per_parameter(monkeypatch, fmt, fused):
    shapes = [(32, 48), (8, 50), (16, 16), (37, 41), (64, 40)]  # all but (37, 41) join a bucket
    alone_ws, alone_opt = _train("cuda", "triton", monkeypatch, fmt, shapes, fused=fused, bucket_mb=0)
    ws, opt = _train("cuda", "triton", monkeypatch, fmt, shapes, fused=fused, bucket_mb=64)
    assert max((len(b.members) for b in opt._dispatch._built.values()), default=0) == 4
    for a, b in zip(alone_ws, ws):
        assert torch.equal(a, b)
        for key, value in alone_opt.state[a].items():
            assert torch.equal(value, opt.state[b][key]), key


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_runs_the_kernel_on_cuda(fmt, monkeypatch):
    (auto,), opt = _train("cuda", "auto", monkeypatch, fmt, [(48, 80)])
    (kernel,), _ = _train("cuda", "triton", monkeypatch, fmt, [(48, 80)])
    assert torch.equal(auto, kernel)
    assert opt._dispatch._prepared  # a kernel launch was prepared: the kernel ran
    state = opt.state[auto]
    assert state["exp_avg.codes"].is_cuda and state["exp_avg.scales"].dtype == torch.float32


@pytest.mark.parametrize("fmt", ["rot8", "rot4"])
def test_the_reference_on_cuda_rounds_as_on_the_cpu(fmt, monkeypatch):
    (cuda,), cuda_opt = _train("cuda", "reference", monkeypatch, fmt, [(48, 80)], steps=1)
    (cpu,), cpu_opt = _train("cpu", "reference", monkeypatch, fmt, [(48, 80)], steps=1)
    cuda_state, cpu_state = cuda_opt.state[cuda], cpu_opt.state[cpu]
    for key in ("exp_avg.codes", "exp_avg_sq.codes"):
        same = (cuda_state[key].cpu() == cpu_state[key]).float().mean().item()
        assert same > 0.999, (key, same)
    torch.testing.assert_close(cuda_state["exp_avg.scales"].cpu(), cpu_state["exp_avg.scales"], rtol=1e-6, atol=0)
