"""Low-bit paired state formats (``state_format="norm2-log4" / "norm4-log4" / "rot4-log4"``): the
log-grid second moment (``fusedopt/codecs/loggrid.py``), the first moment in units of sqrt(v)
(``fusedopt/codecs/normalised.py``), the frame plumbing, training, checkpoints and the planner's bytes.
"""

import copy
import math

import pytest
import torch
from helpers import inputs, make_model, moment_draws, second_moment, train

import fusedopt
from fusedopt.codecs import (
    FP32,
    PAIRED_FORMATS,
    codec_for,
    codec_named,
    decode_moments,
    encode_moments,
    known_formats,
    registered_formats,
)
from fusedopt.codecs.loggrid import BLOCK as LOG_BLOCK
from fusedopt.codecs.loggrid import MAX_STEP, LogGridCodec
from fusedopt.codecs.normalised import BLOCK as NORM_BLOCK
from fusedopt.codecs.normalised import NormalisedCodec

PAIRED = list(PAIRED_FORMATS)
# 4087 elements: 32 log blocks (the last of 119), 64 normalised blocks (the last of 55); 15: one padded block
SHAPES = [torch.Size([67, 61]), torch.Size([3, 5]), torch.Size([4, 128])]
BYTES = {"norm2-log4": 0.8203125, "norm4-log4": 1.0703125, "rot4-log4": 1.0546875, "norm2-root4": 0.8125}


draw = moment_draws  # the optimizer's bits callback of the first moment's field


def log4(shape=SHAPES[0]) -> LogGridCodec:
    c = codec_named("log4", False, torch.Size(shape))
    assert isinstance(c, LogGridCodec)
    return c


def norm(name: str, shape=SHAPES[0]) -> NormalisedCodec:
    c = codec_named(name, True, torch.Size(shape))
    assert isinstance(c, NormalisedCodec) and c.frame
    return c


