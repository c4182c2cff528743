"""Rotated n-bit moments (``state_format="rot8" / "rot4" / "rot2"``, ``fusedopt/codecs/rotated.py``):
the rotation, packing, round-trip bounds, zeros, no NaN/Inf, the exact decay on the block scale,
EMA tracking, training through the public API, checkpoints and the planner's bytes.

The format: blocks of 256 elements rotated by a normalised regular Hadamard matrix ``H``, one fp32
scale per block, symmetric two's complement codes; nonnegative moments stored as ``sqrt``.
"""

import copy
import math

import pytest
import torch
from cases import ALGORITHM, PRIMARY_ALGORITHMS, cross, dtype_cases, named_format_cases
from helpers import inputs, loss_fn, make_model, moment_draws, train

import fusedopt
from fusedopt.codecs import FP32, codec_for, codec_named
from fusedopt.codecs.rotated import BLOCK, FORMATS, HEADROOM, RotatedCodec, hadamard, hadamard_matrix

WIDTHS = [pytest.param(name, bits, id=name) for name, bits in FORMATS.items()]
CODECS = [
    pytest.param(name, signed, id=f"{name}-{'signed' if signed else 'unsigned'}")
    for name in FORMATS
    for signed in (True, False)
]
# 4087 elements: 16 blocks, the last of 247; 15 elements: one padded block
SHAPES = [torch.Size([67, 61]), torch.Size([3, 5]), torch.Size([4, 256])]


def codec(name: str, signed: bool, shape=SHAPES[0]) -> RotatedCodec:
    c = codec_for(8, torch.Size(shape), 0, signed=signed, state_format=name)
    assert isinstance(c, RotatedCodec) and c.name == name
    return c


draw = moment_draws  # the optimizer's bits callback of the first moment's field


def sample(shape, seed: int, signed: bool, outliers: bool = True) -> torch.Tensor:
    """Gaussian values with a few outliers 200 times larger; squared for a nonnegative moment."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if outliers:
        flat = x.view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 500)]] *= 200
    return x if signed else x * x


def block_rows(t: torch.Tensor, n_blocks: int) -> torch.Tensor:
    flat = t.reshape(-1).double()
    return torch.nn.functional.pad(flat, (0, n_blocks * BLOCK - flat.numel())).view(n_blocks, BLOCK)


# --- the rotation and the layout -----------------------------------------------------------------


def test_the_rotation_is_a_symmetric_orthogonal_regular_hadamard_matrix():
    h = hadamard_matrix().double()
    assert torch.equal(h.abs(), torch.full((BLOCK, BLOCK), 1 / 16, dtype=torch.float64))
    assert torch.equal(h, h.T)
    assert torch.equal(h @ h, torch.eye(BLOCK, dtype=torch.float64))
    assert torch.equal(h.sum(dim=1), torch.ones(BLOCK, dtype=torch.float64))  # regular: a constant maps to itself
    x = torch.randn(5, BLOCK)
    torch.testing.assert_close(hadamard(x).double(), x.double() @ h, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,bits", WIDTHS)
def test_decode_of_integer_codes_is_exact(name, bits):
    c = codec(name, True)
    qmax = (1 << (bits - 1)) - 1
    codes = torch.randint(-qmax, qmax + 1, (c.blocks, BLOCK), dtype=torch.int32)
    stored = {".codes": c.pack(codes.reshape(-1)), ".scales": torch.rand(c.blocks) + 0.5}
    assert torch.equal(c.unpack(stored[".codes"]), codes)
    expected = (codes.double() @ hadamard_matrix().double()).float() * stored[".scales"].unsqueeze(1)
    assert torch.equal(c.decode(stored), expected.reshape(-1)[: c.numel].reshape(c.shape))


@pytest.mark.parametrize("name,bits", WIDTHS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layout_bytes_and_zeros(name, bits, shape):
    for signed in (True, False):
        c = codec(name, signed, shape)
        blocks = -(-shape.numel() // BLOCK)
        layout = c.layout(shape)
        assert layout == {
            ".codes": (torch.uint8, torch.Size([blocks * BLOCK * bits // 8])),
            ".scales": (torch.float32, torch.Size([blocks])),
        }
        zeros = c.zeros(shape, torch.device("cpu"))
        assert all(torch.count_nonzero(t) == 0 for t in zeros.values())
        assert torch.equal(c.decode(zeros), torch.zeros(shape))
    big = torch.Size([4096, 4096])
    assert codec(name, True, big).bytes_per_element(big) == bits / 8 + 4 / 256  # 1.016, 0.516, 0.266


def test_small_and_1d_tensors_keep_fp32_moments():
    assert codec_for(8, torch.Size([4096]), 0, state_format="rot4") is FP32
    assert codec_for(8, torch.Size([63, 65]), 4096, state_format="rot4") is FP32


# --- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,signed", CODECS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_error_is_bounded_by_the_block_scale(name, signed, shape):
    """Stochastic rounding moves each rotated coordinate by less than one scale, and H is orthogonal: a
    block's error has an L2 norm below 16 scales (in the sqrt domain for v, plus the floor at one scale)."""
    c = codec(name, signed, shape)
    for seed in range(3):
        x = sample(shape, seed, signed)
        stored = c.encode(x, draw(seed, 1, shape))
        scales = stored[".scales"].double()
        domain = (lambda t: t) if signed else torch.sqrt
        err = block_rows(domain(c.decode(stored)) - domain(x), c.blocks).norm(dim=1)
        bound = 16 * scales if signed else 32 * scales
        assert torch.all(err < bound), (err / scales).max()
        if not signed:  # v decodes at least at one code step squared (the floor), so never to 0 in a live block
            floor = stored[".scales"].repeat_interleave(BLOCK)[: shape.numel()].reshape(shape)
            assert torch.all(c.decode(stored) >= floor * floor) and torch.all(c.decode(stored)[x > 0] > 0)
        # the fresh scale leaves the 1.25x headroom: the block's largest rotated value at qmax / 1.25
        rotated = hadamard(block_rows(domain(x), c.blocks).float())
        expected = rotated.abs().amax(dim=1) / max(c.qmax / HEADROOM, 1.0)
        torch.testing.assert_close(stored[".scales"], expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["rot8", "rot4"])
