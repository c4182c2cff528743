"""The state format with a fused-kernel branch of its own on CUDA: the paired ``norm2-root4`` (run on
the H200: ``pytest -m gpu tests/gpu/test_state_formats_on_cuda.py -s``).

Its kernel branches (``fusedopt/kernels/rootgrid.py``, ``normalised.py``) are what ``auto`` runs on
CUDA; these tests hold them to the PyTorch reference:

* the kernel on CUDA against the reference on the CPU, over several steps (AdamW; Lion and SGD keep
  no second moment to frame the first): parameters within one unit in the last place (fp32: 1e-6 +
  1e-5 |p|) on at least 99.9% of elements; per moment, a block's scale tensors (root grid: unit)
  differ in at most 1% of blocks (where a refit decision flipped), and in blocks whose scales agree
  the codes are equal or neighbouring on all but 0.1% of elements (a moment stored in units of its
  frame, the normalised first moment, is compared where the frame's code agrees too). The kernel
  does the reference's IEEE operations in its order, so they are expected to agree bit for bit; the
  test prints how many elements differ;
* bucketed launches equal one launch per parameter on CUDA, bit for bit;
* ``auto`` runs the kernel on CUDA, and it is faster than the reference there.

Tiers (tests/gpu/README.md): the fast tier holds the format once against the reference
(``FAST_KERNEL_CASES``), its buckets once and ``auto``; the rest of those grids and the timing
against the reference (4096 x 4096) are ``gpu_long``.
"""

import time

import pytest
import torch
from helpers import beyond_parity, step_with

import fusedopt
from fusedopt.codecs import PAIRED_FORMATS
from fusedopt.codecs.normalised import NormalisedCodec
from fusedopt.codecs.rootgrid import RootGridCodec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FORMATS = list(PAIRED_FORMATS)
ALGORITHMS = {"adamw": (fusedopt.AdamW, {})}
# (dtype, master_weight_bits) each format is held to the reference in
PRECISIONS = {fmt: [(torch.float32, None), (torch.bfloat16, 24), (torch.float16, None)] for fmt in FORMATS}
# each format's case in the fast tier: (dtype, master_weight_bits, fused); a new format needs one here
FAST_KERNEL_CASES = {"norm2-root4": (torch.bfloat16, 24, False)}  # the precision most runs use
FAST_BUCKET_CASES = {("norm2-root4", False)}
assert FAST_KERNEL_CASES.keys() == set(FORMATS), "every state format needs its case in the fast tier"
assert all((dtype, master) in PRECISIONS[fmt] for fmt, (dtype, master, _) in FAST_KERNEL_CASES.items())
MODES = {False: "step", True: "release"}


def _tier(fast: bool) -> tuple:
    return () if fast else (pytest.mark.gpu_long,)


KERNEL_CASES = [
    pytest.param(
        fmt,
        dtype,
        master,
        fused,
        id=f"{fmt}-{str(dtype).removeprefix('torch.')}-master{master}-{MODES[fused]}",
        marks=_tier(FAST_KERNEL_CASES[fmt] == (dtype, master, fused)),
    )
    for fmt in FORMATS
    for dtype, master in PRECISIONS[fmt]
    for fused in MODES
]
BUCKET_CASES = [
    pytest.param(fmt, fused, id=f"{fmt}-{MODES[fused]}", marks=_tier((fmt, fused) in FAST_BUCKET_CASES))
    for fused in MODES
    for fmt in FORMATS
]
CODEC_FAMILIES = {"norm": NormalisedCodec, "root": RootGridCodec}


def _train(device, backend, monkeypatch, fmt, shapes, *, dtype=torch.bfloat16, master=24, fused=False,
           algo="adamw", steps=3, bucket_mb=None):  # fmt: skip
    """Parameters of ``shapes`` after ``steps`` updates from the same start and gradients on any device;
    the gradients change scale by orders of magnitude (blocks are refitted or re-rounded), then settle."""
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
        step_with(opt, ws, grads, fused)
    return ws, opt


def _assert_the_formats_codec(fmt: str, codec, nonnegative: bool) -> None:
    """``codec`` is the one ``fmt`` gives a signed or a nonnegative moment."""
    name = PAIRED_FORMATS[fmt][nonnegative]
    assert codec.name == name and isinstance(codec, CODEC_FAMILIES[name.rstrip("0123456789")]), (fmt, codec)


