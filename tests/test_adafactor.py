"""fusedopt.Adafactor: torch.optim.Adafactor's update, its options (beta1, CAME, Fira), both fused modes,
the factored kernels in Triton's interpreter, non-finite gradients, checkpoints and errors.

Gradients are given exactly: the loss is ``sum(p * G)``, so backward (which runs the release hooks
with ``fused=True``) produces ``G`` itself, and torch.optim.Adafactor gets the same ``G`` as ``p.grad``.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import PARITY_ATOL, PARITY_RTOL, beyond_parity, save_load

import fusedopt
from fusedopt.adafactor import col_shape, row_shape

# matrices, vectors, a 3-D tensor, a 0-d tensor; odd sizes (no dimension a multiple of 16)
SHAPES = [(7, 5), (13,), (3, 4, 6), (), (33, 70)]
SMALL_SHAPES = [(7, 5), (13,), (3, 4, 6), ()]  # for the interpreter


def _params(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _grads(shapes, steps, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]


def _run(opt, params, grads, *, fused):
    """One step per entry of ``grads``: by backward (release hooks) or by setting ``p.grad``."""
    for gs in grads:
        if fused:
            loss = sum((p * gr).sum() for p, gr in zip(params, gs))
            loss.backward()
        else:
            for p, gr in zip(params, gs):
                p.grad = gr.clone()
        opt.step()
        opt.zero_grad()


def _state_equal(oa, ob, pa, pb):
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        sa, sb = oa.state[x], ob.state[y]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


# --- torch.optim.Adafactor --------------------------------------------------------------------------

TORCH_CASES = [
    dict(),
    dict(lr=0.05, weight_decay=0.1),
    dict(maximize=True, eps=(1e-20, 1e-2), d=2.0),
    dict(lr=0.5, beta2_decay=-0.5, weight_decay=0.01),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kwargs", TORCH_CASES)
def test_equals_torch(fused, kwargs):
    steps = 30
    ref = _params(SHAPES)
    ours = _params(SHAPES)
    grads = _grads(SHAPES, steps)
    ref_opt = torch.optim.Adafactor(ref, **kwargs)
    opt = fusedopt.Adafactor(ours, **kwargs, state_bits=32, fused=fused)
    _run(ref_opt, ref, grads, fused=False)
    _run(opt, ours, grads, fused=fused)
    for p_ref, p in zip(ref, ours):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-7)
        state, ref_state = opt.state[p], ref_opt.state[p_ref]
        assert {k for k in state if k != "step"} == {k for k in ref_state if k != "step"}  # every moment compared
        for key in ref_state:
            torch.testing.assert_close(state[key].float(), ref_state[key].float(), rtol=1e-5, atol=1e-7)
    assert not torch.equal(ours[0], _params(SHAPES)[0])  # it moved


# --- options against plain fp64 references of the published updates -----------------------------


def _fp64_adafactor(p, grads, *, lr, beta1=None, beta3=None, came_eps=1e-16, growth_limit=None, eps2=1e-3, d=1.0):
    """Adafactor (torch's form: relative step, eps1 = fp32 eps, RMS clipping at d), then Fira's
    limiter on the clipped update (Chen et al. 2024: ||S_t|| <= gamma ||S_{t-1}||), momentum, and CAME's
    confidence (Luo et al. 2023, Algorithm 1: m_t / sqrt(S_t), S_t factored from (u_hat - m_t)^2 + eps)."""
    p = p.double().clone()
    eps1 = torch.finfo(torch.float32).eps
    r = c = v = m = rr = rc = None
    prev = None
    for t, g in enumerate(grads, start=1):
        g = g.double()
        w = t**-0.8
        alpha = max(eps2, p.pow(2).mean().sqrt().item()) * min(lr, 1 / math.sqrt(t))
        if g.dim() >= 2:
            rm, cm = (g * g).mean(-1, keepdim=True), (g * g).mean(-2, keepdim=True)
            r = rm if r is None else r + w * (rm - r)
            c = cm if c is None else c + w * (cm - c)
            var = r * c / r.mean(-2, keepdim=True).clamp(min=eps1)
        else:
            v = g * g if v is None else v + w * (g * g - v)
            var = v
        u = g / var.clamp(min=eps1 * eps1).sqrt()
        u_hat = u / max(1.0, u.pow(2).mean().sqrt().item() / d)
        if growth_limit is not None:
            norm = u_hat.norm().item()
            if prev is not None and norm > growth_limit * prev:
                u_hat = u_hat * (growth_limit * prev / norm)
            prev = u_hat.norm().item()
        update = u_hat
        if beta1 is not None:
            m = (1 - beta1) * u_hat if m is None else beta1 * m + (1 - beta1) * u_hat
            update = m
            if beta3 is not None and g.dim() >= 2:
                res = (u_hat - m) ** 2 + came_eps
                rr_new, rc_new = res.mean(-1, keepdim=True), res.mean(-2, keepdim=True)
                rr = (1 - beta3) * rr_new if rr is None else beta3 * rr + (1 - beta3) * rr_new
                rc = (1 - beta3) * rc_new if rc is None else beta3 * rc + (1 - beta3) * rc_new
                s = rr * rc / rr.mean(-2, keepdim=True)
                update = m / s.sqrt()
        p = p - alpha * update
    return p


OPTION_CASES = {
    "momentum": dict(beta1=0.9),
    "came": dict(beta1=0.9, beta3=0.999),
    "came-eps": dict(beta1=0.8, beta3=0.99, came_eps=1e-6),
    "fira": dict(growth_limit=1.01, d=10.0),  # d: RMS clipping would hide the norm's growth
    "fira-came": dict(beta1=0.9, beta3=0.999, growth_limit=1.05, d=10.0),
}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_options_equal_fp64_reference(name, fused):
    kwargs = OPTION_CASES[name]
    steps = 20
    params = _params(SHAPES)
    start = [p.detach().clone() for p in params]
    grads = _grads(SHAPES, steps)
    # growing gradients: the limiter acts (checked below), the confidence varies
    grads = [[g * (1 + 0.3 * t) for g in gs] for t, gs in enumerate(grads)]
    opt = fusedopt.Adafactor(params, lr=0.05, state_bits=32, fused=fused, **kwargs)
    _run(opt, params, grads, fused=fused)
    for i, p in enumerate(params):
        expected = _fp64_adafactor(start[i], [gs[i] for gs in grads], lr=0.05, **kwargs)
        torch.testing.assert_close(p.double(), expected, rtol=2e-5, atol=1e-6)
    moved = params[0].double() - start[0].double()
    if "growth_limit" in kwargs:  # the limiter changed the trajectory
        plain = {k: v for k, v in kwargs.items() if k != "growth_limit"}
        unlimited = _fp64_adafactor(start[0], [gs[0] for gs in grads], lr=0.05, **plain) - start[0].double()
        assert not torch.allclose(moved, unlimited, rtol=1e-2)
    if "beta3" in kwargs:  # CAME changed the trajectory
        plain = {k: v for k, v in kwargs.items() if k not in ("beta3", "came_eps")}
        no_came = _fp64_adafactor(start[0], [gs[0] for gs in grads], lr=0.05, **plain) - start[0].double()
        assert not torch.allclose(moved, no_came, rtol=1e-2)


# --- fused=True equals fused=False bit for bit ------------------------------------------------------


@pytest.mark.parametrize("beta1", [None, 0.9])
@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_equals_unfused_reference(dtype, bits, beta1):
    shapes = [(40, 33), (13,), (3, 8, 9)]
    grads = _grads(shapes, 4, dtype=dtype)
    kw = dict(lr=0.05, beta1=beta1, state_bits=bits, min_compress_numel=64, weight_decay=0.01)
    a, b = _params(shapes, dtype), _params(shapes, dtype)
    oa, ob = fusedopt.Adafactor(a, **kw), fusedopt.Adafactor(b, fused=True, **kw)
    _run(oa, a, grads, fused=False)
    _run(ob, b, grads, fused=True)
    _state_equal(oa, ob, a, b)
    assert any(k.endswith(".codes") for k in oa.state[a[0]]) == (beta1 is not None and bits in (8, 4))


# --- the factored kernels (Triton's interpreter on CPU; the GPU on a CUDA machine) ------------------

KERNEL_CASES = [
    (torch.float32, 32, None, {}),
    (torch.float32, 32, 0.9, dict(weight_decay=0.1, maximize=True)),
    (torch.bfloat16, 8, 0.9, {}),
    (torch.bfloat16, 4, 0.9, dict(growth_limit=1.01)),
    (torch.float32, 32, 0.9, dict(beta3=0.99, maximize=True)),  # CAME
    (torch.bfloat16, 8, 0.9, dict(beta3=0.999, came_eps=1e-6, growth_limit=1.05)),
    (torch.float16, 16, 0.9, {}),
    (torch.bfloat16, 8, None, dict(master_weight_bits=None)),
    (torch.bfloat16, 32, None, dict(master_weight_bits=32)),
    # gradients ~1e-6: v below eps1, the clamps of the row mean and of v decide the update
    (torch.float32, 32, None, dict(grad_scale=1e-6)),
    # eps1**2 = 1e-40 and v below it: subnormal, which the GPU's reciprocal square root flushes to zero
    (torch.float32, 32, 0.9, dict(eps=(1e-20, 1e-3), grad_scale=1e-22)),
    (torch.float32, 32, 0.9, dict(eps=(1e-20, 1e-3), grad_scale=1e-22, beta3=0.9, came_eps=1e-40)),
    # row * column statistic beyond fp32's range: v is inf (u = 0), as torch's division makes it
    (torch.float32, 32, None, dict(grad_scale=1e10)),
]


def _kernel_opt(params, bits, beta1, extra, **kw):
    return fusedopt.Adafactor(params, lr=0.05, beta1=beta1, state_bits=bits, min_compress_numel=0, **extra, **kw)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's, in the 1e10 case
@pytest.mark.parametrize("dtype,bits,beta1,extra", KERNEL_CASES)
def test_kernel_matches_reference(monkeypatch, device, dtype, bits, beta1, extra):
    """Reductions in another order than torch's: fp32 state and master weights within a few ulps, codes
    equal (a rounding may flip at a level edge: at most one element in a hundred, or one), parameters
    within a rounding of their dtype."""
    extra = dict(extra)
    scale = extra.pop("grad_scale", 1.0)
    grads = [[(g * scale).to(device) for g in gs] for gs in _grads(SMALL_SHAPES, 3, dtype=dtype)]
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
        params = [p.detach().to(device).requires_grad_() for p in _params(SMALL_SHAPES, dtype)]
        opt = _kernel_opt(params, bits, beta1, extra)
        _run(opt, params, grads, fused=False)
        out[backend] = (params, opt)
    (pa, oa), (pb, ob) = out["reference"], out["triton"]
    assert ob._dispatch._prepared, "the kernel did not run"
    for x, y in zip(pa, pb):
        tol = dict(rtol=PARITY_RTOL, atol=PARITY_ATOL) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(y.float(), x.float(), **tol)
        sa, sb = oa.state[x], ob.state[y]
        assert sa.keys() == sb.keys()
        for key in sa:
            if key == "master_correction":  # the masters agree (head + correction), checked below
                continue
            if sa[key].dtype == torch.float32:
                torch.testing.assert_close(sb[key], sa[key], rtol=1e-5, atol=1e-7)
            else:
                assert (sa[key] != sb[key]).sum().item() <= max(1, sa[key].numel() // 100), key
        # masters within fp32 round-off, but where a flipped moment code moved an element
        ref, got = oa.master_weight(x), ob.master_weight(y)
        off = beyond_parity(ref, got)
        assert off.sum().item() <= (max(1, ref.numel() // 100) if bits in (8, 4) else 0)


def test_kernel_accumulation(monkeypatch, device):
    """fused=True with accumulation_steps=2 on bf16 parameters: the kernels read the optimizer's
    accumulated gradient beside the last micro-batch's, as the reference does."""
    shapes = [(9, 17), (5,)]
    micro = [[g.to(device) for g in gs] for gs in _grads(shapes, 4, dtype=torch.bfloat16)]
    out = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
        params = [p.detach().to(device).requires_grad_() for p in _params(shapes, torch.bfloat16)]
        opt = _kernel_opt(params, 8, 0.9, {}, fused=True, accumulation_steps=2)
        for first, second in zip(micro[::2], micro[1::2]):
            for gs in (first, second):
                sum((p * g).sum() for p, g in zip(params, gs)).backward()
            opt.step()
        out.append([opt.master_weight(p) for p in params])
    assert opt._dispatch._prepared
    for ref, got in zip(*out):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_kernel_tall_matrix(monkeypatch, device):
    """Column sums over several spans of rows (added in order), against the reference."""
    shapes = [(1100, 3)]
    grads = [[g.to(device) for g in gs] for gs in _grads(shapes, 2)]
    out = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
        params = [p.detach().to(device).requires_grad_() for p in _params(shapes)]
        opt = fusedopt.Adafactor(params, state_bits=32)
        _run(opt, params, grads, fused=False)
        out.append((params[0], opt.state[params[0]]))
    assert opt._dispatch._prepared[params[0]].launch.splits > 1
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1][1]["col_var"], out[0][1]["col_var"], rtol=1e-5, atol=1e-7)