def test_one_scale_covers_an_outlier_without_losing_the_rest_of_the_block(name):
    """An outlier 1000 times the rest: the other 255 elements keep an error far below the half step an
    unrotated absmax grid would have (where they would round to 0 or one step)."""
    c = codec(name, True, torch.Size([4, 256]))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=gen)
    x[:, 17] = 1000.0
    stored = c.encode(x, draw(1, 1, x.shape))
    y = c.decode(stored)
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[:, 17] = False
    rms = (y - x)[rest].pow(2).mean().sqrt().item()
    half_step = 1000.0 / c.qmax / 2
    assert rms < 0.25 * half_step, (rms, half_step)
    # stochastic rounding: at most 1/4 scale**2 of variance per coordinate, and the outlier's 1000 / 16
    # per coordinate sets the scale
    assert rms < 0.5 * stored[".scales"].max().item()
    assert stored[".scales"].max().item() < (1000 / 16 + 4) / (c.qmax / HEADROOM)


@pytest.mark.parametrize("name,signed", CODECS)
def test_zero_blocks_stay_exactly_zero_and_nothing_is_nan(name, signed):
    c = codec(name, signed)
    x = sample(c.shape, 0, signed)
    x.view(-1)[BLOCK : 3 * BLOCK] = 0.0  # blocks 1 and 2
    stored = c.encode(x, draw(0, 1, c.shape))
    assert torch.all(stored[".scales"][1:3] == 0)
    y = c.decode(stored)
    assert torch.all(y.view(-1)[BLOCK : 3 * BLOCK] == 0)
    if not signed:
        assert torch.all(y >= 0)
    # the same through the decayed encode: a zero block with no increment stays zero
    again = c.encode_decayed(y, draw(0, 2, c.shape), stored, 0.9)
    assert torch.all(again[".scales"][1:3] == 0) and torch.all(c.decode(again).view(-1)[BLOCK : 3 * BLOCK] == 0)
    bad = x.clone()
    bad.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    for out in (c.encode(bad, draw(0, 3, c.shape)), c.encode_decayed(bad, draw(0, 3, c.shape), stored, 0.9)):
        assert torch.isfinite(out[".scales"]).all() and torch.isfinite(c.decode(out)).all()


# --- the exact decay on the scale ---------------------------------------------------------------


