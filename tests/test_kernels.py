"""The fused Triton kernel against the PyTorch reference, through the public API.

On the CPU this runs Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py); on a
GPU it runs the compiled kernel on CUDA tensors. Bounds:

* parameters: within one unit in the last place of their dtype (fp32: 1e-6 + 1e-5 |p|, the
  documented bound). Both paths do the same fp32 operations in the same order; they may
  still differ by an fp32 rounding where a compiler fuses a multiply-add, and stochastic
  rounding of a bf16/fp16 parameter can then pick the other neighbour.
* moment codes: equal, or one level apart on at most 0.1% of elements, for the same reason
  (an fp32 difference of one rounding moves a value across a stochastic-rounding threshold
  only when it sits within that rounding of it).

In Triton's CPU interpreter the two paths agree bit for bit (both do IEEE fp32 operations
in the same order, fused multiply-adds exactly where torch uses one), and the tests assert
that; on a GPU the bounds above are the contract.
"""

import contextlib
import re
import zlib

import pytest
import torch
from cases import (
    ELEMENTWISE_ALGORITHMS,
    LOW_DTYPES,
    PRIMARY_ALGORITHMS,
    algorithm_cases,
    cross,
    dtype_cases,
    format_cases,
    master_cases,
)
from helpers import PARITY_ATOL, PARITY_RTOL, code_levels, launch_constexprs, ulp

import fusedopt

SHAPES = [(1, 1), (37, 41), (3, 1000)]
ALGORITHM_CASES = algorithm_cases(*(a.id for a in ELEMENTWISE_ALGORITHMS))  # Adafactor: test_adafactor.py
PRIMARY_ALGORITHM_CASES = algorithm_cases(*(a.id for a in PRIMARY_ALGORITHMS))


def _run(backend, monkeypatch, device, opt_cls, kwargs, w0, grads, fused=False):
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    # the reference runs on the CPU, where its arithmetic is defined (torch's CUDA ops round differently)
    device = "cpu" if backend == "reference" else device
    w = torch.nn.Parameter(w0.clone().to(device))
    kwargs = {"master_weight_bits": None, "min_compress_numel": 0, **kwargs}
    opt = opt_cls([w], lr=1e-2, fused=fused, **kwargs)
    for g in grads:
        if fused:
            (w * g.to(device)).sum().backward()
        else:
            w.grad = g.to(device).clone()
        opt.step()
        opt.zero_grad()
    return w.detach().cpu(), {k: v.cpu() for k, v in opt.state[w].items()}, opt


def _codecs(opt):
    """Slot -> codec of the optimizer's one parameter."""
    (p,) = opt.param_groups[0]["params"]
    return opt.codecs(p, opt.param_groups[0])


def assert_param_parity(ref: torch.Tensor, got: torch.Tensor) -> None:
    if not torch.cuda.is_available():  # the interpreter: bit for bit
        assert torch.equal(ref, got)
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=PARITY_RTOL, atol=PARITY_ATOL)
    else:
        assert ((got.float() - ref.float()).abs() <= ulp(ref)).all()


def assert_moments_nonzero(state: dict) -> None:
    """Every moment holds something: parity of two paths that both skipped the update proves nothing."""
    moments = {k: v for k, v in state.items() if k not in ("step", "master_correction") and not k.endswith(".scales")}
    assert all(v.any() for v in moments.values()), {k: bool(v.any()) for k, v in moments.items()}


def assert_codes_close(key: str, ref: torch.Tensor, got: torch.Tensor, codec, numel: int) -> None:
    """Block codes: the same level, or (rarely) a neighbouring one.

    Compared as signed level indices (4-bit nibbles unpacked, the sign-magnitude sign applied):
    raw bytes are no measure of distance (a high nibble one level up is 16 bytes away, a sign
    bit 128). At most one level apart anywhere, and different on at most 0.1% of elements."""
    a = code_levels(ref, codec.state_bits, codec.signed, numel)
    b = code_levels(got, codec.state_bits, codec.signed, numel)
    assert numel > 0 and a.numel() == b.numel() == numel, key
    assert (a - b).abs().max().item() <= 1, (key, (a - b).abs().max().item())
    off = (a != b).double().mean().item()
    assert off <= 1e-3, (key, off)