# the last: row * column statistic beyond fp32's range (v = inf, u = 0, as torch's division makes it)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's, in the 1e10 case
@pytest.mark.parametrize("beta1,extra", [(None, {}), (0.9, dict(beta3=0.99)), (None, dict(grad_scale=1e10))])
def test_kernel_rows_as_long_as_a_tile(monkeypatch, device, beta1, extra):
    """Rows of at least a tile's elements (the kernels take a tile's two rows' statistics as scalars):
    tiles that start mid-row, span two rows and cross from one slice of a 3-D tensor into the next (rows
    of 1100 and 1030 elements; 5 rows a slice), and several chunks of columns, against the reference."""
    shapes = [(3, 5, 1100), (2, 1030)]
    extra = dict(extra)
    scale = extra.pop("grad_scale", 1.0)
    grads = [[(g * scale).to(device) for g in gs] for gs in _grads(shapes, 2)]
    out = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
        params = [p.detach().to(device).requires_grad_() for p in _params(shapes)]
        opt = fusedopt.Adafactor(params, lr=0.05, beta1=beta1, state_bits=32, **extra)
        _run(opt, params, grads, fused=False)
        out.append((params, opt))
    (pa, oa), (pb, ob) = out
    assert ob._dispatch._prepared[pb[0]].launch.wide
    for x, y in zip(pa, pb):
        torch.testing.assert_close(y, x, rtol=PARITY_RTOL, atol=PARITY_ATOL)
        for key in oa.state[x]:
            if torch.is_tensor(oa.state[x][key]) and oa.state[x][key].is_floating_point():
                torch.testing.assert_close(ob.state[y][key], oa.state[x][key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta1,extra", [(None, {}), (0.9, {}), (0.9, dict(beta3=0.99, growth_limit=1.01))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_fused_equals_unfused(monkeypatch, device, dtype, beta1, extra):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    shapes = [(9, 17), (5,)]
    grads = [[g.to(device) for g in gs] for gs in _grads(shapes, 3, dtype=dtype)]
    a = [p.detach().to(device).requires_grad_() for p in _params(shapes, dtype)]
    b = [p.detach().to(device).requires_grad_() for p in _params(shapes, dtype)]
    oa, ob = _kernel_opt(a, 8, beta1, extra), _kernel_opt(b, 8, beta1, extra, fused=True)
    _run(oa, a, grads, fused=False)
    _run(ob, b, grads, fused=True)
    assert ob._dispatch._prepared
    _state_equal(oa, ob, a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_non_finite_gradient_skips(monkeypatch, device, backend):
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    shapes = [(6, 7), (5,)]
    params = [p.detach().to(device).requires_grad_() for p in _params(shapes)]
    opt = fusedopt.Adafactor(params, beta1=0.9, growth_limit=1.01, state_bits=8, min_compress_numel=0)
    grads = [[g.to(device) for g in gs] for gs in _grads(shapes, 2)]
    _run(opt, params, grads[:1], fused=False)
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    bad = [g.clone() for g in grads[1]]
    bad[0][2, 3] = float("nan")
    _run(opt, params, [bad], fused=False)
    assert torch.equal(params[0], before[0])
    for key, value in states[0].items():
        assert torch.equal(opt.state[params[0]][key], value), key
    assert not torch.equal(params[1], before[1])  # the finite one was updated
    assert int(opt.num_skipped_updates) == 1


# --- state, checkpoints, errors -------------------------------------------------------------------


def test_state_layout():
    params = _params([(40, 33), (3, 8, 9), (13,)])
    opt = fusedopt.Adafactor(params, beta1=0.9, beta3=0.99, growth_limit=1.02, state_bits=4, min_compress_numel=64)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    matrix, cube, vector = (opt.state[p] for p in params)
    assert matrix["row_var"].shape == row_shape(params[0].shape) == (40, 1)
    assert cube["col_var"].shape == col_shape(params[1].shape) == (3, 1, 9)
    assert matrix["exp_avg_res_row"].dtype == torch.float32 and "variance" not in matrix
    assert matrix["exp_avg.codes"].shape == ((40 * 33 + 1) // 2,)  # 4-bit first moment
    assert vector["variance"].shape == (13,) and "row_var" not in vector and "exp_avg_res_row" not in vector
    assert vector["update_norm"].shape == ()


@pytest.mark.parametrize("fused", [False, True])
def test_checkpoint_round_trip_and_resume(fused):
    shapes = [(40, 33), (13,), (3, 8, 9)]
    kw = dict(beta1=0.9, growth_limit=1.01, state_bits=8, min_compress_numel=64, fused=fused)
    grads = _grads(shapes, 6, dtype=torch.bfloat16)
    a = _params(shapes, torch.bfloat16)
    oa = fusedopt.Adafactor(a, **kw)
    _run(oa, a, grads[:3], fused=fused)
    saved = save_load({"opt": oa.state_dict(), "params": [p.detach().clone() for p in a]})
    b = [p.detach().clone().requires_grad_() for p in saved["params"]]
    ob = fusedopt.Adafactor(b, **kw)
    ob.load_state_dict(saved["opt"])
    _state_equal(oa, ob, a, b)
    _run(oa, a, grads[3:], fused=fused)
    _run(ob, b, grads[3:], fused=fused)
    _state_equal(oa, ob, a, b)


def test_loads_torch_state_dict_and_back():
    steps = 5
    ref, ours = _params(SHAPES), _params(SHAPES)
    grads = _grads(SHAPES, 2 * steps)
    ref_opt = torch.optim.Adafactor(ref, lr=0.05)
    _run(ref_opt, ref, grads[:steps], fused=False)
    with torch.no_grad():
        for p, q in zip(ours, ref):
            p.copy_(q)
    opt = fusedopt.Adafactor(ours, lr=0.05, state_bits=32)
    opt.load_state_dict(ref_opt.state_dict())
    # and a fusedopt state as torch.optim.Adafactor saves it, loaded by torch
    back = torch.optim.Adafactor(_params(SHAPES), lr=0.05)
    back.load_state_dict(opt.torch_state_dict())
    for p in back.param_groups[0]["params"]:
        assert set(back.state[p]) <= {"step", "row_var", "col_var", "variance"}
    _run(ref_opt, ref, grads[steps:], fused=False)
    _run(opt, ours, grads[steps:], fused=False)
    for p_ref, p in zip(ref, ours):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-7)


def test_a_nan_rms_is_taken_as_torch_takes_it():
    """eps1=0 and a zero gradient element: its update is 0/0. torch's Python max(1, nan) is 1, so only that
    element turns NaN; a clamp would spread the NaN over the tensor."""
    p0, g = torch.tensor([0.5, -1.0, 2.0, 0.25]), torch.tensor([0.1, 0.0, -0.3, 0.2])
    ref, ours = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ref_opt = torch.optim.Adafactor([ref], lr=0.01, eps=(0.0, 1e-3))
    opt = fusedopt.Adafactor([ours], lr=0.01, eps=(0.0, 1e-3), state_bits=32)
    ref.grad, ours.grad = g.clone(), g.clone()
    ref_opt.step()
    opt.step()
    assert torch.isnan(ours).tolist() == torch.isnan(ref).tolist() == [False, True, False, False]
    torch.testing.assert_close(ours[~torch.isnan(ours)], ref[~torch.isnan(ref)], rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_torch_state_dict_needs_a_first_moment_it_lacks():
    ref = _params([(6, 7)])
    ref_opt = torch.optim.Adafactor(ref)
    _run(ref_opt, ref, _grads([(6, 7)], 1), fused=False)
    opt = fusedopt.Adafactor(_params([(6, 7)]), beta1=0.9)
    with pytest.raises(ValueError, match="lacks 'exp_avg'"):
        opt.load_state_dict(ref_opt.state_dict())


ERRORS = [
    (dict(lr=-1.0), "Learning rate should be >= 0 but is: -1.0"),
    (dict(beta2_decay=0.5), "beta2_decay should be <= 0 but is: 0.5"),
    (dict(eps=(-1.0, 1e-3)), "epsilon1 should be >= 0 but is: -1.0"),
    (dict(eps=(None, -1.0)), "epsilon2 should be >= 0 but is: -1.0"),
    (dict(d=0.5), "Clipping threshold d should be >= 1 but is: 0.5"),
    (dict(weight_decay=-0.1), "weight_decay should be >= 0 but is: -0.1"),
    (dict(beta1=1.0), "Invalid beta1"),
    (dict(beta3=0.99), "beta3 \\(CAME\\) needs a first moment"),
    (dict(beta1=0.9, beta3=-0.1), "Invalid beta3"),
    (dict(growth_limit=0.5), "Invalid growth_limit"),
    (dict(came_eps=float("nan")), "Invalid came_eps"),
    (dict(foreach=True), "foreach=True is not supported"),
    (dict(state_bits=6), "Invalid state_bits"),
]


@pytest.mark.parametrize("kwargs,message", ERRORS)
def test_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fusedopt.Adafactor(_params([(3, 4)]), **kwargs)


@pytest.mark.parametrize("kwargs", [e[0] for e in ERRORS[:6]])
def test_torch_refuses_the_same(kwargs):
    with pytest.raises(ValueError):
        torch.optim.Adafactor(_params([(3, 4)]), **kwargs)


def test_accumulation_and_clipping_options():
    shapes = [(9, 10), (4,)]
    grads = _grads(shapes, 2)
    a, b = _params(shapes), _params(shapes)
    clipped = fusedopt.Adafactor(a, max_grad_norm=0.5, state_bits=32)
    plain = fusedopt.Adafactor(b, state_bits=32)
    _run(clipped, a, grads, fused=False)
    _run(plain, b, grads, fused=False)
    assert clipped.grad_norm is not None and not torch.equal(a[0], b[0])
    # accumulation: two micro-batches with fused=True equal their sum given at once
    c, d = _params(shapes), _params(shapes)
    oc = fusedopt.Adafactor(c, fused=True, accumulation_steps=2, state_bits=32)
    od = fusedopt.Adafactor(d, state_bits=32)
    for half in grads:
        sum((p * g).sum() for p, g in zip(c, half)).backward()
    oc.step()
    for p, g0, g1 in zip(d, grads[0], grads[1]):
        p.grad = g0 + g1
    od.step()
    for x, y in zip(c, d):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_planner_knows_adafactor():
    from fusedopt.profile.planner import MOMENT_BYTES, byte_model, layout_model

    shapes = [(4096, 4096), (4096,)]
    for kwargs, moments in (
        ({}, 0.0),
        ({"beta1": 0.9}, MOMENT_BYTES[8]),
        ({"beta1": 0.9, "state_bits": 4}, MOMENT_BYTES[4]),
    ):
        model = byte_model("fusedopt.Adafactor", kwargs, torch.bfloat16)
        assert model.state == moments and model.corrections == 1
        layout = layout_model("fusedopt.Adafactor", kwargs, torch.bfloat16, shapes)
        assert layout.state == pytest.approx(moments, abs=0.01)  # + the factored statistics
    assert byte_model("torch.Adafactor", {}, torch.float32).state == 0


@pytest.mark.parametrize(
    "config",
    [
        "fusedopt.Adafactor:fused=True",
        "fusedopt.Adafactor:beta1=0.9,fused=True",
        "fusedopt.Adafactor:beta1=0.9,state_bits=4,fused=True",
    ],
)
def test_planner_predicts_what_the_profiler_measures(config):
    """The configurations of the benchmarks (compare_memory.py, compare_fit.py): the planner's bytes
    per parameter, from the state layout, are what the profiler measures on a trained model, and
    its byte model (what compare_fit.py starts its search from) is the layout at 1.1B scale."""
    from fusedopt.profile import ModelSpec, plan, run_profile
    from fusedopt.profile.planner import byte_model, layout_model

    report = run_profile(
        "tiny",
        [config],
        device="cpu",
        dtype="bf16",
        seq_len=16,
        steps=2,
        isolate=False,
        allocator_pass=False,
        timeline=False,
        progress=False,
    )
    measured = report.results[0]
    assert measured["ok"], measured
    n = measured["num_params"]
    row = plan(None, 1.0, [config], model=ModelSpec.from_args("tiny", None, None), dtype="bf16", seq_len=16)[0]
    per = row.per_param
    assert per.source.startswith("layout") and per.grads_at_peak == 0  # gradients released in backward
    # the layout leaves out each tensor's 0-d fp32 step counter: 4 bytes per parameter tensor
    steps = 4 * len(ModelSpec.from_args("tiny", None, None).param_shapes())
    state = measured["state_bytes"] + measured["correction_bytes"]
    assert (per.state + per.corrections) * n + steps == pytest.approx(state, abs=1e-6)
    cats = measured["memory"]["persistent_breakdown"]["categories"]  # (its rest: the input batch)
    held = cats["parameters"] + cats["corrections"] + cats["optimizer_state"]
    assert row.persistent + steps == pytest.approx(held, abs=1)  # int() of the product
    options = fusedopt.profile.parse_config(config)
    shapes = ModelSpec.from_args("1b", None, None).param_shapes()
    layout = layout_model(options.optimizer, options.kwargs, torch.bfloat16, shapes)
    model = byte_model(options.optimizer, options.kwargs, torch.bfloat16)
    assert model.at_peak == pytest.approx(layout.at_peak, abs=0.01)


@pytest.mark.parametrize("fused", [False, True])
def test_clipping_and_grad_scaler(fused):
    """max_grad_norm and a GradScaler as with every fusedopt optimizer: a scaled run (a power-of-two
    scale, no overflow) equals the unscaled run bit for bit, clipping included; opt.grad_norm is the
    exact global norm of the (unscaled) gradients."""
    shapes = [(9, 10), (4,)]
    grads = _grads(shapes, 3)
    runs = []
    for scaled in (False, True):
        params = _params(shapes)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100) if scaled else None
        opt = fusedopt.Adafactor(
            params, beta1=0.9, max_grad_norm=2.0, fused=fused, grad_scaler=scaler if fused else None
        )
        for gs in grads:
            loss = sum((p * g).sum() for p, g in zip(params, gs))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            norm = opt.grad_norm.clone()  # kept after step()
            opt.zero_grad()
            expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
            assert expected > 2.0  # the gradients were clipped
        runs.append(params)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