@pytest.mark.parametrize("name,signed", CODECS)
def test_without_increments_the_codes_stay_and_the_scale_decays_exactly(name, signed):
    """x = decay * decode(previous): the codes do not change, the scale is multiplied by the decay (its
    square root for v), and the moment decays as the EMA does, over many steps."""
    c = codec(name, signed)
    decay = 0.9 if signed else 0.999
    stored = c.encode(sample(c.shape, 0, signed), draw(0, 1, c.shape))
    first = c.decode(stored)
    d = decay if signed else math.sqrt(decay)
    moved = 0
    for step in range(2, 202):
        x = c.decode(stored) * decay
        new = c.encode_decayed(x, draw(0, step, c.shape), stored, decay)
        change = c.unpack(new[".codes"]) - c.unpack(stored[".codes"])
        # m: decay * x - decay * x is exactly 0. v: sqrt(decay * s**2) - sqrt(decay) * s is a rounding
        # error of fp32 (an ulp), rounded up or down with that tiny probability
        assert change.abs().max() <= (0 if signed else 1), step
        moved += torch.count_nonzero(change).item()
        assert torch.equal(new[".scales"], stored[".scales"] * d)
        stored = new
    assert moved <= 200 * change.numel() * 1e-5, moved
    torch.testing.assert_close(c.decode(stored).double(), first.double() * decay**200, rtol=1e-4, atol=0)


def test_tiny_increments_round_up_with_their_probability():
    """An increment of 1e-4 of a code per step for 2000 steps adds 0.2 codes per coordinate on average:
    the draw is 24 bits, not the moment's 12-bit field (on a 2**-12 grid it would never round up)."""
    c = codec("rot8", True, torch.Size([64, 256]))
    stored = {".codes": c.pack(torch.zeros(c.blocks * BLOCK, dtype=torch.int32)), ".scales": torch.ones(c.blocks)}
    for step in range(1, 2001):
        stored = c.encode_decayed(c.decode(stored) + 1e-4, draw(7, step, c.shape), stored, 1.0)
    mean = c.unpack(stored[".codes"]).double().mean().item()
    assert stored[".scales"].eq(1).all()
    assert abs(mean - 0.2) < 0.02, mean  # 16384 coordinates: the standard error is 0.0035


@pytest.mark.parametrize("name", ["rot8", "rot4"])
def test_adam_moments_are_tracked_and_decay_when_the_gradient_stops(name):
    """2000 AdamW moment updates from a gradient stream (scales lognormal across rows), decode -> EMA ->
    encode_decayed as the optimizer does: mean sqrt(v) within a few percent of fp32's, also on the rows
    whose gradient stopped halfway (they decay, not freeze), and m close to fp32's."""
    shape = torch.Size([16, 512])
    gen = torch.Generator().manual_seed(3)
    row_scale = torch.exp(1.5 * torch.randn(shape[0], 1, generator=gen))
    cm, cv = codec(name, True, shape), codec(name, False, shape)
    sm, sv = cm.zeros(shape, "cpu"), cv.zeros(shape, "cpu")
    m, v = torch.zeros(shape), torch.zeros(shape)
    b1, b2 = 0.9, 0.999
    for step in range(1, 2001):
        g = torch.randn(shape, generator=gen) * row_scale
        if step > 1000:
            g[:4] = 0.0
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        qm, qv = cm.decode(sm), cv.decode(sv)
        sm = cm.encode_decayed(b1 * qm + (1 - b1) * g, draw(1, step, shape), sm, b1)
        sv = cv.encode_decayed(b2 * qv + (1 - b2) * g * g, draw(2, step, shape), sv, b2)
    qm, qv = cm.decode(sm), cv.decode(sv)
    for rows in (slice(0, 4), slice(4, 16)):  # stopped, running
        ratio = (qv[rows].sqrt() / v[rows].sqrt()).mean().item()
        assert abs(ratio - 1) < {"rot8": 0.02, "rot4": 0.10}[name], (rows, ratio)
    running = slice(4, 16)
    err = ((qm[running] - m[running]).norm() / m[running].norm()).item()
    assert err < {"rot8": 0.05, "rot4": 0.5}[name], err


# --- training through the public API ------------------------------------------------------------


