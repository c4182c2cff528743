"""GPU checks of fusedopt.Adafactor's factored kernels (run on the H200: `pytest -m gpu tests/gpu`).

* Under ``auto`` the kernels ran (a prepared launch exists) and agree with the PyTorch reference run
  on the same GPU after several steps on odd and large shapes: fp32 state within 1e-5 relative,
  master weights within 1e-6 + 1e-5 |p| on all but 0.1% of elements, moment codes differing on at
  most 0.5% of bytes. The reference runs on the GPU, not the CPU: on the CPU torch's fp32 ``norm``
  (RMS of the parameter and of the update, as torch.optim.Adafactor computes them) loses about
  1e-3 relative on a 4096 x 4096 matrix, which moves half the elements beyond these tolerances.
* With fp32 parameters, state_bits=32 and no first moment, the CUDA kernels are as close to torch's
  algorithm run in fp64 as torch.optim.Adafactor's own fp32 CUDA run (30 steps, both fused modes);
  on the CPU the reference equals torch.optim.Adafactor to rtol 1e-5, atol 1e-7 (tests/test_adafactor.py).
* fused=True equals fused=False bit for bit on the GPU, bf16 and fp32, state_bits 8 and 4, beta1 None/0.9,
  and with CAME and the Fira limiter.
* A step never synchronises with the host: it runs under CUDA graph capture (which refuses a sync),
  and the captured step, replayed with new gradients, equals eager steps bit for bit.
* A non-finite gradient leaves the parameter and its state untouched, and is counted.

Fast tier (tests/gpu/README.md): the reference parity of six of the nine cases (between them every
kernel switch: no first moment, its 32-, 16-, 8- and 4-bit formats, fp32, bf16 with and without a
correction, fp16 with a 16-bit one, maximize and weight decay, the limiter, CAME), three fused/unfused
cases (both dtypes, both bit widths, no moment, a moment, CAME with the limiter), the CUDA graph and
the non-finite gradient; the rest, and the 30 steps against torch, are ``gpu_long``.
"""

import pytest
import torch
from helpers import PARITY_ATOL, PARITY_RTOL

import fusedopt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [(4096, 4096), (5632, 2048), (1000, 999), (3, 129, 65), (2049,), (), (1, 7)]


def _tensors(shapes, dtype, device, seed, steps):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 1e-2).to(dtype) for s in shapes] for _ in range(steps)]
    return params, grads


def _train(params, grads, device, *, fused=False, **kw):
    ps = [p.detach().clone().to(device).requires_grad_() for p in params]
    opt = fusedopt.Adafactor(ps, fused=fused, **kw)
    for gs in grads:
        if fused:
            sum((p * g.to(device)).sum() for p, g in zip(ps, gs)).backward()
        else:
            for p, g in zip(ps, gs):
                p.grad = g.to(device)
        opt.step()
        opt.zero_grad()
    return ps, opt


def _master_step(ref, dtype, master_weight_bits):
    """The spacing of the stored master weight at each value of ``ref``: 8 bits more than the
    parameter's significand with a 24-bit master, fp32's with a 32-bit one. Without a master (a
    16-bit parameter rounded stochastically) it is 0: one 16-bit step is as large as an update, and
    those cases agree without it."""
    if dtype != torch.float32 and master_weight_bits is None:
        return torch.zeros_like(ref)
    bits = {torch.float32: 24, torch.bfloat16: 16, torch.float16: 19}[dtype]
    if master_weight_bits == 32:
        bits = 24
    exponent = torch.floor(torch.log2(ref.abs().clamp(min=torch.finfo(torch.float32).tiny)))
    return torch.pow(2.0, exponent - (bits - 1))


LONG = pytest.mark.gpu_long
CASES = [
    (torch.float32, dict(state_bits=32)),
    (torch.float32, dict(state_bits=32, beta1=0.9, weight_decay=0.1, maximize=True)),
    pytest.param(torch.bfloat16, dict(), marks=LONG),
    pytest.param(torch.bfloat16, dict(beta1=0.9), marks=LONG),
    (torch.bfloat16, dict(beta1=0.9, state_bits=4, growth_limit=1.01)),
    (torch.bfloat16, dict(beta1=0.9, state_bits=16, master_weight_bits=None)),
    (torch.float16, dict(beta1=0.9, master_weight_bits=32)),
    pytest.param(torch.float32, dict(state_bits=32, beta1=0.9, beta3=0.9999), marks=LONG),  # CAME
    (torch.bfloat16, dict(beta1=0.9, beta3=0.999, growth_limit=1.01)),
]


