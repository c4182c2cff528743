"""Gradient clipping through the optimizer (``max_grad_norm``). ``fused=False``: exactly
``torch.nn.utils.clip_grad_norm_`` over the step's finite gradients, then the update; ``opt.grad_norm``
is torch's total norm, a device tensor. ``fused=True``: one-pass clipping inside the release hooks
(``fusedopt/clipping.py``): each method's coefficients against a float64 oracle, the exact norm in
``opt.grad_norm`` once backward has finished, bit-identity with ``fused=False`` whenever nothing
clips."""

import math

import pytest
import torch
from cases import algorithm_cases, cross, dtype_cases, format_cases
from helpers import inputs, loss_fn, make_model, step_with

import fusedopt
from fusedopt.clipping import CLIP_METHODS, REMOVED_CLIP_METHODS, ReleaseClipping, scale_

N_STEPS = 30


def _run(make_opt, clip_in_loop: float | None, scales):
    model = make_model(seed=0)
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    norms = []
    for scale in scales:
        x = torch.randn(4, 7, generator=gen)
        opt.zero_grad()
        (loss_fn(model, x) * scale).backward()
        if clip_in_loop is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_in_loop))
        opt.step()
        if clip_in_loop is None:
            norms.append(opt.grad_norm.clone())
    return model, norms


# losses scaled so that some steps clip (norm above 1) and some do not
SCALES = [0.05 if i % 3 else 20.0 for i in range(N_STEPS)]


@pytest.mark.parametrize(
    "fused_cls, torch_cls, kwargs",
    [
        (fusedopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (fusedopt.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.01)),
    ],
    ids=["adamw", "sgd"],
)
def test_clipping_equals_torch_clip_then_torch_optimizer(fused_cls, torch_cls, kwargs):
    ours, our_norms = _run(lambda p: fused_cls(p, state_bits=32, max_grad_norm=1.0, **kwargs), None, SCALES)
    ref, ref_norms = _run(lambda p: torch_cls(p, **kwargs), 1.0, SCALES)
    clipped = [float(n) > 1.0 for n in ref_norms]
    assert any(clipped) and not all(clipped)  # steps that clip and steps that do not
    for a, b in zip(our_norms, ref_norms):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_clipping_changes_the_trajectory_and_grad_norm_is_a_device_tensor():
    clipped, norms = _run(lambda p: fusedopt.AdamW(p, lr=1e-2, state_bits=32, max_grad_norm=1.0), None, SCALES[:6])
    plain = make_model(seed=0)
    opt = fusedopt.AdamW(plain.parameters(), lr=1e-2, state_bits=32)
    gen = torch.Generator().manual_seed(1)
    for scale in SCALES[:6]:
        opt.zero_grad()
        (loss_fn(plain, torch.randn(4, 7, generator=gen)) * scale).backward()
        opt.step()
    assert opt.grad_norm is None  # nothing computed without max_grad_norm
    assert any(not torch.equal(a, b) for a, b in zip(clipped.parameters(), plain.parameters()))
    assert all(isinstance(n, torch.Tensor) and n.dim() == 0 for n in norms)


def test_a_non_finite_gradient_under_clipping_never_enters_the_weights():
    """An inf makes grad_norm inf, as torch's; the coefficient comes from the finite gradients, and
    the parameter holding the inf is skipped (the tests at the end of this file hold the details)."""
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, torch.randn(4, 7)).backward()
    first = next(model.parameters())
    first.grad[0, 0] = float("inf")
    opt.step()
    assert torch.isinf(opt.grad_norm)
    assert torch.equal(first, before[0])  # skipped
    assert int(opt.num_skipped_updates) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(t).all() for st in opt.state.values() for t in st.values() if t.is_floating_point())