def _blocks(codec, state: dict, slot: str):
    """(the codes, one row per block; the block scale tensors: the normalised scales, the root grid's
    units) of one moment."""
    codes = codec.unpack(state[slot + ".codes"]).reshape(codec.blocks, -1)
    return codes, [state[slot + suffix] for suffix in codec.suffixes if suffix != ".codes"]


def _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt):
    """The bounds of the module docstring; returns (parameter elements that differ, codes that differ,
    blocks whose scales differ) for the report."""
    group = ref_opt.param_groups[0]
    differing = [0, 0, 0]
    for rw, gw in zip(ref_ws, got_ws):
        r, g = rw.detach().cpu(), gw.detach().cpu()
        assert beyond_parity(r, g).double().mean().item() <= 1e-3
        differing[0] += int((r != g).sum())
        rs, gs = ref_opt.state[rw], {k: v.cpu() for k, v in got_opt.state[gw].items()}
        assert float(gs["step"]) == float(rs["step"])
        codecs = ref_opt.codecs(rw, group)
        agrees = {}  # slot -> per element: its block's scales and its code are the reference's
        for slot in sorted(codecs, key=lambda s: codecs[s].frame):  # a frame before the moment in its units
            codec = codecs[slot]
            _assert_the_formats_codec(group["state_format"], codec, slot in ref_opt.nonnegative_slots)
            (a, ref_scales), (b, got_scales) = _blocks(codec, rs, slot), _blocks(codec, gs, slot)
            same = torch.stack([x == y for x, y in zip(ref_scales, got_scales)]).all(dim=0)
            assert (~same).double().mean().item() <= 0.01, slot
            compared = same[:, None].expand_as(a).clone()
            if codec.frame:  # its codes are in units of the frame's: comparable where the frame's agree
                n = rw.numel()
                flat = torch.zeros(a.numel(), dtype=torch.bool)
                flat[:n] = agrees[ref_opt.frames[slot]][:n]
                compared &= flat.view_as(a)
            assert compared.any() and (a - b)[compared].abs().max().item() <= 1, slot
            assert (a != b)[compared].double().mean().item() <= 1e-3, slot
            agrees[slot] = (same[:, None] & (a == b)).reshape(-1)
            differing[1] += int((a != b).sum())
            differing[2] += int((~same).sum())
    return differing


def _report(what: str, differing) -> None:
    print(f"{what}: parameters differ {differing[0]}, codes {differing[1]}, block scales {differing[2]}")


def _assert_the_kernel_ran(opt, w: torch.Tensor) -> None:
    """``opt`` prepared a kernel launch for ``w``, and its moments are stored on CUDA as its format lays them out."""
    assert opt._dispatch._prepared  # a kernel launch was prepared: the kernel ran
    state = opt.state[w]
    for slot, codec in opt.codecs(w, opt.param_groups[0]).items():
        for suffix, (dtype, size) in codec.layout(w.shape).items():
            stored = state[slot + suffix]
            assert stored.is_cuda and stored.dtype == dtype and stored.shape == size, (slot + suffix, stored)


@pytest.mark.parametrize("fmt,dtype,master,fused", KERNEL_CASES)
def test_the_kernel_on_cuda_matches_the_cpu_reference(monkeypatch, fmt, dtype, master, fused):
    # whole blocks over many programs; an odd size with a partial last block; less than one block
    shapes = [(1000, 1024), (777, 1001), (3, 5)]
    ref_ws, ref_opt = _train("cpu", "reference", monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    got_ws, got_opt = _train("cuda", "triton", monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    differing = _assert_close_to_reference(ref_ws, ref_opt, got_ws, got_opt)
    _report(f"{fmt} {dtype} master={master} fused={fused}", differing)


@pytest.mark.parametrize("fmt,fused", BUCKET_CASES)
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
    _assert_the_kernel_ran(opt, auto)


@pytest.mark.gpu_long
@pytest.mark.parametrize("fmt", list(PAIRED_FORMATS))
def test_auto_on_cuda_is_faster_than_the_reference(fmt, monkeypatch):
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
            _assert_the_kernel_ran(opt, w)  # the timing is the kernel's
    print(
        f"{fmt}: a step of 4096 x 4096 bf16, kernel {timings['auto']:.3f} ms, reference {timings['reference']:.3f} ms"
    )
    assert timings["auto"] * 2 < timings["reference"]
