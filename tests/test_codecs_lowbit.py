"""The paired low-bit state format (``state_format="norm2-root4"``): the first moment in units of
sqrt(v) (``fusedopt/codecs/normalised.py``; the root-grid second moment has its own file,
``test_codecs_rootgrid.py``), the frame plumbing, training, checkpoints and the planner's bytes.
"""

import copy
import math

import pytest
import torch
from helpers import inputs, launch_constexprs, make_model, second_moment, train, whole_draws

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
from fusedopt.codecs.normalised import BLOCK as NORM_BLOCK
from fusedopt.codecs.normalised import NormalisedCodec
from fusedopt.codecs.rootgrid import FRESH_UNIT, RootGridCodec

PAIRED = list(PAIRED_FORMATS)
# 4087 elements: 32 root-grid blocks (the last of 119), 64 normalised blocks (the last of 55); 15: one
# padded block
SHAPES = [torch.Size([67, 61]), torch.Size([3, 5]), torch.Size([4, 128])]
BYTES = {"norm2-root4": 0.8125}


draw = whole_draws  # the optimizer's bits callback of a moment that reads whole words (both codecs here do)


def root4(shape=SHAPES[0]) -> RootGridCodec:
    c = codec_named("root4", False, torch.Size(shape))
    assert isinstance(c, RootGridCodec)
    return c


def norm(name: str, shape=SHAPES[0]) -> NormalisedCodec:
    c = codec_named(name, True, torch.Size(shape))
    assert isinstance(c, NormalisedCodec) and c.frame
    return c