def _oracle(method: str, windows: list[list[list[tuple[int, float]]]], max_norm: float) -> list[list[float]]:
    """Each method's coefficient per (parameter index, squared norm), in float64, from the documented
    formulas (the module docstring of fusedopt/clipping.py): a window is a list of batches, and a
    batch's estimate counts the whole batch as seen."""
    last: dict[int, float] = {}
    average: dict[int, tuple[float, int]] = {}
    out = []
    for window in windows:
        known = sum(last.values())
        seen = seen_hist = seen_last = 0.0
        coefficients = []
        for batch in window:
            for index, sq in batch:
                seen += sq
                if index in last:
                    seen_hist += sq
                    seen_last += last[index]
            unseen = max(known - seen_last, 0.0)
            growth = seen_hist / seen_last if seen_last > 0 else 1.0
            c_batch = min(1.0, max_norm / (math.sqrt(seen + unseen * growth) + 1e-6))
            for index, sq in batch:
                c = c_batch
                if method == "adagc":
                    avg, count = average.get(index, (None, 0))
                    if count >= 10:
                        c = min(c, 1.05 * avg / (math.sqrt(sq) + 1e-6))
                    clipped = math.sqrt(sq) * c
                    average[index] = (clipped if avg is None else 0.98 * avg + 0.02 * clipped, count + 1)
                coefficients.append(c)
                last[index] = sq
        out.append(coefficients)
    return out


@pytest.mark.parametrize("method", CLIP_METHODS)
def test_release_clipping_coefficients_follow_the_documented_estimates(method):
    """Four parameters over 14 windows, released in batches of one to three: steady noise, a window
    where every gradient is 300 times larger (a spike), a parameter that is missing from one window,
    one that joins late (in a batch with parameters that have a history), and a bf16 gradient."""
    gen = torch.Generator().manual_seed(3)
    windows = []
    for w in range(14):
        spike = 300.0 if w == 11 else 1.0
        order = [2, 0, 3, 1] if w % 2 else [0, 1, 2, 3]
        window = [(i, float((1 + i) * spike * (0.5 + torch.rand((), generator=gen))) ** 2) for i in order]
        if w == 5:
            window = window[:2]  # two parameters had no gradient in this window
        if w >= 12:
            window.insert(1, (7, 4.0))
        cuts = [1, 3] if w % 3 == 0 else [2, 3] if w % 3 == 1 else [1, 2]
        windows.append([window[a:b] for a, b in zip([0, *cuts], [*cuts, len(window)]) if window[a:b]])
    clipper = ReleaseClipping(2.0, method)
    got = []
    for window in windows:
        coefficients = []
        for batch in window:
            grads = [torch.full((5,), math.sqrt(sq / 5), dtype=torch.float32) for _, sq in batch]
            before = [g.clone() for g in grads]
            got_coefficients = clipper.clip([index for index, _ in batch], [[g] for g in grads])
            assert got_coefficients.shape == (len(batch),)
            for g, c in zip(grads, got_coefficients.unbind()):
                scale_([g], c)
            coefficients += [float(g[0]) / float(b[0]) for g, b in zip(grads, before)]
        flat = [s for batch in window for _, s in batch]
        torch.testing.assert_close(clipper.norm().double(), torch.tensor(math.sqrt(sum(flat))).double())
        clipper.new_window()
        got.append(coefficients)
    expected = _oracle(method, windows, 2.0)
    for g, e in zip(got, expected):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(e), rtol=1e-5, atol=0)
    spike = expected[11]
    exact = min(1.0, 2.0 / math.sqrt(sum(s for batch in windows[11] for _, s in batch)))
    assert spike[0] < 1.5 * exact  # the spike is recognised at the first batch
    if method == "adagc":  # never above "scaled"; below it where a tensor's own history binds
        pairs = [(a, b) for w, v in zip(expected, _oracle("scaled", windows, 2.0)) for a, b in zip(w, v)]
        assert all(a <= b for a, b in pairs) and any(a < 0.99 * b for a, b in pairs)