def assert_state_parity(ref: dict, got: dict, codecs: dict, numel: int) -> None:
    assert ref.keys() == got.keys()
    for key in ref:
        r, g = ref[key], got[key]
        assert r.dtype == g.dtype and r.shape == g.shape, key
        if not torch.cuda.is_available():
            assert torch.equal(r, g), key
        if key == "master_correction":
            continue  # checked through the master, below
        if key.endswith(".codes"):
            assert_codes_close(key, r, g, codecs[key.removesuffix(".codes")], numel)
        elif key.endswith(".scales") or key == "step":
            assert torch.equal(r, g), key
        else:
            torch.testing.assert_close(g.float(), r.float(), rtol=1e-5, atol=1e-7 if r.dtype == torch.float32 else 0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
# One case per class in this product (108 interpreter runs): nesterov is one kernel switch, whose
# arithmetic does not depend on the state format or dtype; it runs in test_kernel_options and
# test_kernel_master_weight_splitting, which take every registered algorithm.
@pytest.mark.parametrize("algo,fmt,dtype", cross(PRIMARY_ALGORITHM_CASES, format_cases(), dtype_cases()))
def test_kernel_matches_reference(monkeypatch, device, algo, fmt, dtype, shape):
    # a seed of the case (Python's hash() of a dtype changes from run to run)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}-{fmt.bits}-{shape}".encode()))
    w0 = torch.randn(shape, generator=gen).to(dtype)
    grads = [(torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 2, (1,), generator=gen)).to(dtype)]
    grads += [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    kwargs = algo.options(**fmt.kwargs)
    ref_w, ref_state, ref_opt = _run("reference", monkeypatch, device, algo.cls, kwargs, w0, grads)
    got_w, got_state, _ = _run("triton", monkeypatch, device, algo.cls, kwargs, w0, grads)
    # the update ran: the parameter moved (one bf16 element may round back) and every step counted
    assert w0.numel() == 1 or not torch.equal(ref_w, w0)
    assert float(ref_state["step"]) == len(grads)
    assert_moments_nonzero(ref_state)
    assert_param_parity(ref_w, got_w)
    assert_state_parity(ref_state, got_state, _codecs(ref_opt), w0.numel())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tile", [(256, 1), (512, 2), (2048, 4)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_any_tile_of_whole_blocks_stores_the_references_bits(monkeypatch, device, tile, bits):
    """The block formats' update tile (``update.BLOCK`` elements on ``update.NUM_WARPS`` warps; 4-bit codes
    with a correction ``update.NIBBLE_MASTER_TILE``) is a speed choice: programs of 16 to 128 blocks, the
    last one partial, store the reference's bits (bf16 weights with a 24-bit master: the shared draw feeds
    the moments and the master)."""
    from fusedopt.kernels import update

    monkeypatch.setattr(update, "BLOCK", tile[0])
    monkeypatch.setattr(update, "NUM_WARPS", tile[1])
    monkeypatch.setattr(update, "NIBBLE_MASTER_TILE", tile)
    gen = torch.Generator().manual_seed(bits)
    w0 = torch.randn(37, 41, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(37, 41, generator=gen).to(torch.bfloat16) for _ in range(3)]
    kwargs = dict(state_bits=bits, master_weight_bits=24)
    ref_w, ref_state, ref_opt = _run("reference", monkeypatch, device, fusedopt.AdamW, kwargs, w0, grads)
    got_w, got_state, got_opt = _run("triton", monkeypatch, device, fusedopt.AdamW, kwargs, w0, grads)
    prepared = got_opt._dispatch._prepared
    assert [p.launch.programs for p in prepared.values()] == [-(-w0.numel() // tile[0])]
    assert_moments_nonzero(ref_state)
    assert_param_parity(ref_w, got_w)
    assert_state_parity(ref_state, got_state, _codecs(ref_opt), w0.numel())


@pytest.mark.parametrize(
    "kwargs,dtype,tile",
    [
        (dict(state_bits=4, master_weight_bits=24), torch.bfloat16, "NIBBLE_MASTER_TILE"),
        (dict(state_bits=4, master_weight_bits=None), torch.bfloat16, "BLOCK"),
        (dict(state_bits=8, master_weight_bits=24), torch.bfloat16, "BLOCK"),
        (dict(state_format="norm2-root4", master_weight_bits=24), torch.bfloat16, "ROOT_GRID_TILE"),
        (dict(state_format="norm2-root4", master_weight_bits=None), torch.bfloat16, "ROOT_GRID_UNCORRECTED_TILE"),
        (dict(state_format="norm2-root4"), torch.float32, "ROOT_GRID_TILE"),
    ],
)
@pytest.mark.parametrize("cap", [None, 96])
def test_each_format_takes_its_tile(monkeypatch, device, kwargs, dtype, tile, cap):
    """4-bit block codes with a correction run programs of ``NIBBLE_MASTER_TILE``; without one, and 8-bit codes,
    of ``BLOCK`` elements; norm2-root4 of ``ROOT_GRID_TILE``, on a 16-bit parameter without a correction of
    ``ROOT_GRID_UNCORRECTED_TILE`` with its registers capped (``ROOT_GRID_UNCORRECTED_MAX_REGISTERS``); every
    tile under ``MAX_REGISTERS`` where it is set."""
    from fusedopt.kernels import update

    monkeypatch.setattr(update, "MAX_REGISTERS", cap)
    monkeypatch.setattr(update, "ROOT_GRID_UNCORRECTED_MAX_REGISTERS", 120)

    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    # distinct: each case tells
    sizes = dict(BLOCK=2048, NIBBLE_MASTER_TILE=512, ROOT_GRID_TILE=256, ROOT_GRID_UNCORRECTED_TILE=1024)
    monkeypatch.setattr(update, "BLOCK", sizes["BLOCK"])
    monkeypatch.setattr(update, "NIBBLE_MASTER_TILE", (sizes["NIBBLE_MASTER_TILE"], 2))
    monkeypatch.setattr(update, "ROOT_GRID_TILE", (sizes["ROOT_GRID_TILE"], 2))
    monkeypatch.setattr(update, "ROOT_GRID_UNCORRECTED_TILE", (sizes["ROOT_GRID_UNCORRECTED_TILE"], 2))
    w = torch.nn.Parameter(torch.randn(16, 256, device=device, dtype=dtype))
    opt = fusedopt.AdamW([w], lr=1e-3, min_compress_numel=0, **kwargs)
    w.grad = torch.randn_like(w)
    opt.step()
    assert [p.launch.programs for p in opt._dispatch._prepared.values()] == [w.numel() // sizes[tile]]
    registers = cap or (120 if tile == "ROOT_GRID_UNCORRECTED_TILE" else None)
    options = [c.options for p in opt._dispatch._prepared.values() for c in p.launch.configs]
    assert options and all(o.get("maxnreg") == registers for o in options)


@pytest.mark.parametrize(
    "kwargs,dtype,ieee",
    [
        (dict(state_bits=32), torch.bfloat16, True),  # torch.optim.AdamW's results
        (dict(state_bits=16), torch.bfloat16, False),
        (dict(state_bits=8), torch.bfloat16, False),
        (dict(state_bits=8, master_weight_bits=None), torch.float16, False),
        (dict(state_bits=4), torch.bfloat16, False),
        (dict(state_bits=8), torch.float32, True),  # an fp32 parameter resolves 2 ulp of an update
        (dict(state_bits=8, master_weight_bits=32), torch.bfloat16, True),  # so does an fp32 master
        (dict(state_format="norm2-root4"), torch.bfloat16, False),  # APPROXIMATE_ROOT_GRID
        (dict(state_format="norm2-root4"), torch.float32, True),
    ],
    ids=["32", "16", "8", "8-fp16-nomaster", "4", "8-fp32", "8-master32", "norm2-root4", "norm2-root4-fp32"],
)
def test_adamw_approximates_its_denominator_only_where_no_bit_shows_it(monkeypatch, device, kwargs, dtype, ieee):
    """AdamW's square root and division are the GPU's approximate ones (``update.APPROXIMATE_DENOMINATOR``) but
    with fp32 moments, an fp32 parameter or master, or a root-grid v with ``update.APPROXIMATE_ROOT_GRID`` off
    (on: a bf16 norm2-root4 is approximate, an fp32 one not); without the flag, IEEE. The division is div.full
    unless ``APPROXIMATE_DIVISION``, and then only where the denominator is approximate. (denominator_ab.sh's
    canary: with any of the three flags flipped, this test fails.)"""
    from fusedopt.kernels import update

    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")

    def ieee_flags():
        w = torch.nn.Parameter(torch.randn(16, 256, device=device, dtype=dtype))
        opt = fusedopt.AdamW([w], lr=1e-3, min_compress_numel=0, **kwargs)
        w.grad = torch.randn_like(w)
        opt.step()
        configs = launch_constexprs(opt)
        assert [c["APPROXIMATE_DIV"] for c in configs] == [
            update.APPROXIMATE_DIVISION and not c["IEEE_DENOMINATOR"] for c in configs
        ]
        return [c["IEEE_DENOMINATOR"] for c in configs]

    assert update.APPROXIMATE_DIVISION is True
    assert ieee_flags() == [ieee, ieee]
    with monkeypatch.context() as patch:
        patch.setattr(update, "APPROXIMATE_DIVISION", False)
        ieee_flags()
    if "state_format" in kwargs:
        monkeypatch.setattr(update, "APPROXIMATE_ROOT_GRID", False)
        assert ieee_flags() == [True, True]
    monkeypatch.setattr(update, "APPROXIMATE_DENOMINATOR", False)
    assert ieee_flags() == [True, True]


@pytest.mark.parametrize("eps", [0.0, 1e-30, 1e-8])
def test_adamw_with_subnormal_second_moments_matches_the_reference(monkeypatch, device, eps):
    """With ``update.APPROXIMATE_DENOMINATOR``: gradients of 1e-20 make v subnormal (about 1e-43), which the
    approximate square root may flush to zero, so with eps below 2**-39 / sqrt(bias_correction2) the kernel
    takes the IEEE one. Every eps agrees with the reference, each branch in the interpreter bit for bit."""
    from fusedopt.kernels import update

    monkeypatch.setattr(update, "APPROXIMATE_DENOMINATOR", True)
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    # |g| >= 1e-20, so v >= 1e-43 is never 0 (where torch's m / 0 is infinite too)
    grads = [
        (torch.randn(37, 64, generator=gen).sign() * (1 + torch.rand(37, 64, generator=gen)) * 1e-20).to(torch.bfloat16)
        for _ in range(3)
    ]
    kwargs = dict(eps=eps, master_weight_bits=24)
    ref_w, ref_state, ref_opt = _run("reference", monkeypatch, device, fusedopt.AdamW, kwargs, w0, grads)
    got_w, got_state, _ = _run("triton", monkeypatch, device, fusedopt.AdamW, kwargs, w0, grads)
    assert ref_w.isfinite().all()
    assert not torch.equal(ref_w, w0) or eps > 0  # with eps 0 the steps are lr-sized
    assert_param_parity(ref_w, got_w)
    assert_state_parity(ref_state, got_state, _codecs(ref_opt), w0.numel())


@pytest.mark.parametrize(
    "kwargs",
    [dict(master_weight_bits=24), dict(state_bits=4, master_weight_bits=24), dict()],
    ids=["8", "4", "nomaster"],
)
def test_adamw_with_the_approximate_division_matches_the_reference(monkeypatch, device, kwargs):
    """``update.APPROXIMATE_DIVISION`` (div.approx.ftz, exact in the interpreter): the reference's bits there,
    within the parity bounds on a GPU."""
    from fusedopt.kernels import update

    monkeypatch.setattr(update, "APPROXIMATE_DENOMINATOR", True)
    monkeypatch.setattr(update, "APPROXIMATE_DIVISION", True)
    gen = torch.Generator().manual_seed(6)
    w0 = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(37, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    ref_w, ref_state, ref_opt = _run("reference", monkeypatch, device, fusedopt.AdamW, kwargs, w0, grads)
    got_w, got_state, got_opt = _run("triton", monkeypatch, device, fusedopt.AdamW, kwargs, w0, grads)
    configs = launch_constexprs(got_opt)
    assert {c["APPROXIMATE_DIV"] for c in configs} == {True}
    assert not torch.equal(ref_w, w0)
    assert_param_parity(ref_w, got_w)
    assert_state_parity(ref_state, got_state, _codecs(ref_opt), w0.numel())


@pytest.mark.parametrize(
    "algo,dtype,master_weight_bits", cross(ALGORITHM_CASES, dtype_cases(*LOW_DTYPES), master_cases(24, 32))
)
def test_kernel_master_weight_splitting(monkeypatch, device, algo, dtype, master_weight_bits):
    gen = torch.Generator().manual_seed(11)
    # magnitudes from 1e-9 to 1e2, zeros of both signs and the top of the range
    w0 = (torch.randn(29, 67, generator=gen) * torch.logspace(-9, 2, 67)).to(dtype)
    w0[0, :3] = torch.tensor([0.0, -0.0, torch.finfo(dtype).max]).to(dtype)
    grads = [torch.randn(29, 67, generator=gen).to(dtype) for _ in range(3)]
    kwargs = algo.options(state_bits=8, master_weight_bits=master_weight_bits)
    ref_w, ref_state, ref_opt = _run("reference", monkeypatch, device, algo.cls, kwargs, w0, grads)
    got_w, got_state, got_opt = _run("triton", monkeypatch, device, algo.cls, kwargs, w0, grads)
    assert not torch.equal(ref_w, w0)
    assert_moments_nonzero(ref_state)
    assert_param_parity(ref_w, got_w)
    assert_state_parity(ref_state, got_state, _codecs(ref_opt), w0.numel())
    (ref_p,), (got_p,) = ref_opt.param_groups[0]["params"], got_opt.param_groups[0]["params"]
    ref_master, got_master = ref_opt.master_weight(ref_p).cpu(), got_opt.master_weight(got_p).cpu()
    # the masters agree to fp32 round-off of one update (stochastic rounding of the 24-bit grid aside)
    grid = 2.0**-15 if master_weight_bits == 24 else 2.0**-23
    torch.testing.assert_close(got_master, ref_master, rtol=2 * grid, atol=1e-12)


@pytest.mark.parametrize("algo", ALGORITHM_CASES)
def test_kernel_options(monkeypatch, device, algo):
    """maximize, weight decay, nesterov/dampening, non-default betas go through the kernel."""
    options = dict(maximize=True, weight_decay=0.1)
    opt_cls = algo.cls
    if opt_cls is fusedopt.SGD:
        if not algo.kwargs.get("nesterov"):  # (nesterov needs zero dampening: the nesterov case has it)
            options.update(dampening=0.3)
    elif opt_cls is fusedopt.AdamW:
        options.update(betas=(0.3, 0.95), eps=1e-6)  # 1 - beta1 > 0.5: torch.lerp's other formula
    else:
        options.update(betas=(0.8, 0.9))
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(33, 65, generator=gen)
    grads = [torch.randn(33, 65, generator=gen) for _ in range(3)]
    kwargs = algo.options(state_bits=8, **options)
    ref_w, ref_state, ref_opt = _run("reference", monkeypatch, device, opt_cls, kwargs, w0, grads)
    got_w, got_state, _ = _run("triton", monkeypatch, device, opt_cls, kwargs, w0, grads)
    assert not torch.equal(ref_w, w0)
    assert_moments_nonzero(ref_state)
    assert_param_parity(ref_w, got_w)
    assert_state_parity(ref_state, got_state, _codecs(ref_opt), w0.numel())


def test_sgd_without_momentum_and_dampening(monkeypatch, device):
    gen = torch.Generator().manual_seed(6)
    w0 = torch.randn(40, 9, generator=gen)
    grads = [torch.randn(40, 9, generator=gen) for _ in range(3)]
    for kwargs in (dict(state_bits=32), dict(state_bits=16, momentum=0.5, dampening=0.3, weight_decay=0.01)):
        ref = _run("reference", monkeypatch, device, fusedopt.SGD, kwargs, w0, grads)
        got = _run("triton", monkeypatch, device, fusedopt.SGD, kwargs, w0, grads)
        assert not torch.equal(ref[0], w0)  # (no momentum: the parameter is all there is to compare)
        assert_param_parity(ref[0], got[0])
        assert_state_parity(ref[1], got[1], _codecs(ref[2]), w0.numel())


# fp32 and bf16 only: release mode's kernel path does not depend on which low-precision dtype
@pytest.mark.parametrize("dtype", dtype_cases(torch.float32, torch.bfloat16))
def test_kernel_release_mode_is_bit_identical_to_step(monkeypatch, device, dtype):
    gen = torch.Generator().manual_seed(7)
    w0 = torch.randn(50, 70, generator=gen).to(dtype)
    grads = [torch.randn(50, 70, generator=gen).to(dtype) for _ in range(3)]
    a = _run("triton", monkeypatch, device, fusedopt.AdamW, dict(state_bits=8), w0, grads)
    b = _run("triton", monkeypatch, device, fusedopt.AdamW, dict(state_bits=8), w0, grads, fused=True)
    assert torch.equal(a[0], b[0])
    for key in a[1]:
        assert torch.equal(a[1][key], b[1][key]), key


# the kernel computes on the non-finite gradient and only masks its stores: numpy (the
# interpreter) warns about the NaN it makes on the way
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_kernel_skips_non_finite_gradients(monkeypatch, device):
    gen = torch.Generator().manual_seed(8)
    w0 = torch.randn(40, 80, generator=gen)
    good = torch.randn(40, 80, generator=gen)
    bad = good.clone()
    bad[39, 79] = float("nan")  # in the last program's block
    worse = good.clone()
    worse[0, 0] = float("-inf")
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    w = torch.nn.Parameter(w0.clone().to(device))
    opt = fusedopt.AdamW([w], state_bits=8, min_compress_numel=0)
    w.grad = good.to(device)
    opt.step()
    snapshot = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    for g in (bad, worse):
        w.grad = g.to(device)
        opt.step()
        assert torch.equal(w, snapshot[0])
        for k, v in snapshot[1].items():
            assert torch.equal(opt.state[w][k], v), k
    assert int(opt.num_skipped_updates) == 2
    w.grad = good.to(device)
    opt.step()
    assert float(opt.state[w]["step"]) == 2 and not torch.equal(w, snapshot[0])


def test_backend_errors(monkeypatch):
    w = torch.nn.Parameter(torch.randn(8, 8))
    before = w.detach().clone()
    opt = fusedopt.AdamW([w], state_bits=32)
    w.grad = torch.randn(8, 8)
    monkeypatch.setenv("FUSEDOPT_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FUSEDOPT_BACKEND='cuda' is invalid"):
        opt.step()
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        opt.step()
    # nothing was updated or counted (the state may exist: created, not stepped)
    assert torch.equal(w, before)
    assert float(opt.state[w].get("step", 0.0)) == 0
    assert all(not v.any() for k, v in opt.state[w].items())


def test_unsupported_cases_fall_back_under_auto_and_fail_under_triton(monkeypatch, device):
    base = torch.randn(30, 20)
    w = torch.nn.Parameter(base.t().to(device))  # non-contiguous
    opt = fusedopt.AdamW([w], state_bits=8, min_compress_numel=0)
    w.grad = torch.randn(20, 30).to(device)
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="non-contiguous"):
        opt.step()
    monkeypatch.setenv("FUSEDOPT_BACKEND", "auto")
    opt.step()  # the reference handles it
    assert float(opt.state[w]["step"]) == 1


def test_kernel_applies_the_accumulated_gradient(monkeypatch, device):
    """fused=True with accumulation: the kernel adds the optimizer's bf16 buffer to the last gradient."""
    gen = torch.Generator().manual_seed(9)
    w0 = torch.randn(48, 40, generator=gen).to(torch.bfloat16)
    xs = [torch.randn(48, 40, generator=gen).to(torch.bfloat16) for _ in range(6)]
    results = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
        w = torch.nn.Parameter(w0.clone().to(device))
        opt = fusedopt.AdamW([w], lr=1e-2, min_compress_numel=0, fused=True, accumulation_steps=3)
        for i, x in enumerate(xs):
            (w.float() * x.to(device).float()).sum().backward()
            if i % 3 == 2:
                opt.step()
        results.append((w.detach().cpu(), {k: v.cpu() for k, v in opt.state[w].items()}, _codecs(opt)))
    assert_param_parity(results[0][0], results[1][0])
    assert_state_parity(results[0][1], results[1][1], results[0][2], w0.numel())
    assert float(results[1][1]["step"]) == 2


@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (8, torch.float16), (32, torch.bfloat16)])
def test_kernel_hashes_from_a_shards_global_element_offset(monkeypatch, device, bits, dtype):
    """A sharded parameter's local shard draws the random bits of its global element indices: the
    kernel (single and bucketed launches) equals the reference at offsets the 32-bit tiles take, at
    one they do not (37), and past 2**31; and the offset changes the draws."""
    gen = torch.Generator().manual_seed(7)
    w0 = [torch.randn(32, 48, generator=gen).to(dtype) for _ in range(2)]
    grads = [[torch.randn(32, 48, generator=gen).to(dtype) for _ in range(2)] for _ in range(3)]

    def run(backend, firsts):
        monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
        run_device = "cpu" if backend == "reference" else device
        ws = [torch.nn.Parameter(w.clone().to(run_device)) for w in w0]
        opt = fusedopt.AdamW(ws, lr=1e-2, state_bits=bits, min_compress_numel=0, master_weight_bits=None)
        offsets = dict(zip(ws, firsts))
        opt.element_offset = lambda p: offsets[p]  # as a shard's offset in its parameter
        for step_grads in grads:  # steps 2 and 3 launch both parameters as one bucket
            for w, g in zip(ws, step_grads):
                w.grad = g.to(run_device)
            opt.step()
        return [w.detach().cpu() for w in ws], [{k: v.cpu() for k, v in opt.state[w].items()} for w in ws]

    base_w, base_state = run("reference", (0, 0))
    for firsts in ((64, 37), (2**31 + 96, 2**33)):
        ref_w, ref_state = run("reference", firsts)
        assert not all(torch.equal(a, b) for a, b in zip(ref_w + ref_state, base_w + base_state)), "offset unused"
        if bits != 32:  # the moments' stochastic rounding too
            assert any(not torch.equal(a[k], b[k]) for a, b in zip(ref_state, base_state) for k in a if k != "step")
        got_w, got_state = run("triton", firsts)
        for r, g in zip(ref_w, got_w):
            assert_param_parity(r, g)
        for r, g in zip(ref_state, got_state):
            assert r.keys() == g.keys()
            if not torch.cuda.is_available():
                assert all(torch.equal(r[k], g[k]) for k in r)


# --- compile-time dispatch: an unknown algorithm or moment family never falls through ------------


def _launch_one(kernel_id, m_fmt, v_fmt=None, device="cpu"):
    """One update of a 64-element fp32 parameter through ``launch_update`` with the given switches."""
    from fusedopt.kernels import update

    n = 64
    param, grad = torch.zeros(n, device=device), torch.ones(n, device=device)
    moments = [(m_fmt, torch.zeros(n, device=device), None)]
    if v_fmt is not None:
        moments.append((v_fmt, torch.zeros(n, device=device), None))
    step, skipped = torch.zeros((), device=device), torch.zeros((), dtype=torch.int64, device=device)
    scratch = torch.zeros(update.SCRATCH_WORDS, dtype=torch.int32, device=device)
    scalars = update.pack_scalars(dict(lr=1e-2, lerp_weight=0.1))
    keys, flags = (1, 2), (False, False)
    update.launch_update(kernel_id, False, param, grad, None, None, moments, step, scratch, skipped, keys, False, flags,
                         scalars)  # fmt: skip
    return param.cpu()


@contextlib.contextmanager
def _compile_time_failure(message):
    """The error a failed ``tl.static_assert`` raises: in Triton's interpreter (the CPU) an
    ``InterpreterError`` wrapping an ``AssertionError`` with the message; compiled (the GPU) a
    ``CompilationError`` at the outermost call whose chain of causes ends in the assertion's."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import InterpreterError

    with pytest.raises((InterpreterError, CompilationError)) as caught:
        yield
    chain, error = [], caught.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__
    assert any(re.search(message, text) for text in chain), chain


def test_an_unknown_algorithm_fails_to_compile(monkeypatch, device):
    """The update kernel's chain over ALGO ends in a static assertion: an id without a branch (let past
    the host's KERNEL_IDS check here) is refused, never run as the last algorithm's math."""
    from fusedopt.codecs import FP32
    from fusedopt.kernels import update

    assert not torch.equal(_launch_one(update.LION, FP32.kernel_format, device=device), torch.zeros(64))
    with pytest.raises(ValueError, match="no branch for kernel_id 7"):
        _launch_one(7, FP32.kernel_format, device=device)
    monkeypatch.setitem(update.KERNEL_IDS, 7, "unknown")
    with _compile_time_failure("no branch for this ALGO"):
        _launch_one(7, FP32.kernel_format, device=device)


@pytest.mark.parametrize("moment", ["m", "v"])
def test_an_unknown_moment_family_fails_to_compile(device, moment):
    """A KernelFormat family no kernel branch takes fails to compile in the decode, for either moment."""
    from fusedopt.codecs import FP32
    from fusedopt.codecs.base import KernelFormat
    from fusedopt.kernels import update

    unknown = KernelFormat(99)
    m_fmt, v_fmt = (unknown, FP32.kernel_format) if moment == "m" else (FP32.kernel_format, unknown)
    with _compile_time_failure("load_moment has no branch for this moment family"):
        _launch_one(update.ADAMW, m_fmt, v_fmt, device=device)


def test_a_normalised_first_moment_needs_a_root_grid_frame(device):
    """The normalised twin reads its frame's stored roots: beside any other second moment the kernel
    refuses to compile rather than read roots that are not there."""
    from fusedopt.codecs import FP32, codec_named
    from fusedopt.kernels import update

    norm2 = codec_named("norm2", True, torch.Size([8, 8])).kernel_format
    with _compile_time_failure("needs a root-grid second moment"):
        _launch_one(update.ADAMW, norm2, FP32.kernel_format, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_norm_kernel_is_get_total_norm(dtype, device):
    """kernels/norms.py: odd sizes, an empty tensor, one over several programs; torch's per-tensor
    norm rounded to the tensor's dtype, then the norm of those (bit for bit in bf16 and fp16 in the
    interpreter; otherwise up to the order of the fp32 sums); the same bits on every call."""
    from fusedopt.kernels import norms
    from fusedopt.kernels.norms import TILE, TILES, total_norm

    gen = torch.Generator().manual_seed(int(str(dtype)[-2:]))
    # sizes of whole 16-byte vectors (norms.fits): odd numbers of them, one over two programs, none
    sizes = [(8, 3.0), (40, 1.0), (TILE * TILES + 24, 0.01), (0, 1.0), (4104, 100.0)]
    tensors = [(torch.randn(n, generator=gen) * s).to(device, dtype) for n, s in sizes]
    assert norms.fits(tensors) and not norms.fits([torch.zeros(9, dtype=dtype, device=device)])
    got, expected = total_norm(tensors), torch.nn.utils.get_total_norm(tensors)
    assert got.dtype == expected.dtype == dtype
    # the order of the fp32 sums may move a rounding to bf16/fp16 by one unit on the GPU
    # (fp32: sums of 16384 squares in another order)
    rtol = 1e-6 if dtype == torch.float32 else 0.0 if device == "cpu" else torch.finfo(dtype).eps
    torch.testing.assert_close(got, expected, rtol=rtol, atol=0)
    assert torch.equal(total_norm(tensors), got)
    tensors[2][-1] = float("inf")  # the last element of the second program
    assert torch.isinf(total_norm(tensors))


def test_step_clips_with_the_norm_kernels_total_norm(monkeypatch, device):
    """fused=False with max_grad_norm on the kernel path: the step's norm comes from the norm kernel,
    once over every gradient, and equals torch's (bf16 here: bit for bit in the interpreter)."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, torch.bfloat16)) for s in (40, 4104, 16)]
    grads = [torch.randn(p.shape, generator=gen).to(device, torch.bfloat16) * 3 for p in params]
    opt = fusedopt.AdamW(params, lr=1e-2, max_grad_norm=1.0)
    calls = []
    from fusedopt.kernels import norms

    original = norms.total_norms
    monkeypatch.setattr(norms, "total_norms", lambda ts: calls.append(len(ts)) or original(ts))
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    assert calls == [3]
    rtol = 0.0 if device == "cpu" else torch.finfo(torch.bfloat16).eps  # one rounding on the GPU (above)
    torch.testing.assert_close(opt.grad_norm, torch.nn.utils.get_total_norm(grads), rtol=rtol, atol=0)


def test_the_norm_kernel_over_more_tensors_than_one_launch_takes_and_mixed_dtypes(device):
    """More than GROUP tensors, bf16 and fp32 interleaved (each dtype its own launches), sizes from
    one vector up: the norm equals torch's up to the order of fp32 sums."""
    from fusedopt.kernels import norms

    gen = torch.Generator().manual_seed(11)
    tensors = [
        torch.randn(16 * (1 + i % 7) * (1 + 300 * (i % 5 == 0)), generator=gen).to(
            device, torch.bfloat16 if i % 2 else torch.float32
        )
        for i in range(norms.GROUP + 9)
    ]
    got, expected = norms.total_norm(tensors), torch.nn.utils.get_total_norm(tensors)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