def _fit(algo, fmt, dtype, fused, steps=40):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 80, generator=gen).to(dtype))
    b = torch.nn.Parameter(torch.randn(80, generator=gen).to(dtype))
    lr = {"adamw": 5e-2, "sgd-momentum": 1.0, "lion": 1e-2}[algo.id]
    opt = algo.make([w, b], lr=lr, min_compress_numel=0, fused=fused, **fmt)
    target = torch.randn(48, 80, generator=gen)
    losses = []
    for _ in range(steps):
        loss = ((w.float() + b.float() - target) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w, b, opt, losses


@pytest.mark.parametrize(
    "algo,fmt,dtype",
    cross(PRIMARY_ALGORITHMS, named_format_cases("rot8", "rot4"), dtype_cases(torch.float32, torch.bfloat16)),
)
def test_trains_through_the_public_api_fused_and_unfused_alike(algo, fmt, dtype):
    w, b, opt, losses = _fit(algo, fmt.kwargs, dtype, fused=False)
    w2, b2, _, _ = _fit(algo, fmt.kwargs, dtype, fused=True)
    assert torch.equal(w, w2) and torch.equal(b, b2)
    state = opt.state[w]
    assert all(state[slot + ".scales"].dtype == torch.float32 for slot in algo.slots)  # the format's layout
    _, _, _, exact = _fit(algo, {"state_bits": 32}, dtype, fused=False)
    # as far as fp32 state gets, within 15% of its progress (rot4), 3% (rot8)
    gap = (losses[-1] - exact[-1]) / (exact[0] - exact[-1])
    assert gap < {"rot8": 0.03, "rot4": 0.15}[fmt.name], gap
    assert not torch.equal(w, _fit(algo, {"state_bits": 32}, dtype, fused=False)[0])  # not the fp32 path


def test_rot2_trains():
    _, _, _, losses = _fit(ALGORITHM["adamw"], {"state_format": "rot2"}, torch.float32, fused=False)
    assert losses[-1] < 0.4 * losses[0]


def test_a_block_without_gradient_is_not_moved(monkeypatch):
    """AdamW without weight decay: rows that never get a gradient (whole blocks of 256) keep their
    values exactly, and their blocks' scales stay 0."""
    emb = torch.nn.Parameter(torch.randn(64, 64))
    before = emb.detach().clone()
    opt = fusedopt.AdamW([emb], lr=1e-2, weight_decay=0.0, state_format="rot4", min_compress_numel=0)
    for _ in range(5):
        (emb[32:] ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(emb[:32], before[:32]) and not torch.equal(emb[32:], before[32:])
    for slot in ("exp_avg", "exp_avg_sq"):
        scales = opt.state[emb][slot + ".scales"]
        assert torch.all(scales[:8] == 0) and torch.all(scales[8:] > 0)


class _NoDecays(fusedopt.AdamW):
    """AdamW that does not tell the formats its EMA decays."""

    @staticmethod
    def ema_decays(hyper):
        return {}


def test_the_kernel_needs_the_decays_auto_runs_the_reference_without_them(monkeypatch):
    """The kernel keeps the decay exact on the block scales, so it needs the algorithm's decays:
    without them FUSEDOPT_BACKEND=triton names the problem and auto runs the reference (whose
    ``encode`` rounds every block afresh)."""
    w = torch.nn.Parameter(torch.randn(48, 80))
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    opt = _NoDecays([w], min_compress_numel=0, state_format="rot8")
    w.grad = torch.randn_like(w)
    with pytest.raises(RuntimeError, match="'rot8' needs the EMA decay of 'exp_avg'.*ema_decays"):
        opt.step()
    monkeypatch.setenv("FUSEDOPT_BACKEND", "auto")
    opt.step()
    assert float(opt.state[w]["step"]) == 1


@pytest.mark.parametrize("algo", PRIMARY_ALGORITHMS, ids=lambda a: a.id)
def test_the_kernel_gets_the_decays_the_reference_gets(algo):
    """The kernel's decays (``kernel_scalars``' ``moment_decays``) are ``ema_decays`` in slot order."""
    extra = {"momentum": 0.8} if algo.cls is fusedopt.SGD else {"betas": (0.7, 0.97)}
    opt = algo.make([torch.nn.Parameter(torch.zeros(4, 4))], **extra)
    hyper = opt.hyper(opt.param_groups[0])
    decays = opt.ema_decays(hyper)
    assert opt.kernel_scalars(hyper)["moment_decays"] == tuple(decays[s] for s in opt.state_slots(opt.param_groups[0]))


# --- checkpoints and memory -------------------------------------------------------------------


def test_checkpoints_name_the_format_resume_bit_for_bit_and_convert():
    model = make_model()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_format="rot4", min_compress_numel=0)
    train(model, opt, inputs(3))
    saved = copy.deepcopy(opt.state_dict())
    assert saved["fusedopt"]["codecs"][0] == {"exp_avg": "rot4", "exp_avg_sq": "rot4"}
    assert saved["param_groups"][0]["state_format"] == "rot4"
    twin = copy.deepcopy(model)
    opt2 = fusedopt.AdamW(twin.parameters(), lr=1e-2, min_compress_numel=0)  # the saved group's format wins
    opt2.load_state_dict(saved)
    xs = inputs(3, seed=5)
    train(model, opt, xs)
    train(twin, opt2, xs)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])
    # to the 8-bit block format and back: the moments survive within each format's resolution
    w = model[0].weight
    i = next(i for i, p in enumerate(model.parameters()) if p is w)
    m = codec_named("rot4", True, w.shape).decode({s: opt.state[w]["exp_avg" + s] for s in (".codes", ".scales")})
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["state_format"] = None
    block = fusedopt.AdamW(copy.deepcopy(model).parameters(), min_compress_numel=0)
    with pytest.warns(UserWarning, match="rot4"):
        block.load_state_dict(saved)
    p = block.param_groups[0]["params"][i]
    assert block.state[p]["exp_avg.codes"].dtype == torch.uint8 and "exp_avg" not in block.state[p]
    m8 = codec_for(8, w.shape, 0).decode({s: block.state[p]["exp_avg" + s] for s in (".codes", ".scales")})
    assert (m8 - m).abs().max() <= 0.07 * m.abs().max()
    back = copy.deepcopy(block.state_dict())
    back["param_groups"][0]["state_format"] = "rot8"
    rot = fusedopt.AdamW(copy.deepcopy(model).parameters(), min_compress_numel=0)
    with pytest.warns(UserWarning, match="block8 -> rot8"):
        rot.load_state_dict(back)
    q = rot.param_groups[0]["params"][i]
    m_rot = codec_named("rot8", True, w.shape).decode({s: rot.state[q]["exp_avg" + s] for s in (".codes", ".scales")})
    assert (m_rot - m8).abs().max() <= 0.07 * m8.abs().max()