@pytest.mark.parametrize("dtype,kw", CASES)
def test_cuda_matches_reference(dtype, kw, monkeypatch):
    params, grads = _tensors(SHAPES, dtype, "cpu", 0, 3)
    monkeypatch.setenv("FUSEDOPT_BACKEND", "reference")
    refs, ref_opt = _train(params, grads, "cuda", **kw)
    assert not ref_opt._dispatch._prepared
    monkeypatch.setenv("FUSEDOPT_BACKEND", "auto")
    gpu, gpu_opt = _train(params, grads, "cuda", **kw)
    assert len(gpu_opt._dispatch._prepared) == len(SHAPES), "not every update ran the kernels"
    for p_ref, p_gpu in zip(refs, gpu):
        ref = ref_opt.master_weight(p_ref).cpu()
        got = gpu_opt.master_weight(p_gpu).cpu()
        # The two sides' fp32 sums over the matrix (RMS, row and column statistics) differ in order, by
        # about 1e-6 relative; where that moves a value across a rounding threshold of the stored
        # master (stochastic rounding, same draw) the two land one step of its precision apart.
        step = _master_step(ref, dtype, kw.get("master_weight_bits", 24))
        bad = ((got - ref).abs() > PARITY_ATOL + PARITY_RTOL * ref.abs() + step).double().mean().item()
        assert bad <= 1e-3, (tuple(p_ref.shape), bad)
        s_ref, s_gpu = ref_opt.state[p_ref], gpu_opt.state[p_gpu]
        assert s_ref.keys() == s_gpu.keys()
        for key, value in s_ref.items():
            value, other = value.cpu(), s_gpu[key].cpu()
            if key == "master_correction":
                continue  # compared through the master weights
            if value.dtype == torch.float32:
                # the same 1e-6 relative of the sums scales a whole moment; where a value is a sum of
                # terms of opposite sign (a first moment, CAME's instability) it keeps that error of
                # the terms' scale: rare elements, each still within 1e-3
                atol = 1e-6 * value.abs().max().item()
                off = (other - value).abs() > atol + 1e-5 * value.abs()
                assert off.double().mean().item() <= 1e-3, (key, int(off.sum()))
                torch.testing.assert_close(other, value, rtol=1e-3, atol=atol)
            else:
                assert (other != value).double().mean().item() <= 5e-3, key


@pytest.mark.gpu_long
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_equals_torch_adafactor(fused):
    shapes = [(1000, 999), (3, 129, 65), (2049,), ()]
    params, grads = _tensors(shapes, torch.float32, "cpu", 1, 30)
    ref = [p.clone().cuda().requires_grad_() for p in params]
    ref_opt = torch.optim.Adafactor(ref, lr=0.05, weight_decay=0.01)
    for gs in grads:
        for p, g in zip(ref, gs):
            p.grad = g.cuda()
        ref_opt.step()
    exact = [p.clone().cuda().double().requires_grad_() for p in params]
    exact_opt = torch.optim.Adafactor(exact, lr=0.05, weight_decay=0.01)
    for gs in grads:
        for p, g in zip(exact, gs):
            p.grad = g.cuda().double()
        exact_opt.step()
    ours, opt = _train(params, grads, "cuda", fused=fused, lr=0.05, weight_decay=0.01, state_bits=32)
    assert opt._dispatch._prepared
    for a, b, e in zip(ours, ref, exact):
        # The row and column sums run in another order than torch's CUDA reductions, so a few elements
        # differ by an fp32 ulp or two of the update; hold the kernels to torch's own fp32 accuracy
        # against the same algorithm in fp64 instead.
        ours_err, torch_err = (a.double() - e).abs(), (b.double() - e).abs()
        floor = 1e-7 * e.abs().clamp(min=1e-3)
        assert ours_err.max() <= 2 * torch_err.max() + floor.max(), (tuple(a.shape), ours_err.max(), torch_err.max())
        assert ours_err.mean() <= 1.5 * torch_err.mean() + floor.mean(), (tuple(a.shape), ours_err.mean())
        torch.testing.assert_close(a, b, rtol=PARITY_RTOL, atol=PARITY_ATOL)