def _clip_sequence(clipper, device, sharded: bool, seed: int = 5):
    """Nine windows of batches of one to forty parameters (odd sizes), some indices joining late,
    a spike window, non-finite norms in two batches, accumulated buffers in one, mixed dtypes in
    one, one gradient of 40000 elements (several chunks of the kernel's sums), bf16 and fp16
    gradients of multiples of 16 elements in the last two windows; every
    coefficient (fp32 as clip returns it: NaN where the norm is not finite), norm() and state_dict()
    per window."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = {7: [torch.bfloat16], 8: [torch.float16], 3: [torch.float32, torch.bfloat16]}
    out = []
    for w in range(9):
        spike = 50.0 if w == 6 else 1.0
        count = 23 if w < 3 else 61
        order = torch.randperm(count, generator=gen).tolist()
        coefficients = []
        kinds = dtypes.get(w, [torch.float32])
        while order:
            size = min(len(order), int(torch.randint(1, 41, (), generator=gen)))
            batch, order = order[:size], order[size:]
            sizes = [16 * (1 + i % 7) if w >= 7 else 3 + i % 7 for i in batch]  # w >= 7: vector loads
            grads = [[spike * torch.randn(n, generator=gen, dtype=torch.float64)] for n in sizes]
            if w == 2 and not coefficients:
                grads[0] = [torch.randn(40000, generator=gen, dtype=torch.float64) / 100]
            grads = [[g[0].to(kinds[k % len(kinds)]).to(device)] for k, g in enumerate(grads)]
            if w == 4 and len(batch) > 2:
                grads[1][0][0] = float("nan") if sharded else float("inf")
            if w == 5 and not sharded:
                grads[0] = [grads[0][0], torch.ones_like(grads[0][0])]  # with an accumulated buffer
            sq = None
            if sharded:
                sq = torch.stack([g[0].double().square().sum() for g in grads])
            before = [[g.clone() for g in entry] for entry in grads]
            c = clipper.clip(batch, grads, sq)
            assert c.shape == (len(batch),) and c.dtype == torch.float32 and c.device == grads[0][0].device
            for entry, was in zip(grads, before):  # the gradients are left as they are
                for g, b in zip(entry, was):
                    torch.testing.assert_close(g, b, rtol=0, atol=0, equal_nan=True)
            coefficients += c.tolist()
            if w == 4 and len(batch) > 2:  # only the parameter whose norm is not finite is skipped
                assert math.isnan(coefficients[-len(batch) + 1])
                assert not any(math.isnan(x) for i, x in enumerate(c.tolist()) if i != 1)
        state = clipper.state_dict({i: i for i in range(count)})
        out.append((coefficients, float(clipper.norm()), state))
        clipper.new_window()
    return out


@pytest.mark.parametrize("method", CLIP_METHODS)
@pytest.mark.parametrize("sharded", [False, True])
def test_release_clipping_kernel_matches_its_reference(monkeypatch, device, method, sharded):
    """The bookkeeping kernel (``kernels/clipping.py``; the interpreter on the CPU) against
    ``ReleaseClipping``'s torch reference on the same device. Given the squared norms (sharded), the
    same arithmetic: the coefficients agree to the fp32 rounding of a float64 value whose sums were
    added in another order, the history to float64's. Where the kernel sums the gradients' squares
    itself (fp32, in its own order, against torch's fp32 norm squared), to a few fp32 roundings."""
    from fusedopt.dispatch import release_clip_kernel

    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    got = _clip_sequence(ReleaseClipping(3.0, method, release_clip_kernel), device, sharded)
    want = _clip_sequence(ReleaseClipping(3.0, method), device, sharded)
    rtol, history_rtol = (2**-23, 1e-13) if sharded else (1e-6, 1e-6)
    clipped = 0
    for (c_got, n_got, s_got), (c_want, n_want, s_want) in zip(got, want):
        assert len(c_got) == len(c_want)
        torch.testing.assert_close(torch.tensor(c_got), torch.tensor(c_want), rtol=rtol, atol=0, equal_nan=True)
        clipped += sum(c < 1 for c in c_want)
        assert n_got == pytest.approx(n_want, rel=1e-6, nan_ok=True)
        for key in ("known", "last_total"):
            assert (s_got[key] is None) == (s_want[key] is None)
            if s_want[key] is not None:
                torch.testing.assert_close(s_got[key], s_want[key], rtol=history_rtol, atol=0, equal_nan=True)
        assert sorted(s_got["params"]) == sorted(s_want["params"])
        for pid, entry in s_want["params"].items():
            assert sorted(s_got["params"][pid]) == sorted(entry)
            for key, value in entry.items():
                torch.testing.assert_close(torch.as_tensor(s_got["params"][pid][key]), torch.as_tensor(value),
                                           rtol=history_rtol, atol=0)  # fmt: skip
    assert clipped > 10  # the sequence clips


def test_release_clipping_scales_a_batch_of_mixed_dtypes_and_accumulated_buffers_like_clip_grad_norm():
    """One batch: a bf16 gradient, an fp32 one, and a gradient with its accumulated buffer. With no
    history the estimate is the batch's own norm, so the coefficient is clip_grad_norm_'s; ``scale_``
    applies it to every tensor in its own dtype as torch's in-place multiply does on the CPU."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(33, generator=gen).to(torch.bfloat16)
    b = torch.randn(7, 3, generator=gen)
    c, c_accum = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    expected = [t.clone() for t in (a, b, c, c_accum)]
    norm = torch.linalg.vector_norm(torch.cat([a.float(), b.flatten(), c + c_accum]))
    coefficient = (0.5 / (norm + 1e-6)).clamp(max=1.0)
    assert coefficient < 0.2
    for t in expected:
        t.mul_(coefficient)
    clipper = ReleaseClipping(0.5, "scaled")
    got_coefficients = clipper.clip([0, 1, 2], [[a], [b], [c, c_accum]])
    assert got_coefficients.dtype == torch.float32 and got_coefficients.shape == (3,)
    torch.testing.assert_close(got_coefficients, coefficient.float().expand(3), rtol=1e-6, atol=0)
    got_coefficient = got_coefficients[0]
    scale_([a, b, c, c_accum], got_coefficient)
    for got, want in zip((a, b, c, c_accum), expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    torch.testing.assert_close(clipper.norm(), norm, rtol=1e-6, atol=0)


@pytest.mark.parametrize("method", sorted(REMOVED_CLIP_METHODS))
def test_a_removed_release_clipping_method_is_refused_by_name(method):
    with pytest.raises(ValueError, match=f"release_clipping='{method}' was removed.*'scaled'"):
        fusedopt.AdamW(make_model().parameters(), fused=True, max_grad_norm=1.0, release_clipping=method)


@pytest.mark.parametrize("method", sorted(REMOVED_CLIP_METHODS))
def test_a_checkpoint_of_a_removed_method_loads_with_its_history_and_says_so(method):
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=0.3)
    for x in inputs(2):
        loss_fn(model, x).backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    assert saved["fusedopt"]["release_clipping"]["method"] == "scaled"
    saved["fusedopt"]["release_clipping"]["method"] = method
    opt.remove_hooks()
    resumed = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=0.3)
    with pytest.warns(UserWarning, match=f"release_clipping='{method}', which was removed.*continues with .*'scaled'"):
        resumed.load_state_dict(saved)
    history = saved["fusedopt"]["release_clipping"]["params"]
    loaded = resumed.state_dict()["fusedopt"]["release_clipping"]["params"]
    assert sorted(loaded) == sorted(history) and len(history) == len(list(model.parameters()))
    assert all(torch.equal(history[i]["norm_sq"], loaded[i]["norm_sq"]) for i in history)


def _release_run(fused, *, max_grad_norm, dtype=torch.float32, micro_batches=1, steps=6, scales=None, **options):
    model = make_model(seed=0, dtype=dtype)
    opt = fusedopt.AdamW(
        model.parameters(),
        lr=1e-2,
        fused=fused,
        max_grad_norm=max_grad_norm,
        accumulation_steps=micro_batches if fused else 1,
        **options,
    )
    norms = []
    xs = inputs(steps * micro_batches, dtype=dtype)
    for step in range(steps):
        for x in xs[step * micro_batches : (step + 1) * micro_batches]:
            (loss_fn(model, x) * (scales[step] if scales else 1.0)).backward()
        if fused and max_grad_norm is not None:
            norms.append(opt.grad_norm.clone())  # before step(): the norm of this backward
        opt.step()
        if max_grad_norm is not None:
            norms.append(opt.grad_norm.clone())
        opt.zero_grad()
    return model, opt, norms


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_release_grad_norm_is_the_exact_global_norm(micro_batches):
    """fused=True's grad_norm after backward (and after step()) is the norm fused=False computes
    exactly, up to summation order; with accumulation, of the accumulated gradient. A large
    max_grad_norm keeps the trajectories equal, so the norms can be compared step by step."""
    *_, exact = _release_run(False, max_grad_norm=1e6, micro_batches=1, steps=4 * micro_batches)
    _, _, released = _release_run(True, max_grad_norm=1e6, micro_batches=micro_batches, steps=4)
    if micro_batches == 1:
        for i, norm in enumerate(exact):
            torch.testing.assert_close(released[2 * i], norm, rtol=1e-6, atol=0)
            assert torch.equal(released[2 * i + 1], released[2 * i])  # kept after step()
    else:  # the accumulated gradient's norm: larger than one micro-batch's, finite
        model = make_model(seed=0)
        xs = inputs(3)
        for x in xs:
            loss_fn(model, x).backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.testing.assert_close(released[0], expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("fmt", format_cases())
@pytest.mark.parametrize("dtype", dtype_cases(torch.float32, torch.bfloat16))
def test_release_is_bit_identical_to_fused_false_when_nothing_clips(fmt, dtype):
    """A max_grad_norm no step reaches: coefficient 1 in both modes, so the same parameters and state."""
    a, opt_a, _ = _release_run(False, max_grad_norm=1e6, dtype=dtype, **fmt.kwargs)
    b, opt_b, _ = _release_run(True, max_grad_norm=1e6, dtype=dtype, **fmt.kwargs)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(a.parameters(), b.parameters()):
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key


def test_release_clipping_clips_and_grad_norm_is_exact_once_backward_has_finished():
    """With a max_grad_norm every step exceeds, fused=True changes the trajectory against no
    clipping; grad_norm after one backward is the norm of the gradients as autograd made them."""
    clipped, _, norms = _release_run(True, max_grad_norm=0.1, steps=3, scales=[10.0] * 3)
    plain, _, _ = _release_run(True, max_grad_norm=None, steps=3, scales=[10.0] * 3)
    assert all(float(n) > 0.1 for n in norms)
    assert all(not torch.equal(p, q) for p, q in zip(clipped.parameters(), plain.parameters()))
    model = make_model(seed=0)
    grads = {}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(p, p.grad.clone()))
    opt = fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=0.1)
    (loss_fn(model, inputs(1)[0]) * 10).backward()
    total = torch.nn.utils.get_total_norm(list(grads.values()))
    assert float(total) > 0.1
    torch.testing.assert_close(opt.grad_norm, total, rtol=1e-6, atol=0)


def test_release_clipping_of_a_non_finite_gradient_skips_only_that_parameter():
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=1.0)
    first = model[0].weight
    first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, inputs(1)[0]).backward()
    opt.step()
    assert torch.isinf(opt.grad_norm)
    assert int(opt.num_skipped_updates) == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) == (p is first)
        assert torch.isfinite(p).all()


def test_invalid_release_clipping_is_refused():
    with pytest.raises(ValueError, match="Invalid release_clipping: 'global'"):
        fusedopt.AdamW(make_model().parameters(), fused=True, max_grad_norm=1.0, release_clipping="global")


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "1", True])
def test_invalid_max_grad_norm_is_refused(value):
    with pytest.raises(ValueError, match="max_grad_norm"):
        fusedopt.Lion(make_model().parameters(), max_grad_norm=value)


def test_max_grad_norm_in_a_group_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="'max_grad_norm' is an optimizer-wide option"):
        fusedopt.AdamW([{"params": list(model.parameters()), "max_grad_norm": 1.0}])


@pytest.mark.parametrize("method", CLIP_METHODS)
def test_release_clipping_resumes_bit_for_bit(method, tmp_path):
    """Its history (each parameter's last norm, adagc's averages) travels in the checkpoint: a run
    resumed from step 12 equals the uninterrupted one."""
    scales = [1.0, 40.0, 0.5] * 8

    def run(steps, resume_from=None):
        model = make_model(seed=0)
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=0.3, release_clipping=method)
        start = 0
        if resume_from is not None:
            saved = torch.load(resume_from, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = saved["step"]
        xs = inputs(len(scales))
        for step in range(start, steps):
            (loss_fn(model, xs[step]) * scales[step]).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    full, _ = run(24)
    half, opt = run(12)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": half.state_dict(), "opt": opt.state_dict(), "step": 12}, path)
    resumed, opt2 = run(24, resume_from=path)
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    # without the history the resumed run differs: the check above could fail
    model = make_model(seed=0)
    opt3 = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=0.3, release_clipping=method)
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    del saved["opt"]["fusedopt"]["release_clipping"]
    opt3.load_state_dict(saved["opt"])
    xs = inputs(len(scales))
    for step in range(12, 24):
        (loss_fn(model, xs[step]) * scales[step]).backward()
        opt3.step()
        opt3.zero_grad()
    assert any(not torch.equal(p, q) for p, q in zip(full.parameters(), model.parameters()))


# --- a non-finite gradient under clipping skips its own parameter, and only it -------------------

# whole 16-byte vectors in fp32 and bf16 (the norm kernel takes them); Adafactor factors the matrices
SKIP_SHAPES = [(16, 8), (32,), (8, 12), (64,)]
BAD = 2  # the parameter whose gradient is not finite in the last step
SKIP_CASES = cross(
    algorithm_cases("adamw", "sgd-momentum", "lion", "adafactor"), dtype_cases(torch.float32, torch.bfloat16)
)
NON_FINITE = [pytest.param(float("nan"), id="nan"), pytest.param(float("inf"), id="inf")]
BACKENDS = ["reference", "triton"]


def _skip_gradients(dtype, device, last: float | None) -> list[list[torch.Tensor]]:
    """Three steps of gradients whose norm is far above 1, so every step clips at max_grad_norm=1.
    In the last, parameter BAD's gradient holds ``last`` in one element (None: it is all zero)."""
    gen = torch.Generator().manual_seed(7)
    steps = [[(3 * torch.randn(s, generator=gen)).to(device, dtype) for s in SKIP_SHAPES] for _ in range(3)]
    if last is None:
        steps[-1][BAD].zero_()
    else:
        steps[-1][BAD].view(-1)[5] = last
    return steps


def _skip_run(algo, dtype, device, fused, steps, max_grad_norm, clip_finite=None):
    """``algo`` over fresh parameters, one step per entry of ``steps``: the parameters, the optimizer
    and a snapshot before the last step (parameters, states, skipped count). ``clip_finite``: torch's
    ``clip_grad_norm_`` to that norm over the finite gradients, then the step (the optimizer's own
    ``max_grad_norm`` None)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SKIP_SHAPES]
    opt = algo.make(params, lr=1e-2, fused=fused, max_grad_norm=max_grad_norm)
    for grads in steps:
        snapshot = (
            [p.detach().clone() for p in params],
            [{key: value.clone() for key, value in opt.state[p].items()} for p in params],
            opt.num_skipped_updates.clone(),
        )
        grads = [g.clone() for g in grads]
        if clip_finite is None:
            step_with(opt, params, grads, fused)
            continue
        for p, g in zip(params, grads):
            p.grad = g
        torch.nn.utils.clip_grad_norm_([p for p in params if torch.isfinite(p.grad).all()], clip_finite)
        opt.step()
        opt.zero_grad()
    return params, opt, snapshot


def _assert_same(params, opt, want_params, want_opt, which) -> None:
    """Parameters ``which`` and their states are the same bits in both runs."""
    for i in which:
        assert torch.equal(params[i], want_params[i]), f"parameter {i}"
        state, want = opt.state[params[i]], want_opt.state[want_params[i]]
        assert sorted(state) == sorted(want), f"parameter {i}"
        for key, value in want.items():
            assert torch.equal(state[key], value), f"parameter {i}, {key}"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN in the interpreter
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("fused", [False, True], ids=["fused_false", "fused_true"])
@pytest.mark.parametrize("algo,dtype", SKIP_CASES)
def test_a_non_finite_gradient_under_clipping_skips_only_its_parameter(
    monkeypatch, device, algo, dtype, fused, value, backend
):
    """A NaN (or an inf) in one gradient of a step that clips: that parameter, its state and step
    count stay as they were, num_skipped_updates counts it, and every other parameter gets the update
    it gets where that gradient is zero (a norm of 0: nothing added to the norm, or under release to
    the estimate), bit for bit. grad_norm is the norm of all the gradients, as torch's: NaN or inf."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    steps = _skip_gradients(dtype, device, value)
    params, opt, (before, states, skipped) = _skip_run(algo, dtype, device, fused, steps, 1.0)
    zero, zero_opt, _ = _skip_run(algo, dtype, device, fused, _skip_gradients(dtype, device, None), 1.0)
    assert torch.nn.utils.get_total_norm([g for i, g in enumerate(steps[-1]) if i != BAD]) > 10  # it clips
    assert torch.equal(params[BAD], before[BAD])
    state = opt.state[params[BAD]]
    assert sorted(state) == sorted(states[BAD]) and "step" in state
    for key, saved in states[BAD].items():
        assert torch.equal(state[key], saved), key
    assert int(opt.num_skipped_updates) == int(skipped) + 1
    assert int(zero_opt.num_skipped_updates) == 0
    others = [i for i in range(len(SKIP_SHAPES)) if i != BAD]
    assert all(not torch.equal(params[i], before[i]) for i in others)
    _assert_same(params, opt, zero, zero_opt, others)
    assert torch.isnan(opt.grad_norm) if math.isnan(value) else torch.isposinf(opt.grad_norm)
    assert torch.isfinite(zero_opt.grad_norm)


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("algo,dtype", SKIP_CASES)
def test_fused_false_is_clip_grad_norm_over_the_finite_gradients_then_the_step(monkeypatch, device, algo, dtype, value):
    """fused=False with max_grad_norm, a NaN or an inf in one gradient: the same bits as torch's
    clip_grad_norm_ over the other gradients, then an unclipped step (the reference path, which
    rounds the clipped gradient to its dtype as torch's in-place multiply does)."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", "reference")
    steps = _skip_gradients(dtype, device, value)
    params, opt, _ = _skip_run(algo, dtype, device, False, steps, 1.0)
    want, want_opt, _ = _skip_run(algo, dtype, device, False, steps, None, clip_finite=1.0)
    _assert_same(params, opt, want, want_opt, range(len(SKIP_SHAPES)))
    assert int(opt.num_skipped_updates) == int(want_opt.num_skipped_updates) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo,dtype", SKIP_CASES)
def test_a_nan_gradient_leaves_fused_true_and_fused_false_bit_identical_when_nothing_clips(
    monkeypatch, device, algo, dtype, backend
):
    """A max_grad_norm above every norm: both modes take coefficient 1 from the finite gradients (a
    NaN in torch's norm would give every update a NaN coefficient), skip the NaN's parameter alone,
    and agree bit for bit."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    steps = _skip_gradients(dtype, device, float("nan"))
    a, opt_a, (before, _, _) = _skip_run(algo, dtype, device, False, steps, 1e6)
    b, opt_b, _ = _skip_run(algo, dtype, device, True, steps, 1e6)
    _assert_same(a, opt_a, b, opt_b, range(len(SKIP_SHAPES)))
    assert int(opt_a.num_skipped_updates) == int(opt_b.num_skipped_updates) == 1
    assert [torch.equal(p, q) for p, q in zip(a, before)] == [i == BAD for i in range(len(SKIP_SHAPES))]
    assert torch.isnan(opt_a.grad_norm) and torch.isnan(opt_b.grad_norm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_total_norm_gives_each_gradients_norm_in_the_order_given(monkeypatch, device, backend):
    """``dispatch.total_norm`` (the norm kernel, or torch's ops): each tensor's norm in the order of
    the tensors, also where torch's grouping by dtype reorders them (fp32 and bf16 interleaved) and
    where one is NaN or inf; the total is get_total_norm's (bit for bit on torch's path)."""
    from fusedopt.dispatch import total_norm

    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    gen = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(16 * (1 + i), generator=gen).to(device, torch.bfloat16 if i % 2 else torch.float32)
        for i in range(6)
    ]
    # each tensor's norm as get_total_norm computes it (torch's multi-tensor norm on the GPU, which may
    # differ from vector_norm in the last bit)
    expected = torch.stack([torch._foreach_norm([t], 2.0)[0].float() for t in tensors])
    rtol = 0.0 if backend == "reference" else 1e-6
    total, each = total_norm(tensors)
    torch.testing.assert_close(each.float(), expected, rtol=rtol, atol=0)
    want = torch.nn.utils.get_total_norm(tensors)
    torch.testing.assert_close(total, want, rtol=rtol, atol=0)
    tensors[3][4], tensors[4][7] = float("nan"), float("inf")
    total, each = total_norm(tensors)
    assert torch.isnan(total)
    assert torch.isnan(each[3]) and torch.isposinf(each[4])
    finite = [i for i in range(6) if i not in (3, 4)]
    torch.testing.assert_close(each[finite].float(), expected[finite], rtol=rtol, atol=0)


def _sharded_non_finite(rank: int, world_size: int) -> None:
    """FSDP2 over two ranks, fused=False, SGD with momentum (the update is linear in the
    coefficient): a NaN in rank 1's shard of one weight's gradient, in a step that clips."""
    from test_fsdp import local_batch, loss_of, make_mlp, params_of, same_on_every_rank, shard

    from fusedopt.sharding import local

    runs = []
    for poison in (float("nan"), None):  # None: that weight's gradient is zero on every rank
        model = shard(make_mlp())
        target = model[2].weight
        index = next(i for i, p in enumerate(model.parameters()) if p is target)
        opt = fusedopt.SGD(model.parameters(), lr=1e-1, momentum=0.9, state_bits=32, max_grad_norm=0.05)
        for step in range(2):
            loss_of(model, local_batch(step, rank, world_size)).backward()
            if step == 1:
                before = params_of(model)
                if poison is None:
                    local(target.grad).zero_()
                elif rank == 1:
                    local(target.grad).view(-1)[0] = poison
            opt.step()
            opt.zero_grad()
        steps = torch.stack([opt.state[p]["step"] for p in model.parameters()])
        runs.append((params_of(model), before, steps, opt))
    (got, before, steps, opt), (want, _, want_steps, want_opt) = runs
    assert torch.equal(got[index], before[index])  # on every rank, not only the one whose shard held the NaN
    assert [int(s) for s in steps] == [1 if i == index else 2 for i in range(len(got))]
    assert same_on_every_rank(steps)
    assert int(opt.num_skipped_updates) == 1 and int(want_opt.num_skipped_updates) == 0
    assert torch.isnan(opt.grad_norm.full_tensor())
    assert torch.isfinite(want_opt.grad_norm.full_tensor())
    # the other weights: the update of a zero gradient there (up to the order of the norm's sums)
    for i, (g, w, b) in enumerate(zip(got, want, before)):
        if i != index:
            assert not torch.equal(g, b)
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_non_finite_shard_skips_its_parameter_on_every_rank_under_fsdp2():
    """fused=False under FSDP2: each whole gradient's norm is reduced over the ranks, so a rank whose
    shard is finite skips that parameter too, and the other parameters are clipped by the norm of
    the finite gradients."""
    pytest.importorskip("torch.distributed.fsdp")
    from test_fsdp import spawn

    spawn(_sharded_non_finite, world_size=2)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_max_grad_norm_set_after_construction_clips_as_if_given_to_it(fused):
    """A framework adapter hands its clipping threshold over after the optimizer was built: the optimizer
    then clips exactly as one built with it (under release: with a history of its own), and None stops it."""

    def run(given, set_later):
        model = make_model(seed=0)
        kwargs = {} if given is None else {"max_grad_norm": given}
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=fused, **kwargs)
        if set_later is not False:
            opt.max_grad_norm = set_later
        for x in inputs(3):
            loss_fn(model, x).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    built, built_opt = run(0.05, False)
    later, later_opt = run(None, 0.05)
    assert later_opt.max_grad_norm == 0.05 and torch.equal(later_opt.grad_norm, built_opt.grad_norm)
    for p, q in zip(built.parameters(), later.parameters()):
        assert torch.equal(p, q)
    unclipped, _ = run(None, False)
    stopped, stopped_opt = run(0.05, None)
    assert stopped_opt.grad_norm is None
    for p, q in zip(unclipped.parameters(), stopped.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(unclipped.parameters(), built.parameters()))  # it clipped
    with pytest.raises(ValueError, match="Invalid max_grad_norm"):
        built_opt.max_grad_norm = -1.0
    assert built_opt.max_grad_norm == 0.05
