"""The paired low-bit formats on CUDA (run on the H200: ``pytest -m gpu tests/gpu/test_lowbit_on_cuda.py -s``).

Their fused kernel branch (``fusedopt/kernels/loggrid.py``, ``normalised.py``, and ``rotated.py`` for
``rot4-log4``'s first moment) is what ``auto`` runs on CUDA; these tests hold it to the PyTorch
reference:

* the kernel on CUDA against the reference on the CPU, over several steps: parameters within one
  unit in the last place (fp32: 1e-6 + 1e-5 |p|) on at least 99.9% of elements; per moment, a block's
  scales (log grid: top and spacing) differ in at most 1% of blocks (where a refit decision flipped),
  and in blocks whose scales agree the codes are equal or neighbouring on all but 0.1% of elements
  (a normalised code is compared where the second moment's code agrees too: it is stored in units of
  it). The kernel does the reference's IEEE operations in its order, so they are expected to agree
  bit for bit; the test prints how many elements differ;
* bucketed launches equal one launch per parameter on CUDA, bit for bit;
* ``auto`` runs the kernel on CUDA, and it is faster than the reference there.
"""

import time

import pytest
import torch

import fusedopt
from fusedopt.codecs import PAIRED_FORMATS
from fusedopt.codecs.loggrid import LogGridCodec
from fusedopt.codecs.normalised import NormalisedCodec
from fusedopt.codecs.rotated import RotatedCodec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FORMATS = list(PAIRED_FORMATS)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    return (torch.nextafter(x, torch.full_like(x, float("inf"))).float() - x.float()).abs()


def _train(device, backend, monkeypatch, fmt, shapes, *, dtype=torch.bfloat16, master=24, fused=False,
           algo=fusedopt.AdamW, steps=3, bucket_mb=None, **kwargs):  # fmt: skip
    """Parameters of ``shapes`` after ``steps`` updates from the same start and gradients on any device;
    the gradients change scale by orders of magnitude (blocks are refitted), then settle."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    if bucket_mb is not None:
        monkeypatch.setenv("FUSEDOPT_BUCKET_MB", str(bucket_mb))
    gen = torch.Generator().manual_seed(sum(map(sum, shapes)))
    ws = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in shapes]
    opt = algo(ws, lr=1e-2, min_compress_numel=0, state_format=fmt, master_weight_bits=master, fused=fused, **kwargs)
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


def _blocks(codec, state: dict, slot: str):
    """(the codes, one row per block; the block scale tensors: the log grid's tops and spacings) of one moment."""
    codes = codec.unpack(state[slot + ".codes"]).reshape(codec.blocks, -1)
    keys = [".scales", ".steps"] if isinstance(codec, LogGridCodec) else [".scales"]
    return codes, [state[slot + k] for k in keys]


def _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt):
    """The bounds of the module docstring; returns (elements that differ, codes that differ)."""
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
        codecs = ref_opt.codecs(rw, ref_opt.param_groups[0])
        v_agrees = None  # per element of the second moment: its block and code are the reference's
        for slot in sorted(codecs, key=lambda s: codecs[s].frame):  # the frame first
            codec = codecs[slot]
            assert isinstance(codec, (LogGridCodec, NormalisedCodec, RotatedCodec)), codec
            (a, ref_scales), (b, got_scales) = _blocks(codec, rs, slot), _blocks(codec, gs, slot)
            same = torch.stack([x == y for x, y in zip(ref_scales, got_scales)]).all(dim=0)
            assert (~same).double().mean().item() <= 0.01, slot
            compared = same[:, None].expand_as(a).clone()
            if isinstance(codec, NormalisedCodec):
                n = rw.numel()
                flat = torch.zeros(a.numel(), dtype=torch.bool)
                flat[:n] = v_agrees[:n]
                compared &= flat.view_as(a)
            assert compared.any() and (a - b)[compared].abs().max().item() <= 1, slot
            assert (a != b)[compared].double().mean().item() <= 1e-3, slot
            differing[1] += int((a != b).sum())
            if isinstance(codec, LogGridCodec):
                v_agrees = (same[:, None] & (a == b)).reshape(-1)
    return differing


@pytest.mark.parametrize("fused", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("dtype,master", [(torch.float32, None), (torch.bfloat16, 24), (torch.float16, None)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_on_cuda_matches_the_cpu_reference(monkeypatch, fmt, dtype, master, fused):
    # whole blocks over many programs; an odd size with partial last blocks; less than one block
    shapes = [(1000, 1024), (777, 1001), (3, 5)]
    ref_ws, ref_opt = _train("cpu", "reference", monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    got_ws, got_opt = _train("cuda", "triton", monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    differing = _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt)
    print(f"{fmt} {dtype} master={master} fused={fused}: parameters differ {differing[0]}, codes {differing[1]}")


@pytest.mark.parametrize("algo,kwargs", [(fusedopt.Lion, {}), (fusedopt.SGD, {"momentum": 0.9})], ids=["lion", "sgd"])
def test_lion_and_sgd_momentum_on_cuda_match_the_cpu_reference(monkeypatch, algo, kwargs):
    shapes = [(777, 1001), (3, 5)]
    ref_ws, ref_opt = _train("cpu", "reference", monkeypatch, "rot4-log4", shapes, algo=algo, **kwargs)
    got_ws, got_opt = _train("cuda", "triton", monkeypatch, "rot4-log4", shapes, algo=algo, **kwargs)
    differing = _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt)
    print(f"rot4-log4 {algo.__name__}: parameters differ {differing[0]}, codes {differing[1]}")


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
def test_auto_runs_the_kernel_on_cuda_faster_than_the_reference(fmt, monkeypatch):
    shape = [(4096, 4096)]
    timings = {}
    for backend in ("auto", "reference"):
        (w,), opt = _train("cuda", backend, monkeypatch, fmt, shape, steps=2)
        w.grad = torch.randn_like(w)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            opt.step()
        torch.cuda.synchronize()
        timings[backend] = (time.perf_counter() - start) / 5 * 1e3
        if backend == "auto":
            assert opt._dispatch._prepared  # a kernel launch was prepared: the kernel ran
            assert opt.state[w]["exp_avg_sq.steps"].is_cuda
    print(
        f"{fmt}: a step of 4096 x 4096 bf16, kernel {timings['auto']:.3f} ms, reference {timings['reference']:.3f} ms"
    )
    assert timings["auto"] * 2 < timings["reference"]