# --- registry, layout, bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layouts_and_zeros(shape):
    blocks = -(-shape.numel() // LOG_BLOCK)
    assert log4(shape).layout(shape) == {
        ".codes": (torch.uint8, torch.Size([blocks * LOG_BLOCK // 2])),
        ".scales": (torch.float32, torch.Size([blocks])),
        ".steps": (torch.uint8, torch.Size([blocks])),
    }
    for name, bits in (("norm2", 2), ("norm4", 4)):
        n_blocks = -(-shape.numel() // NORM_BLOCK)
        assert norm(name, shape).layout(shape) == {
            ".codes": (torch.uint8, torch.Size([n_blocks * NORM_BLOCK * bits // 8])),
            ".scales": (torch.bfloat16, torch.Size([n_blocks])),
        }
    c = log4(shape)
    zeros = c.zeros(shape, torch.device("cpu"))
    assert torch.equal(c.decode(zeros), torch.zeros(shape))
    frame = torch.rand(shape)
    for name in ("norm2", "norm4"):
        zeros = norm(name, shape).zeros(shape, torch.device("cpu"))
        assert torch.equal(norm(name, shape).decode(zeros, frame=frame), torch.zeros(shape))


@pytest.mark.parametrize("name", PAIRED)
def test_paired_formats_bytes_and_codecs(name):
    big = torch.Size([4096, 4096])
    m, v = codec_for(8, big, 0, state_format=name), codec_for(8, big, 0, signed=False, state_format=name)
    assert (m.name, v.name) == PAIRED_FORMATS[name]
    assert m.bytes_per_element(big) + v.bytes_per_element(big) == BYTES[name]
    assert BYTES[name] <= (0.85 if name.startswith("norm2") else 1.1)
    assert codec_for(8, torch.Size([4096]), 0, state_format=name) is FP32  # 1-D and small tensors: fp32
    # the one-moment codecs are checkpoint names, not state_format values
    for part in ("log4", "root4", "norm2", "norm4"):
        assert part in known_formats() and part not in registered_formats()
    assert name in registered_formats()


@pytest.mark.parametrize("name", PAIRED)
def test_the_planner_counts_the_paired_bytes(name):
    from fusedopt.profile import planner

    kwargs = {"state_format": name, "master_weight_bits": None}
    per = planner.byte_model("fusedopt.AdamW", kwargs, torch.bfloat16)
    assert per.state == BYTES[name]
    shapes = [(4096, 4096), (1000, 300)]
    layout = planner.layout_model("fusedopt.AdamW", kwargs, torch.bfloat16, shapes)
    expected = sum(
        d.itemsize * s.numel()
        for shape in shapes
        for signed in (True, False)
        for d, s in codec_for(8, torch.Size(shape), 0, signed=signed, state_format=name).layout(shape).values()
    )
    assert layout.state * sum(math.prod(s) for s in shapes) == pytest.approx(expected, rel=1e-12)


def test_one_moment_codecs_refuse_the_other_kind_of_moment():
    with pytest.raises(ValueError, match="nonnegative moments only"):
        codec_named("log4", True, torch.Size([8, 8]))
    with pytest.raises(ValueError, match="signed moments only"):
        codec_named("norm2", False, torch.Size([8, 8]))
    with pytest.raises(ValueError, match="needs its frame"):
        norm("norm2").decode(norm("norm2").zeros(SHAPES[0], "cpu"))


def test_a_framed_format_needs_an_algorithm_with_a_second_moment():
    w = torch.nn.Parameter(torch.randn(64, 64))
    for cls in (fusedopt.Lion, fusedopt.SGD):
        kwargs = {"momentum": 0.9} if cls is fusedopt.SGD else {}
        with pytest.raises(ValueError, match="in units of a second moment"):
            cls([w], lr=1e-3, state_format="norm2-log4", **kwargs)
    fusedopt.Lion([w], lr=1e-3, state_format="rot4-log4")  # rot4 momentum: no frame needed


# --- log4: the levels, round trips, zeros, small values ------------------------------------------


def test_log4_levels_are_the_log_grid():
    c = log4(torch.Size([4, 128]))
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, LOG_BLOCK), generator=gen, dtype=torch.int32)
    tops = torch.tensor([1.0, 3e-9, 7e20, 0.5])
    steps = torch.tensor([3, 40, 255, 17], dtype=torch.uint8)
    stored = {".codes": c.pack(codes), ".scales": tops, ".steps": steps}
    assert torch.equal(c.unpack(stored[".codes"]), codes)
    exact = tops.double().unsqueeze(1) * 2.0 ** (-(15 - codes.double()) * steps.double().unsqueeze(1) / 32)
    exact = torch.where(codes > 0, exact, 0.0)
    torch.testing.assert_close(c.decode(stored).double().view(4, LOG_BLOCK), exact, rtol=2**-22, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_log4_round_trip_stays_between_neighbouring_levels(shape):
    """Every nonzero value decodes to one of the two levels around it (the relative error is below one
    level ratio); zeros stay exactly zero; nonzero values never become zero; the tiny value survives."""
    c = log4(shape)
    for seed in range(3):
        x = second_moment(shape, seed)
        stored = c.encode(x, draw(seed, 1, shape))
        y = c.decode(stored)
        assert torch.equal(y == 0, x == 0)
        assert stored[".steps"].max() <= MAX_STEP
        per_block = lambda t: t.repeat_interleave(LOG_BLOCK)[: shape.numel()].view(shape)  # noqa: E731
        ratio = 2.0 ** (stored[".steps"].double() / 32)
        per_elem = per_block(ratio)
        bottom = per_block(stored[".scales"].double() * ratio**-14)
        on_grid = x.double() >= bottom * (1 - 1e-6)
        rel = (y.double()[on_grid] / x.double()[on_grid]).log().abs()
        assert torch.all(rel <= per_elem[on_grid].log() * (1 + 1e-5)), (rel - per_elem[on_grid].log()).max()
        # below the grid (more than 7.9 binades under the block's top): the bottom level, never 0
        below = (x > 0) & ~on_grid
        assert below.any()  # the tiny value
        torch.testing.assert_close(y.double()[below], bottom[below], rtol=1e-6, atol=0)
        tops = stored[".scales"]
        largest = torch.nn.functional.pad(x.view(-1), (0, c.blocks * LOG_BLOCK - x.numel())).view(c.blocks, -1)
        assert torch.equal(tops, largest.amax(dim=1) * 2)  # one binade of headroom


def test_log4_small_magnitudes_survive_and_nothing_is_nan():
    c = log4(torch.Size([2, 128]))
    x = torch.ones(2, 128)
    x[0, 5] = 0.02  # 6.6 binades below the top (2): on the grid
    x[1, 5] = 1e-44  # far below it: takes the bottom level, never 0
    stored = c.encode(x, draw(0, 1, x.shape))
    y = c.decode(stored)
    # ceil(log2(2 / 0.02) * 32 / 14) = 16; the second block is wider than the widest grid
    assert torch.equal(stored[".steps"], torch.tensor([16, MAX_STEP], dtype=torch.uint8))
    assert 0.02 / 1.4 < y[0, 5] < 0.02 * 1.4 and y[1, 5] == 2.0 * 2.0 ** (-14 * MAX_STEP / 32)
    bad = x.clone()
    bad[0, :4] = torch.tensor([float("inf"), float("nan"), -1.0, -float("inf")])
    for out in (c.encode(bad, draw(0, 2, x.shape)), c.encode_decayed(bad, draw(0, 2, x.shape), stored, 0.999)):
        y = c.decode(out)
        assert torch.isfinite(y).all() and torch.all(y >= 0)
        assert y[0, 1] == 0 and y[0, 2] == 0 and y[0, 3] == 0


def test_log4_rounding_is_unbiased_in_value():
    """The mean over 400 draws of each value decoded is the value (the EMA of v stays unbiased)."""
    shape = torch.Size([2, 128])
    c = log4(shape)
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(shape, generator=gen) * 10 + 0.1
    mean = torch.stack([c.decode(c.encode(x, draw(5, k, shape))) for k in range(400)]).double().mean(0)
    rel = (mean / x.double() - 1).abs()
    assert rel.mean() < 0.01 and rel.max() < 0.08, (rel.mean(), rel.max())


# --- log4: the exact decay on the top ------------------------------------------------------------


def test_log4_without_increments_the_codes_stay_and_the_top_decays_exactly():
    c = log4()
    stored = c.encode(second_moment(c.shape, 0), draw(0, 1, c.shape))
    first = c.decode(stored)
    for step in range(2, 202):
        new = c.encode_decayed(c.decode(stored) * 0.999, draw(0, step, c.shape), stored, 0.999)
        assert torch.equal(new[".codes"], stored[".codes"]) and torch.equal(new[".steps"], stored[".steps"])
        assert torch.equal(new[".scales"], stored[".scales"] * 0.999)
        stored = new
    torch.testing.assert_close(c.decode(stored).double(), first.double() * 0.999**200, rtol=1e-4, atol=0)


def test_log4_tiny_increments_round_up_with_their_probability():
    """An increment of 1e-4 of the gap per step, 2000 steps: 0.2 levels per element on average (the
    24-bit draw; the moment's 12-bit field alone would round up with probability 2**-12, 0.49 levels)."""
    shape = torch.Size([16, 128])
    c = log4(shape)
    tops, steps = torch.ones(c.blocks), torch.full((c.blocks,), 32, dtype=torch.uint8)  # levels a binade apart
    codes = torch.full((c.blocks, LOG_BLOCK), 10, dtype=torch.int32)
    stored = {".codes": c.pack(codes), ".scales": tops, ".steps": steps}
    gap = 2.0 ** -(15 - 11) - 2.0 ** -(15 - 10)  # level c is 2**-(15 - c)
    for step in range(1, 2001):
        x = c.decode(stored) + 1e-4 * gap
        stored = c.encode_decayed(x, draw(7, step, shape), stored, 1.0)
    assert torch.equal(stored[".scales"], tops) and torch.equal(stored[".steps"], steps)
    mean = (c.unpack(stored[".codes"]).double() - 10).mean().item()
    assert 0.12 < mean < 0.28, mean  # the value grows by 0.2 gaps; each level up is a wider gap


def test_log4_a_value_leaving_the_grid_re_rounds_its_block_only():
    shape = torch.Size([3, 128])
    c = log4(shape)
    x = torch.ones(shape)
    x[2] = 0.0  # a block that never had a gradient
    stored = c.encode(x, draw(0, 1, shape))
    y = c.decode(stored) * 0.999
    y[0, 7] = 100.0  # above the top
    y[2, 3] = 1e-3  # a first nonzero value in a zero block
    new = c.encode_decayed(y, draw(0, 2, shape), stored, 0.999)
    assert new[".scales"][0] == 200.0 and new[".scales"][2] == 2e-3
    assert new[".scales"][1] == stored[".scales"][1] * 0.999
    assert torch.equal(c.unpack(new[".codes"])[1], c.unpack(stored[".codes"])[1])
    out = c.decode(new)
    assert out[2, 3] > 0 and torch.count_nonzero(out[2]) == 1 and 50 <= out[0, 7] <= 200


def test_log4_a_value_below_the_widest_grid_does_not_re_round_its_block():
    """At the widest spacing a refit would not reach lower: a small new value takes level 1 and the
    rest of the block keeps its codes (re-rounding the block every step would be noise in every element)."""
    shape = torch.Size([1, 128])
    c = log4(shape)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) + 0.5
    x[0, 0] = 1e-20
    stored = c.encode(x, draw(0, 1, shape))
    assert stored[".steps"].item() == MAX_STEP
    y = c.decode(stored) * 0.999
    y[0, 0] = 2e-20  # an increment, still below the grid
    new = c.encode_decayed(y, draw(0, 2, shape), stored, 0.999)
    assert torch.equal(new[".scales"], stored[".scales"] * 0.999)
    assert torch.equal(new[".codes"], stored[".codes"])


def test_adam_second_moment_is_tracked_and_decays_when_the_gradient_stops():
    """1200 updates of v from a gradient stream (rows scaled over decades), decode -> EMA -> encode_decayed
    as the optimizer does: mean sqrt(v) within a few percent of fp32's, on the rows whose gradient stopped
    halfway too (they decay, not freeze)."""
    shape = torch.Size([16, 256])
    gen = torch.Generator().manual_seed(3)
    row_scale = torch.exp(1.5 * torch.randn(shape[0], 1, generator=gen))
    c = log4(shape)
    stored, v = c.zeros(shape, "cpu"), torch.zeros(shape)
    for step in range(1, 1201):
        g = torch.randn(shape, generator=gen) * row_scale
        if step > 600:
            g[:4] = 0.0
        v = 0.999 * v + 0.001 * g * g
        stored = c.encode_decayed(0.999 * c.decode(stored) + 0.001 * g * g, draw(2, step, shape), stored, 0.999)
    q = c.decode(stored)
    for rows in (slice(0, 4), slice(4, 16)):  # stopped, running
        ratio = (q[rows].sqrt() / v[rows].sqrt()).mean().item()
        assert abs(ratio - 1) < 0.03, (rows, ratio)


# --- the normalised first moment -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["norm2", "norm4"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_normalised_round_trip_error_is_a_fraction_of_the_update(name, shape):
    """In units of sqrt(frame) each element moves by less than one gap of its block's levels; where
    the frame is 0 the moment is 0; a block of zeros stays exactly zero."""
    c = norm(name, shape)
    gen = torch.Generator().manual_seed(0)
    frame = torch.rand(shape, generator=gen) ** 4 * 1e-6
    frame.view(-1)[:3] = 0.0
    m = torch.randn(shape, generator=gen) * frame.sqrt() * 0.3
    m.view(-1)[3:5] = 5.0  # m where the frame is 0 is not representable: stored as 0
    m.view(-1)[NORM_BLOCK : 2 * NORM_BLOCK] = 0.0
    stored = c.encode(m, draw(1, 1, shape), frame=frame)
    y = c.decode(stored, frame=frame)
    r = frame.sqrt()
    assert torch.all(y.view(-1)[:3] == 0)
    if shape.numel() > 2 * NORM_BLOCK:
        assert torch.all(y.view(-1)[NORM_BLOCK : 2 * NORM_BLOCK] == 0)
    live = r > 0
    q, qy = m[live] / r[live], y[live] / r[live]
    scales = stored[".scales"].float().repeat_interleave(NORM_BLOCK)[: shape.numel()].view(shape)[live]
    gap = 2 * scales / ((1 << c.state_bits) - 1)
    clipped = q.abs() > scales
    err = (qy - q.clamp(-scales, scales)).abs()
    assert torch.all(err <= gap * (1 + 1e-5)), (err / gap).max()
    assert torch.all(qy.abs() <= scales * (1 + 1e-6))
    # norm4: the block's absmax (nothing clipped); norm2: at most 1.2 block rms (a Gaussian's tails)
    torch.testing.assert_close(qy[clipped], q[clipped].sign() * scales[clipped], rtol=1e-5, atol=0)
    assert clipped.float().mean() < (0.35 if name == "norm2" else 1e-9)
    if name == "norm2":
        assert clipped.any()


@pytest.mark.parametrize("name", ["norm2", "norm4"])
def test_normalised_no_nan_from_junk(name):
    shape = SHAPES[0]
    c = norm(name, shape)
    frame = torch.rand(shape)
    m = torch.randn(shape)
    m.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    y = c.decode(c.encode(m, draw(0, 1, shape), frame=frame), frame=frame)
    assert torch.isfinite(y).all()


def test_decode_and_encode_moments_put_the_frame_first():
    shape = SHAPES[0]
    codecs = {"exp_avg": norm("norm2", shape), "exp_avg_sq": log4(shape)}
    frames = {"exp_avg": "exp_avg_sq"}
    gen = torch.Generator().manual_seed(2)
    v = second_moment(shape, 1)
    m = torch.randn(shape, generator=gen) * v.sqrt() * 0.2
    stored = encode_moments(codecs, {"exp_avg": m, "exp_avg_sq": v}, lambda i: draw(3, i + 1, shape), frames)
    v_stored = codecs["exp_avg_sq"].decode(stored["exp_avg_sq"])
    alone = codecs["exp_avg"].encode(m, draw(3, 1, shape), frame=v_stored)  # in units of v as stored
    assert all(torch.equal(alone[s], stored["exp_avg"][s]) for s in alone)
    decoded = decode_moments(codecs, stored, frames)
    assert list(decoded) == ["exp_avg", "exp_avg_sq"]
    assert torch.equal(decoded["exp_avg"], codecs["exp_avg"].decode(stored["exp_avg"], frame=v_stored))
    with pytest.raises(ValueError, match="relative to a second moment"):
        decode_moments(codecs, stored, {})


# --- training through the public API ------------------------------------------------------------


def _fit(fmt, dtype, fused, steps=40, algo=fusedopt.AdamW):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(67, 61, generator=gen).to(dtype))
    b = torch.nn.Parameter(torch.randn(61, generator=gen).to(dtype))
    opt = algo([w, b], lr=5e-2 if algo is fusedopt.AdamW else 1e-2, min_compress_numel=0, fused=fused, **fmt)
    target = torch.randn(67, 61, generator=gen)
    losses = []
    for _ in range(steps):
        loss = ((w.float() + b.float() - target) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w, b, opt, losses


@pytest.mark.parametrize("name", PAIRED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trains_fused_and_unfused_alike(name, dtype):
    w, b, opt, losses = _fit({"state_format": name}, dtype, fused=False)
    w2, b2, _, _ = _fit({"state_format": name}, dtype, fused=True)
    assert torch.equal(w, w2) and torch.equal(b, b2)
    v_codec = codec_named(PAIRED_FORMATS[name][1], False, w.shape)
    assert {f"exp_avg_sq{s}": d for s, (d, _) in v_codec.layout(w.shape).items()} == {
        k: t.dtype for k, t in opt.state[w].items() if k.startswith("exp_avg_sq")
    }  # the format's layout
    _, _, _, exact = _fit({"state_bits": 32}, dtype, fused=False)
    gap = (losses[-1] - exact[-1]) / (exact[0] - exact[-1])
    assert gap < 0.15, gap  # within 15% of fp32 state's progress


def test_rot4_log4_trains_lion():
    _, _, _, losses = _fit({"state_format": "rot4-log4"}, torch.float32, fused=False, algo=fusedopt.Lion)
    _, _, _, exact = _fit({"state_bits": 32}, torch.float32, fused=False, algo=fusedopt.Lion)
    assert (losses[-1] - exact[-1]) / (exact[0] - exact[-1]) < 0.1


def test_the_optimizer_hands_the_decay_to_log4():
    """A step with a zero gradient: v's tops are multiplied by beta2 exactly and its codes stay."""
    w, _, opt, _ = _fit({"state_format": "norm2-log4"}, torch.float32, fused=False, steps=5)
    before = {k: v.clone() for k, v in opt.state[w].items()}
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(opt.state[w]["exp_avg_sq.scales"], before["exp_avg_sq.scales"] * 0.999)
    assert torch.equal(opt.state[w]["exp_avg_sq.codes"], before["exp_avg_sq.codes"])


def test_a_row_without_gradient_is_not_moved():
    emb = torch.nn.Parameter(torch.randn(64, 64))
    before = emb.detach().clone()
    opt = fusedopt.AdamW([emb], lr=1e-2, weight_decay=0.0, state_format="norm2-log4", min_compress_numel=0)
    for _ in range(5):
        (emb[32:] ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(emb[:32], before[:32]) and not torch.equal(emb[32:], before[32:])


# --- checkpoints ---------------------------------------------------------------------------------


def _moments(opt, p):
    group, _ = opt.position(p)
    codecs = opt.codecs(p, group)
    stored = {slot: {s: opt.state[p][slot + s] for s in c.suffixes} for slot, c in codecs.items()}
    return decode_moments(codecs, stored, opt.frames)


@pytest.mark.parametrize("name", PAIRED)
def test_checkpoints_name_the_codecs_resume_bit_for_bit(name):
    model = make_model()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_format=name, min_compress_numel=0)
    train(model, opt, inputs(3))
    saved = copy.deepcopy(opt.state_dict())
    m_name, v_name = PAIRED_FORMATS[name]
    assert saved["fusedopt"]["codecs"][0] == {"exp_avg": m_name, "exp_avg_sq": v_name}
    twin = copy.deepcopy(model)
    opt2 = fusedopt.AdamW(twin.parameters(), lr=1e-2, min_compress_numel=0)  # the saved group's format wins
    opt2.load_state_dict(saved)
    xs = inputs(3, seed=5)
    train(model, opt, xs)
    train(twin, opt2, xs)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])


@pytest.mark.parametrize(
    "source,target",
    [
        ("norm2-log4", None),
        (None, "norm2-log4"),
        ("norm2-log4", "rot4-log4"),
        ("norm4-log4", "norm2-log4"),
        ("norm2-root4", None),
        (None, "norm2-root4"),
        ("norm2-root4", "norm2-log4"),
        ("norm2-log4", "norm2-root4"),
        ("rot4-log4", "norm2-root4"),
    ],
    ids=str,
)
def test_checkpoints_convert_to_and_from_other_formats(source, target):
    """Through load_state_dict, a framed first moment is decoded with its saved frame and encoded in
    units of the converted one: the moments survive within the formats' resolution."""
    model = make_model()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_format=source, min_compress_numel=0)
    train(model, opt, inputs(4))
    w = model[0].weight
    i = next(i for i, p in enumerate(model.parameters()) if p is w)
    before = _moments(opt, w)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["state_format"] = target
    other = fusedopt.AdamW(copy.deepcopy(model).parameters(), min_compress_numel=0)
    with pytest.warns(UserWarning, match="converted"):
        other.load_state_dict(saved)
    after = _moments(other, other.param_groups[0]["params"][i])
    v, v2 = before["exp_avg_sq"], after["exp_avg_sq"]
    assert torch.equal(v == 0, v2 == 0)
    assert (v2.sqrt() - v.sqrt()).abs().max() <= 0.5 * v.sqrt().max()
    r = v2.sqrt().clamp_min(1e-30)
    err = ((after["exp_avg"] - before["exp_avg"]) / r)[v2 > 0]
    assert err.abs().max() <= 1.5 * (before["exp_avg"] / r)[v2 > 0].abs().max()
    # and it trains on
    train(model, other, inputs(2, seed=9))


def test_a_torch_adamw_checkpoint_loads_into_norm2_log4():
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, ref, inputs(3))
    opt = fusedopt.AdamW(copy.deepcopy(model).parameters(), lr=1e-2, state_format="norm2-log4", min_compress_numel=0)
    with pytest.warns(UserWarning, match="-> norm2"):
        opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    i = next(i for i, p in enumerate(model.parameters()) if p is model[0].weight)
    w = opt.param_groups[0]["params"][i]
    back = opt.torch_state_dict()["state"][i]
    exact = ref.state[model[0].weight]
    v, v_exact = back["exp_avg_sq"], exact["exp_avg_sq"]  # 91 elements: one block of the log grid
    on_grid = v_exact >= 2 * v_exact.max() * 2.0 ** (-14 * MAX_STEP / 32)
    torch.testing.assert_close(v[on_grid].sqrt(), v_exact[on_grid].sqrt(), rtol=0.5, atol=0)
    assert torch.all(v[~on_grid] >= v_exact[~on_grid])  # below the grid: its bottom level (a smaller step)
    assert opt.state[w]["exp_avg.scales"].dtype == torch.bfloat16