MOMENTS = {"no-moment": (None, {}), "moment": (0.9, {}), "came-fira": (0.9, dict(beta3=0.999, growth_limit=1.01))}
FAST_FUSED_CASES = {(torch.float32, 8, "no-moment"), (torch.bfloat16, 8, "moment"), (torch.bfloat16, 4, "came-fira")}
FUSED_CASES = [
    pytest.param(
        dtype,
        bits,
        *MOMENTS[moment],
        id=f"{str(dtype).removeprefix('torch.')}-state{bits}-{moment}",
        marks=() if (dtype, bits, moment) in FAST_FUSED_CASES else LONG,
    )
    for dtype in (torch.float32, torch.bfloat16)
    for bits in (8, 4)
    for moment in MOMENTS
]


@pytest.mark.parametrize("dtype,bits,beta1,extra", FUSED_CASES)
def test_cuda_fused_equals_unfused(dtype, bits, beta1, extra):
    params, grads = _tensors(SHAPES[2:], dtype, "cpu", 2, 4)
    a, oa = _train(params, grads, "cuda", state_bits=bits, beta1=beta1, **extra)
    b, ob = _train(params, grads, "cuda", fused=True, state_bits=bits, beta1=beta1, **extra)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for key in oa.state[x]:
            assert torch.equal(oa.state[x][key], ob.state[y][key]), key


def test_step_has_no_host_sync_and_replays_as_eager_steps():
    """Captured in a CUDA graph: any synchronisation (.item(), a host branch on a value) raises. The
    graph, replayed with each step's gradients copied into the tensors it reads, steps as eager steps
    do, bit for bit (the step count, the step size and the rounding draws live on the device)."""
    kw = dict(beta1=0.9, beta3=0.999, growth_limit=1.01)
    params, grads = _tensors([(1000, 999), (2049,)], torch.bfloat16, "cpu", 3, 4)
    eager, eager_opt = _train(params, grads, "cuda", **kw)
    ps = [p.detach().clone().cuda().requires_grad_() for p in params]
    opt = fusedopt.Adafactor(ps, **kw)
    static = [g.cuda() for g in grads[0]]  # the gradients the graph reads: refilled before each replay
    for p, g in zip(ps, static):
        p.grad = g
    opt.step()  # the first step prepares the launches and the workspace
    torch.cuda.synchronize()
    after_first = [p.detach().clone() for p in ps]
    assert not torch.equal(eager[0], after_first[0])  # the replays have steps to make
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(ps, after_first))  # captured, not run
    assert all(p.grad.data_ptr() == g.data_ptr() for p, g in zip(ps, static))  # what the graph reads
    for gs in grads[1:]:
        for g, new in zip(static, gs):
            g.copy_(new)
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(ps, eager):
        assert torch.equal(p, q)
        state, eager_state = opt.state[p], eager_opt.state[q]
        assert state.keys() == eager_state.keys()
        for key, value in eager_state.items():
            assert torch.equal(state[key], value), key
        assert float(state["step"]) == len(grads)
    assert int(opt.num_skipped_updates) == 0


def test_non_finite_gradient_is_skipped_on_cuda():
    params, grads = _tensors([(300, 301)], torch.bfloat16, "cpu", 4, 1)
    ps, opt = _train(params, grads, "cuda", beta1=0.9)
    before = ps[0].detach().clone()
    state = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    bad = torch.randn(300, 301, device="cuda", dtype=torch.bfloat16)
    bad[7, 9] = float("inf")
    ps[0].grad = bad
    opt.step()
    assert torch.equal(ps[0], before)
    for key, value in state.items():
        assert torch.equal(opt.state[ps[0]][key], value), key
    assert int(opt.num_skipped_updates) == 1
