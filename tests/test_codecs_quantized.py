"""Block-quantized moments (state_bits=8 and 4): layout, round-trip bounds, small magnitudes,
EMA tracking under stochastic rounding, no NaN/Inf, checkpoints and the memory budget.

The format (``fusedopt/codecs/blockwise.py``): blocks of 16 elements, one E8M0 exponent byte
per block, codes ``q`` with levels ``L(q) * 2**(e - k)`` (sign-magnitude for signed moments;
L: shifted minifloat levels at 8 bits, q**2 at 4), stochastic rounding between the two levels
that bracket the value. The tests take the level map from the codec (``level_table``).
"""

import math

import pytest
import torch
from cases import formats
from helpers import moment_draws

import fusedopt
from fusedopt.codecs import FP32, codec_for
from fusedopt.codecs.blockwise import BLOCK, BlockCodec

SHAPE = torch.Size([67, 61])  # 4087 elements: not a multiple of the block, odd for 4-bit pairs
# the registry's quantized state formats (tests/cases.py), each for a signed moment (m, momentum)
# and a nonnegative one (v)
QUANTIZED = [f.bits for f in formats(quantized=True)]
CODEC_CASES = [(bits, signed) for bits in QUANTIZED for signed in (True, False)]
FORMATS = [pytest.param(b, s, id=f"int{b}-{'signed' if s else 'unsigned'}") for b, s in CODEC_CASES]
BITS = [pytest.param(b, id=f"int{b}") for b in QUANTIZED]


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: intra-op threads only add synchronisation (milliseconds on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def codec(bits: int, signed: bool, shape=SHAPE) -> BlockCodec:
    c = codec_for(bits, torch.Size(shape), 0, signed=signed)
    assert isinstance(c, BlockCodec)
    return c


def draw(key: int, step: int, shape):
    """The bits callback of the second moment's field."""
    return moment_draws(key, step, shape, field=1)


def nearest(shape):
    """u = 1/2 for every element: the same rounding step becomes round-to-nearest level."""
    return lambda: torch.full(tuple(shape), 1 << 31, dtype=torch.int64)


def sample(kind: str, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(shape, generator=gen)
    if kind == "student-t":  # heavy tails (3 degrees of freedom), by its definition
        z = torch.randn(shape, generator=gen)
        chi2 = (torch.randn((3, *shape), generator=gen) ** 2).sum(0)
        return z / (chi2 / 3).sqrt()
    # lognormal magnitudes spanning decades inside one block, random signs
    return torch.exp(2.0 * torch.randn(shape, generator=gen)) * torch.randn(shape, generator=gen).sign()


def level_table(c: BlockCodec) -> torch.Tensor:
    """Every level L(0) < ... < L(qmax) of the codec, float64."""
    levels = c.levels.level(torch.arange(c.qmax + 1, dtype=torch.int32)).double()
    assert levels[0] == 0 and torch.all(levels[1:] > levels[:-1]) and levels[-1] == c.top
    return levels


def max_gap(c: BlockCodec) -> float:
    """The largest distance between neighbouring levels (in level units)."""
    levels = level_table(c)
    return (levels[1:] - levels[:-1]).max().item()


def bracket(c: BlockCodec, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The levels lo <= t < hi around each t (t at the top: lo = hi = top)."""
    levels = level_table(c)
    i = (torch.searchsorted(levels, t.clamp(max=c.top).contiguous(), right=True) - 1).clamp(max=c.qmax)
    return levels[i], levels[(i + 1).clamp(max=c.qmax)]


def units(c: BlockCodec, stored, shape) -> torch.Tensor:
    """Each element's level unit 2**(e - k), from the stored exponent bytes (float64)."""
    e = stored[".scales"].double() - 127
    return torch.pow(2.0, e - c.k).repeat_interleave(c.block)[: shape.numel()].reshape(shape)


# --- wiring and layout -----------------------------------------------------------------------


def test_codec_for_picks_block_codecs_and_keeps_small_tensors_exact():
    assert codec_for(8, torch.Size([4096]), 0) is FP32  # 1-D: norms, biases
    assert codec_for(4, torch.Size([63, 65]), 4096) is FP32  # below min_compress_numel
    for bits, signed in CODEC_CASES:
        c = codec_for(bits, torch.Size([64, 64]), 4096, signed=signed)
        assert isinstance(c, BlockCodec) and c.state_bits == bits and c.signed == signed
        assert c.block == BLOCK and BLOCK & (BLOCK - 1) == 0


@pytest.mark.parametrize("bits,signed", FORMATS)
def test_layout_zeros_and_packing(bits, signed):
    c = codec(bits, signed)
    n = SHAPE.numel()
    layout = c.layout(SHAPE)
    assert set(layout) == {".codes", ".scales"}
    codes_shape = SHAPE if bits == 8 else torch.Size([(n + 1) // 2])  # 4 bits: two codes a byte
    assert layout[".codes"] == (torch.uint8, codes_shape)
    assert layout[".scales"] == (torch.uint8, torch.Size([math.ceil(n / BLOCK)]))
    zeros = c.zeros(SHAPE, torch.device("cpu"))
    assert {k: (t.dtype, t.shape) for k, t in zeros.items()} == layout
    assert torch.equal(c.decode(zeros), torch.zeros(SHAPE))
    # zeros() is the canonical encoding of zeros
    again = c.encode(torch.zeros(SHAPE), draw(1, 1, SHAPE))
    assert all(torch.equal(again[k], zeros[k]) for k in zeros)
    # 4-bit packing: element 2i in the low nibble of byte i, the odd last element alone
    x = sample("gauss", SHAPE, 3).abs() if not signed else sample("gauss", SHAPE, 3)
    enc = c.encode(x, draw(2, 1, SHAPE))
    if bits == 4:
        packed = enc[".codes"].to(torch.int32)
        first, second = packed & 0xF, packed >> 4
        assert second[-1] == 0  # n is odd: nothing in the last high nibble
        dec = c.decode(enc).reshape(-1)
        assert torch.equal(dec[0::2] == 0, (first[: (n + 1) // 2] & c.qmax) == 0)
        assert torch.equal(dec[1::2] == 0, (second[: n // 2] & c.qmax) == 0)


# --- 1. round trip: bounds per block ---------------------------------------------------------

# Why these bounds. Stochastic rounding returns one of the two levels that bracket
# t = |x| / unit, so |x_hat - x| < gap * unit with gap the largest distance between neighbouring
# levels. The block exponent is the smallest whose top level covers the block, so
# absmax > top * unit / 2. Hence, per block, max |x_hat - x| / absmax < 2 gap / top:
# int8 (minifloat, M = 4): 2 * 128 / 3952 = 6.5 % signed, 2 * 32768 / 1015792 = 6.5 % unsigned;
# int4 (q**2): 2 (2 qmax - 1) / qmax**2 = 53 % signed (qmax 7), 26 % unsigned (15).
# (Minifloat levels give up some of q**2's precision at the top of a block for a constant
# relative step below it: 1/16 to 1/32 of the value over 8 or 16 binades.)
# In the square-root domain both values lie between sqrt(lo) and sqrt(hi) in units of
# sqrt(unit): |sqrt|x_hat| - sqrt|x|| <= max(sqrt(hi) - sqrt(lo)) sqrt(unit), relative to
# sqrt(absmax) > sqrt(top unit / 2). That is the error AdamW sees in its denominator sqrt(v).
# The bounds hold whatever the data (they are relative to each block's absmax), so heavy tails
# only move elements towards the bottom of their block.


def block_view(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1).double()
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


@pytest.mark.parametrize("kind", ["gauss", "student-t", "lognormal"])
@pytest.mark.parametrize("bits,signed", FORMATS)
def test_round_trip_error_bounds_per_block(bits, signed, kind):
    c = codec(bits, signed)
    x = sample(kind, SHAPE, seed=11)
    x = x if signed else x * x
    enc = c.encode(x, draw(5, 3, SHAPE))
    xh = c.decode(enc)
    assert xh.dtype == torch.float32 and xh.shape == SHAPE

    # every element lands on one of the two levels around it (float64 arithmetic, independent
    # of the codec's own rounding code); signs are kept; unsigned nonzero values stay nonzero
    unit = units(c, enc, SHAPE)
    t = x.double().abs() / unit
    lo, hi = bracket(c, t)
    level = xh.double().abs() / unit
    # (unsigned: a nonzero value below level 1 must round up to it, never to 0)
    floor_rule = (lo == 0) & (x > 0) & (not signed)
    assert torch.all(((level == lo) & ~floor_rule) | (level == hi))
    assert signed or floor_rule.any()  # the data reach the rule
    assert torch.all((xh == 0) | (xh.sign() == x.sign()))

    absmax = block_view(x).abs().amax(1)
    err = block_view(xh - x).abs().amax(1) / absmax
    bound = 2 * max_gap(c) / c.top
    assert err.max() < bound, (err.max().item(), bound)
    assert err.max() > bound / 8  # the bound is not vacuous
    root_err = block_view(xh.abs().sqrt() - x.abs().sqrt()).abs().amax(1) / absmax.sqrt()
    roots = level_table(c).sqrt()
    assert root_err.max() <= (roots[1:] - roots[:-1]).max() / math.sqrt(c.top / 2)


@pytest.mark.parametrize("bits,signed", FORMATS)
def test_stochastic_rounding_is_unbiased(bits, signed):
    shape = torch.Size([33, 31])
    c = codec(bits, signed, shape)
    x = sample("student-t", shape, seed=4)
    x = x if signed else x * x
    draws = torch.stack([c.decode(c.encode(x, draw(9, s, shape))) for s in range(256)])
    unit = units(c, c.encode(x, draw(9, 0, shape)), shape)  # the exponents depend on x only
    t = x.double().abs() / unit
    lo, hi = bracket(c, t)
    gap = (hi - lo) * unit  # the level gap around each element
    keep = t >= 1 if not signed else torch.ones_like(t, dtype=torch.bool)  # below 1: rounded up
    bias = (draws.double().mean(0) - x.double()) / gap
    # per draw the error is within one gap, of standard deviation <= gap / 2
    assert bias[keep].abs().max() < 5 * 0.5 / math.sqrt(256)
    assert bias[keep].mean().abs() < 0.01
    # the spread shows these are genuine random draws, not one repeated rounding
    assert (draws.std(0) > 0).float().mean() > 0.5


# --- 2. small magnitudes survive ---------------------------------------------------------------


@pytest.mark.parametrize("bits,signed", FORMATS)
def test_small_magnitudes_are_encoded_as_precisely_as_unit_ones(bits, signed):
    """Power-of-two scales make the codec exactly scale-equivariant over fp32's range: moments
    of gradients around 1e-8 (m ~ 1e-8, v ~ 1e-16) keep every bit of the unit-scale precision."""
    c = codec(bits, signed)
    x = sample("lognormal", SHAPE, seed=21)
    x = x if signed else x * x
    ref = c.decode(c.encode(x, draw(3, 7, SHAPE)))
    for s in (2.0**-27, 2.0**-54, 2.0**-80, 2.0**40):  # 7e-9, 5.6e-17, 8e-25, 1e12
        scaled = c.decode(c.encode(x * s, draw(3, 7, SHAPE)))
        assert torch.equal(scaled, ref * s), s
    # fp16 scales (FlashOptim's) of the same blocks: v of 1e-8 gradients is flushed to zero,
    # m of them rounded to a subnormal with a large relative error
    s = 2.0**-27 if signed else 2.0**-54
    absmax = block_view(x * s).abs().amax(1).float()
    fp16_error = ((absmax.half().float() - absmax).abs() / absmax).median()
    assert fp16_error > (0.002 if signed else 0.99)
    assert torch.equal(c.decode(c.encode(x * s, draw(3, 7, SHAPE))) != 0, ref != 0)


TINY_GRADIENT_TOLERANCE = {8: 0.05, 4: 0.35}  # a new quantized format needs its own entry


@pytest.mark.parametrize("state_bits", BITS)
def test_adamw_with_tiny_gradients_matches_fp32_state(state_bits):
    """Fine-tuning-sized gradients (~1e-8): sqrt(v) ~ eps, so a flushed v would double the step."""
    tol = TINY_GRADIENT_TOLERANCE[state_bits]
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(SHAPE, generator=gen)
    grads = [1e-8 * torch.randn(SHAPE, generator=gen) for _ in range(15)]
    params = {}
    for name, make in (
        ("torch", lambda p: torch.optim.AdamW([p], lr=1e-3)),
        ("fusedopt", lambda p: fusedopt.AdamW([p], lr=1e-3, state_bits=state_bits, min_compress_numel=0)),
    ):
        p = torch.nn.Parameter(init.clone())
        opt = make(p)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        params[name] = p.detach()
        if name == "fusedopt":
            state = opt.state[p]
            assert state["exp_avg_sq.codes"].dtype == torch.uint8
            v = codec(state_bits, False).decode({s: state["exp_avg_sq" + s] for s in (".codes", ".scales")})
            assert (v > 0).all() and (v < 1e-15).all()
    moved = params["torch"] - init
    err = ((params["fusedopt"] - init) - moved).norm() / moved.norm()
    assert err < tol, err.item()


# --- 3. the EMA is tracked, not frozen -----------------------------------------------------------

EMA_SHAPE = torch.Size([37, 83])  # 3071 elements, 192 blocks


def ema_run(bits: int, signed: bool, beta: float, steps: int, rounding: str):
    """One element per block keeps gradient 1, the others' gradients stop: their moment must
    decay as beta**k. Returns, per step, the others' mean decoded moment over its exact value,
    and whether all of them are exactly zero."""
    c = codec(bits, signed, EMA_SHAPE)
    gen = torch.Generator().manual_seed(7)
    n = EMA_SHAPE.numel()
    big = (torch.arange(n) % BLOCK == 0).reshape(EMA_SHAPE)
    g0 = (0.5 + 0.5 * torch.rand(EMA_SHAPE, generator=gen)) * torch.randn(EMA_SHAPE, generator=gen).sign()
    g0 = torch.where(big, 1.0, g0)
    x0 = g0 if signed else g0 * g0
    sign = g0.sign() if signed else torch.ones(EMA_SHAPE)
    others = ~big
    exact0 = (x0 * sign)[others].mean().item()
    g = big.float()  # gradient from now on: 1 for the big elements, 0 for the others
    fresh = g if signed else g * g
    dec = c.decode(c.encode(x0, draw(40, 0, EMA_SHAPE)))
    ratios, all_zero = [], []
    for k in range(1, steps + 1):
        x = dec * beta + fresh * (1 - beta)  # decode -> fp32 EMA -> encode, as the optimizer
        dec = c.decode(c.encode(x, draw(40, k, EMA_SHAPE) if rounding == "stochastic" else nearest(EMA_SHAPE)))
        ratios.append((dec * sign)[others].mean().item() / (exact0 * beta**k))
        all_zero.append(bool((dec[others] == 0).all()))
    # the block scale is held by the big elements, which stay at 1
    assert (dec[big] - 1).abs().max() < 2 * max_gap(c) / c.top
    return ratios, all_zero


def v_tracks(ratios) -> bool:
    return all(abs(ratios[k - 1] - 1) < 0.1 for k in (250, 500, 1000, 2000))


def m_tracks(ratios, all_zero) -> bool:
    return all(abs(r - 1) < 0.1 for r in ratios[:20]) and all(all_zero[199:])


@pytest.mark.parametrize("bits", BITS)
def test_second_moment_decays_as_beta2_power_and_nearest_rounding_freezes(bits):
    ratios, _ = ema_run(bits, False, 0.999, 2000, "stochastic")
    assert v_tracks(ratios), [round(ratios[k - 1], 3) for k in (250, 500, 1000, 2000)]
    frozen, _ = ema_run(bits, False, 0.999, 2000, "nearest")
    assert not v_tracks(frozen)
    assert frozen[-1] > 1.5  # 0.999 * v rounds back to v: the decay never happens


@pytest.mark.parametrize("bits", BITS)
def test_first_moment_decays_as_beta1_power_then_is_exactly_zero(bits):
    ratios, all_zero = ema_run(bits, True, 0.9, 200, "stochastic")
    assert m_tracks(ratios, all_zero), (ratios[:20], all_zero[-1])
    stuck, stuck_zero = ema_run(bits, True, 0.9, 200, "nearest")
    assert not m_tracks(stuck, stuck_zero)
    assert not stuck_zero[-1]  # small codes round back to themselves and never reach zero


# --- 4. no NaN/Inf, zeros stay zero ------------------------------------------------------------


@pytest.mark.parametrize("bits,signed", FORMATS)
def test_extreme_inputs_decode_finite_and_zeros_stay_zero(bits, signed):
    big = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).smallest_normal
    blocks = [
        [big, -big, 1e38, -3e37, 1e-30, -1e-20, 1.0, 0.0] * 2,  # huge next to small
        [0.0] * BLOCK,  # an all-zero block
        [1e-40, -1e-42, 1.4e-45, 0.0, -5e-39, 2e-45, tiny, -tiny] * 2,  # denormals
        [float("inf"), float("-inf"), 1.0, -2.0, 0.0, 3.0, -1e-3, 5.0] * 2,  # saturate, not inf
        [1e-8, -3e-9, 2e-8, 0.0, 7e-9, -1e-8, 5e-9, 1.5e-8] * 2,
    ]
    x = torch.tensor(blocks).reshape(-1)[:-3]  # a partial last block
    x = x if signed else x.abs()
    shape = x.shape
    c = BlockCodec(bits, signed, codec(bits, signed).levels, BLOCK, shape)
    for rounding in (draw(1, 2, shape), nearest(shape)):
        xh = c.decode(c.encode(x, rounding))
        assert torch.isfinite(xh).all()
        assert torch.all(xh[x == 0] == 0)
        assert torch.all((xh == 0) | (xh.sign() == x.sign()))
        if not signed:
            assert torch.all(xh[x > 0] > 0)  # a nonzero v never decodes to 0
        # beyond the top level (about 2**127, with exponents capped at fp32's) values saturate
        top = c.top * 2.0 ** (127 - c.k)
        huge = x.abs() > 1e37
        saturated = x[huge].abs().clamp(max=top)
        assert torch.all((xh[huge].abs() - saturated).abs() <= 2 * max_gap(c) / c.top * top)
        assert torch.all(xh[x.isinf()].abs() == top)
    # any bytes (a corrupted or foreign checkpoint) still decode to finite numbers
    gen = torch.Generator().manual_seed(0)
    junk = {k: torch.randint(0, 256, s, generator=gen, dtype=torch.uint8) for k, (_, s) in c.layout(shape).items()}
    assert torch.isfinite(c.decode(junk)).all()


@pytest.mark.parametrize("state_bits", BITS)
def test_adamw_survives_huge_tiny_and_zero_gradients(state_bits):
    gen = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.randn(40, 130, generator=gen))
    start = p.detach().clone()
    opt = fusedopt.AdamW([p], lr=1e-2, weight_decay=0.0, state_bits=state_bits)
    dead = torch.zeros(40, 130, dtype=torch.bool)
    dead[:5] = True  # rows that never get a gradient
    for scale in (1e30, 3e38, 1e-41, 1.0, 0.0, 1e-8, 1e20):
        g = scale * (0.5 + 0.5 * torch.rand(p.shape, generator=gen)) * torch.randn(p.shape, generator=gen).sign()
        p.grad = torch.where(dead, 0.0, g)
        opt.step()
        assert torch.isfinite(p).all()
        state = opt.state[p]
        for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            m = codec(state_bits, signed, p.shape).decode({s: state[slot + s] for s in (".codes", ".scales")})
            assert torch.isfinite(m).all()
            assert torch.all(m[dead] == 0)
    assert torch.equal(p.detach()[dead], start[dead])
    assert opt.num_skipped_updates.item() == 0


# --- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("state_bits", BITS)
def test_torch_adamw_checkpoint_loads_into_quantized_state(state_bits):
    gen = torch.Generator().manual_seed(5)
    p_ref = torch.nn.Parameter(torch.randn(SHAPE, generator=gen))
    ref = torch.optim.AdamW([p_ref], lr=1e-3)
    for _ in range(3):
        p_ref.grad = torch.randn(SHAPE, generator=gen)
        ref.step()
    p = torch.nn.Parameter(p_ref.detach().clone())
    opt = fusedopt.AdamW([p], lr=1e-3, state_bits=state_bits, min_compress_numel=0)
    with pytest.warns(UserWarning, match="converted"):
        opt.load_state_dict(ref.state_dict())
    state = opt.state[p]
    assert {k: v.dtype for k, v in state.items() if k != "step"} == {
        "exp_avg.codes": torch.uint8,
        "exp_avg.scales": torch.uint8,
        "exp_avg_sq.codes": torch.uint8,
        "exp_avg_sq.scales": torch.uint8,
    }
    for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        c = codec(state_bits, signed)
        exact = ref.state[p_ref][slot]
        got = c.decode({s: state[slot + s] for s in (".codes", ".scales")})
        err = block_view(got - exact).abs().amax(1) / block_view(exact).abs().amax(1)
        assert err.max() < 2 * max_gap(c) / c.top

    # and a fusedopt checkpoint resumes bit for bit
    saved = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = fusedopt.AdamW([q], lr=1e-3, state_bits=state_bits, min_compress_numel=0)
    opt2.load_state_dict(saved)
    for a, o in ((p, opt), (q, opt2)):
        a.grad = torch.ones(SHAPE)
        o.step()
    assert torch.equal(p, q)
    assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])


# --- budget ----------------------------------------------------------------------------------


def test_state_bytes_per_element_for_a_large_adamw_parameter():
    shape = (512, 1027)
    budget = {32: 8.0, 16: 4.0, 8: 2.25, 4: 1.25}
    measured = {}
    for bits in budget:
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = fusedopt.AdamW([p], state_bits=bits)
        p.grad = torch.randn(shape)
        opt.step()
        nbytes = sum(t.numel() * t.element_size() for t in opt.state[p].values())
        measured[bits] = nbytes / p.numel()
    assert measured[32] <= 8.0 + 1e-4 and measured[16] <= 4.0 + 1e-4
    assert 2.0 < measured[8] <= budget[8], measured
    assert 1.0 < measured[4] <= budget[4], measured
    assert measured[8] == pytest.approx(2 + 2 / BLOCK, abs=1e-4)
    assert measured[4] == pytest.approx(1 + 2 / BLOCK, abs=1e-4)


def test_eight_bit_levels_are_the_documented_shifted_minifloat():
    """L(q) = (16 + q mod 16) * 2**(q >> 4) - 16 (blockwise.py's docstring), and a value
    exactly on a level, or halfway between two, encodes as the docstring says."""
    for signed, qmax, top in ((True, 127, 3952), (False, 255, 1015792)):
        c = codec(8, signed)
        q = torch.arange(qmax + 1)
        expected = ((16 + q % 16) * 2 ** (q // 16) - 16).double()
        assert torch.equal(level_table(c), expected) and c.top == top
        assert c.k == (top - 1).bit_length()
        levels = c.levels.level(q.to(torch.int32))
        on_level = c.levels.quantize(levels, torch.rand(qmax + 1, generator=torch.Generator().manual_seed(0)))
        assert torch.equal(on_level, q.to(torch.int32))  # a value on a level stays put, whatever the draw
        middle = (levels[:-1] + levels[1:]) / 2
        # the draw is added below the code's bits: from one half up it carries into the next level
        down = c.levels.quantize(middle, torch.full((qmax,), 0.5 - 2.0**-12))
        up = c.levels.quantize(middle, torch.full((qmax,), 0.5))
        assert torch.equal(down, q[:-1].to(torch.int32)) and torch.equal(up, q[1:].to(torch.int32))