@pytest.mark.parametrize("name,bits", WIDTHS)
def test_the_planner_counts_the_layout_bytes(name, bits):
    from fusedopt.profile import planner

    kwargs = {"state_format": name, "master_weight_bits": None}
    per = planner.byte_model("fusedopt.AdamW", kwargs, torch.bfloat16)
    assert per.state == 2 * (bits / 8 + 4 / 256)
    shapes = [(4096, 4096), (1000, 300)]
    layout = planner.layout_model("fusedopt.AdamW", kwargs, torch.bfloat16, shapes)
    expected = sum(
        sum(d.itemsize * s.numel() for d, s in codec_named(name, signed, torch.Size(shape)).layout(shape).values())
        for shape in shapes
        for signed in (True, False)
    )
    assert layout.state * sum(math.prod(s) for s in shapes) == pytest.approx(expected, rel=1e-12)
    assert planner.byte_model("fusedopt.AdamW", {"state_bits": 4}, torch.bfloat16).state != per.state


def test_loss_of_the_helpers_model_is_finite_with_every_width():
    for name in FORMATS:
        model = make_model()
        opt = fusedopt.Lion(model.parameters(), lr=1e-3, state_format=name, min_compress_numel=0)
        train(model, opt, inputs(4))
        assert torch.isfinite(loss_fn(model, inputs(1)[0]))


@pytest.mark.parametrize("algo", PRIMARY_ALGORITHMS, ids=lambda a: a.id)
def test_the_optimizer_hands_the_decay_to_the_format(algo):
    """A step with a zero gradient: every moment's block scales are multiplied by the algorithm's
    decay exactly (its square root for v) and the codes stay (but for fp32's rounding of the EMA)."""
    w, _, opt, _ = _fit(algo, {"state_format": "rot8"}, torch.float32, fused=False, steps=5)
    before = {k: v.clone() for k, v in opt.state[w].items()}
    w.grad = torch.zeros_like(w)
    opt.step()
    decays = {"adamw": {"exp_avg": 0.9, "exp_avg_sq": math.sqrt(0.999)}, "sgd-momentum": {"momentum_buffer": 0.9}}
    for slot, decay in decays.get(algo.id, {"exp_avg": 0.99}).items():
        assert torch.equal(opt.state[w][slot + ".scales"], before[slot + ".scales"] * decay), slot
        changed = torch.count_nonzero(opt.state[w][slot + ".codes"] != before[slot + ".codes"]).item()
        assert changed <= 2, (slot, changed)


def test_the_case_registry_lists_the_rotated_formats_by_name():
    from cases import NAMED_FORMATS

    assert [(f.name, f.bits, f.id, f.kwargs) for f in NAMED_FORMATS] == [
        (name, bits, name, {"state_format": name}) for name, bits in FORMATS.items()
    ]
    assert all(f.has_kernel for f in NAMED_FORMATS)
    assert all(f.quantized for f in NAMED_FORMATS)