# --- registry, layout, bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layouts_and_zeros(shape):
    n_blocks = -(-shape.numel() // NORM_BLOCK)
    assert norm("norm2", shape).layout(shape) == {
        ".codes": (torch.uint8, torch.Size([n_blocks * NORM_BLOCK * 2 // 8])),
        ".scales": (torch.bfloat16, torch.Size([n_blocks])),
    }
    zeros = norm("norm2", shape).zeros(shape, torch.device("cpu"))
    assert torch.equal(norm("norm2", shape).decode(zeros, frame=torch.rand(shape)), torch.zeros(shape))


@pytest.mark.parametrize("name", PAIRED)
def test_paired_formats_bytes_and_codecs(name):
    big = torch.Size([4096, 4096])
    m, v = codec_for(8, big, 0, state_format=name), codec_for(8, big, 0, signed=False, state_format=name)
    assert (m.name, v.name) == PAIRED_FORMATS[name]
    assert m.bytes_per_element(big) + v.bytes_per_element(big) == BYTES[name]
    assert BYTES[name] <= 0.85
    assert codec_for(8, torch.Size([4096]), 0, state_format=name) is FP32  # 1-D and small tensors: fp32
    # the one-moment codecs are checkpoint names, not state_format values
    for part in PAIRED_FORMATS[name]:
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
        codec_named("root4", True, torch.Size([8, 8]))
    with pytest.raises(ValueError, match="signed moments only"):
        codec_named("norm2", False, torch.Size([8, 8]))
    with pytest.raises(ValueError, match="needs its frame"):
        norm("norm2").decode(norm("norm2").zeros(SHAPES[0], "cpu"))


def test_a_framed_format_needs_an_algorithm_with_a_second_moment():
    w = torch.nn.Parameter(torch.randn(64, 64))
    for cls in (fusedopt.Lion, fusedopt.SGD):
        kwargs = {"momentum": 0.9} if cls is fusedopt.SGD else {}
        with pytest.raises(ValueError, match="in units of a second moment"):
            cls([w], lr=1e-3, state_format="norm2-root4", **kwargs)


# --- the normalised first moment -----------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_normalised_round_trip_error_is_a_fraction_of_the_update(shape):
    """In units of sqrt(frame) each element moves by less than one gap of its block's levels; where
    the frame is 0 the moment is 0; a block of zeros stays exactly zero."""
    c = norm("norm2", shape)
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
    # at most 1.2 block rms: a Gaussian's tails are clipped
    torch.testing.assert_close(qy[clipped], q[clipped].sign() * scales[clipped], rtol=1e-5, atol=0)
    assert clipped.float().mean() < 0.35
    assert clipped.any()


def test_normalised_no_nan_from_junk():
    shape = SHAPES[0]
    c = norm("norm2", shape)
    frame = torch.rand(shape)
    m = torch.randn(shape)
    m.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    y = c.decode(c.encode(m, draw(0, 1, shape), frame=frame), frame=frame)
    assert torch.isfinite(y).all()


def test_whole_word_draws_never_overlap_a_field():
    """A first moment that reads the shared word whole beside a second that reads its 12-bit field of that word
    (a plugin's pairing) is refused before anything is drawn; so is a third moment drawing a whole word. The
    whole words are the shared word and a second word that differs from it."""
    shape = SHAPES[0]
    whole, field = norm("norm2", shape), codec_named("block8", False, shape)
    m, v = torch.randn(shape), torch.rand(shape)
    drawn = []

    def draws(i, whole_word):
        drawn.append(i)
        return draw(1, 1, shape, i)

    with pytest.raises(ValueError, match="the second must too"):
        encode_moments({"exp_avg": whole, "exp_avg_sq": field}, {"exp_avg": m, "exp_avg_sq": v}, draws, {})
    with pytest.raises(ValueError, match="only the first two moments"):
        encode_moments({"a": root4(shape), "b": root4(shape), "c": root4(shape)}, {"a": v, "b": v, "c": v}, draws, {})
    assert drawn == []
    p = torch.zeros(shape)
    ups = fusedopt.rng.UpdateDraws(3, 0, torch.tensor(2.0), p, 24)
    assert torch.equal(ups.moment(0, whole=True)(), ups.shared())
    second = ups.moment(1, whole=True)()
    assert second.shape == p.shape and (second != ups.shared()).float().mean() > 0.99
    with pytest.raises(ValueError, match="not moment 2"):
        ups.moment(2, whole=True)


@pytest.mark.parametrize(
    "dtype,master,whole,bits",
    [
        (torch.bfloat16, None, True, 16),  # norm2-root4 without a correction: one hash word fewer
        (torch.bfloat16, 24, True, 8),
        (torch.bfloat16, 24, False, 8),
        (torch.bfloat16, None, False, 0),  # the 12-bit fields leave no 16 free
        (torch.float16, None, True, 0),  # fp16 needs up to 24
        (torch.float32, None, True, 0),
    ],
)
def test_a_bf16_parameter_without_a_correction_shares_the_whole_first_moments_word(dtype, master, whole, bits):
    """Beside a whole-word first moment a bf16 parameter without a correction takes the shared word's low 16 bits
    and the moment its top 16; the fields do not overlap and no word of the parameter's own is drawn. The kernel's
    switch follows the same rule."""
    p = torch.zeros(SHAPES[0], dtype=dtype)
    ups = fusedopt.rng.UpdateDraws(3, 0, torch.tensor(2.0), p, master, first_moment_whole=whole)
    assert fusedopt.rng.param_draw_bits(dtype, master, whole) == bits
    shared = ups.shared()
    moment, param = ups.moment(0, whole=True)(), ups.param()()
    if bits:
        assert torch.equal(param, (shared << (32 - bits)) & fusedopt.rng.MASK32)
    else:
        assert (param != shared).float().mean() > 0.99  # a word of its own (or none used)
    if bits == 16:
        assert torch.equal(moment, (shared >> 16) << 16) and not (moment & (param >> 16)).any()
        assert torch.equal(moment | (param >> 16), shared)  # the two fields are the word, split
    else:
        assert torch.equal(moment, shared)


def test_the_kernel_shares_the_word_where_the_reference_does(monkeypatch):
    """norm2-root4 without a correction on bf16 draws no parameter word (the kernel's PARAM_OWN_DRAW off); the
    8-bit default without a correction does."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")

    def own_draw(**kwargs):
        w = torch.nn.Parameter(torch.randn(16, 256, dtype=torch.bfloat16))
        opt = fusedopt.AdamW([w], lr=1e-3, min_compress_numel=0, master_weight_bits=None, **kwargs)
        w.grad = torch.randn_like(w)
        opt.step()
        return {c["PARAM_OWN_DRAW"] for c in launch_constexprs(opt)}

    assert own_draw(state_format="norm2-root4") == {False}
    assert own_draw() == {True}


def test_decode_and_encode_moments_put_the_frame_first():
    shape = SHAPES[0]
    codecs = {"exp_avg": norm("norm2", shape), "exp_avg_sq": root4(shape)}
    frames = {"exp_avg": "exp_avg_sq"}
    gen = torch.Generator().manual_seed(2)
    v = second_moment(shape, 1)
    m = torch.randn(shape, generator=gen) * v.sqrt() * 0.2
    stored = encode_moments(codecs, {"exp_avg": m, "exp_avg_sq": v}, lambda i, whole: draw(3, i + 1, shape), frames)
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


def test_a_row_without_gradient_is_not_moved():
    emb = torch.nn.Parameter(torch.randn(64, 64))
    before = emb.detach().clone()
    opt = fusedopt.AdamW([emb], lr=1e-2, weight_decay=0.0, state_format="norm2-root4", min_compress_numel=0)
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
    [("norm2-root4", None), (None, "norm2-root4"), ("norm2-root4", "block4"), ("block4", "norm2-root4")],
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


def test_a_torch_adamw_checkpoint_loads_into_norm2_root4():
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, ref, inputs(3))
    opt = fusedopt.AdamW(copy.deepcopy(model).parameters(), lr=1e-2, state_format="norm2-root4", min_compress_numel=0)
    with pytest.warns(UserWarning, match="-> norm2"):
        opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    i = next(i for i, p in enumerate(model.parameters()) if p is model[0].weight)
    w = opt.param_groups[0]["params"][i]
    back = opt.torch_state_dict()["state"][i]
    exact = ref.state[model[0].weight]
    v, v_exact = back["exp_avg_sq"], exact["exp_avg_sq"]  # 91 elements: one block of the root grid
    r, r_exact = v.sqrt(), v_exact.sqrt()
    unit = r_exact.max() * FRESH_UNIT  # a fresh block's unit: level 1, the smallest nonzero root
    # a neighbouring level: from level 4 up at most 1.5 apart, below it (levels 1, 2, 3, 4) at most 2
    fine, coarse = r_exact >= 4 * unit, (r_exact >= unit) & (r_exact < 4 * unit)
    assert fine.float().mean() > 0.5 and coarse.any()
    torch.testing.assert_close(r[fine], r_exact[fine], rtol=0.5, atol=0)
    torch.testing.assert_close(r[coarse], r_exact[coarse], rtol=1.0, atol=0)
    below = r_exact < unit
    assert torch.all(v[below] >= v_exact[below])  # below the grid: level 1 (a smaller step), 0 for 0
    assert opt.state[w]["exp_avg.scales"].dtype == torch.bfloat16
