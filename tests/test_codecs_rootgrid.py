"""The root-grid second moment ``root4`` (``fusedopt/codecs/rootgrid.py``, the ``v`` of
``state_format="norm2-root4"``): levels, layout, fresh encodes, the decay carried by the unit, the
rounding of increments on the decayed grid, refits, junk input, and the exact square root a framed
first moment relies on. The kernel's twin is held to this reference in tests/test_lowbit_kernel.py.
"""

import math

import pytest
import torch
from helpers import second_moment
from helpers import whole_draws as draw

import fusedopt
from fusedopt.codecs import codec_for, codec_named
from fusedopt.codecs.rootgrid import BLOCK, FRESH_UNIT, LEVELS, SMALLEST_ROOT, TOP, RootGridCodec, root_decay

# 15 elements: one padded block; 1517: 12 blocks, the last partial; 1024: whole blocks
SHAPES = [torch.Size([3, 5]), torch.Size([37, 41]), torch.Size([4, 256])]
LEVEL_VALUES = [0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 36, 44, 52]
BETA2 = 0.999


def root4(shape) -> RootGridCodec:
    c = codec_named("root4", False, torch.Size(shape))
    assert isinstance(c, RootGridCodec)
    return c


def blocks(c: RootGridCodec, x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and zero-padded to the codec's blocks, ``(blocks, 128)``."""
    return torch.nn.functional.pad(x.reshape(-1), (0, c.blocks * BLOCK - c.numel)).view(c.blocks, BLOCK)


def fp32_root(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (through float64, whose rounding is then harmless)."""
    return x.double().sqrt().float()


def level_below(t: torch.Tensor) -> torch.Tensor:
    """The code of the largest level at most ``t`` (t >= 0, float64 arithmetic)."""
    table = torch.tensor(LEVEL_VALUES, dtype=torch.float64)
    return (torch.searchsorted(table, t.double(), right=True) - 1).clamp(0, 15).to(torch.int32)


def the_roots(c: RootGridCodec, stored) -> torch.Tensor:
    return RootGridCodec.roots(c.unpack(stored[".codes"]), stored[".scales"])


# --- levels, layout, bytes, the registry ---------------------------------------------------------


def test_the_levels_and_constants():
    assert LEVELS.level(torch.arange(16)).tolist() == LEVEL_VALUES and TOP == 52
    assert FRESH_UNIT == float(torch.tensor(1.25 / 52, dtype=torch.float32))
    for d in (0.999, 0.95, 0.5):
        assert root_decay(d) == float(torch.tensor(math.sqrt(d), dtype=torch.float32))
    assert root_decay(1.0) == 1.0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layout_zeros_and_packing(shape):
    c = root4(shape)
    n_blocks = -(-shape.numel() // BLOCK)
    assert c.blocks == n_blocks
    assert c.layout(shape) == {
        ".codes": (torch.uint8, torch.Size([n_blocks * BLOCK // 2])),
        ".scales": (torch.float32, torch.Size([n_blocks])),
    }
    zeros = c.zeros(shape, torch.device("cpu"))
    assert {s: (t.dtype, t.shape) for s, t in zeros.items()} == c.layout(shape)
    assert torch.equal(c.decode(zeros), torch.zeros(shape))
    codes = torch.randint(0, 16, (n_blocks, BLOCK), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = c.pack(codes)
    assert torch.equal(c.unpack(packed), codes)
    assert packed[0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)  # element 2i in the low nibble


def test_bytes_per_element():
    big = torch.Size([4096, 4096])
    assert root4(big).bytes_per_element(big) == 0.53125  # 1/2 + 4/128
    small = torch.Size([3, 5])  # one padded block: 64 code bytes and a unit
    assert root4(small).bytes_per_element(small) == (64 + 4) / 15
    m = codec_for(8, big, 0, state_format="norm2-root4")
    v = codec_for(8, big, 0, signed=False, state_format="norm2-root4")
    assert (m.name, v.name) == ("norm2", "root4") and isinstance(v, RootGridCodec)


def test_a_signed_moment_is_refused():
    with pytest.raises(ValueError, match="'root4' stores nonnegative moments only"):
        codec_named("root4", True, torch.Size([8, 8]))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), -float("inf")], ids=str)
def test_invalid_names_a_negative_or_non_finite_unit(bad):
    shape = SHAPES[1]
    c = root4(shape)
    stored = c.encode(second_moment(shape, 0), draw(0, 1, shape))
    assert c.invalid(stored) is None
    stored[".scales"][5] = bad
    assert c.invalid(stored) == f"1 of its {c.blocks} block scales are negative or not finite"


# --- fresh encodes -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_fresh_encode_rounds_each_root_to_a_neighbouring_level(shape):
    """The unit is the block's largest root times FRESH_UNIT; each root takes one of the two levels
    around it (a nonzero one level 1 at least); zeros stay zero, nonzero values stay nonzero."""
    c = root4(shape)
    for seed in range(3):
        x = second_moment(shape, seed)
        stored = c.encode(x, draw(seed, 1, shape))
        r = blocks(c, fp32_root(x))
        assert torch.equal(stored[".scales"], r.amax(dim=1) * FRESH_UNIT)
        t = r * (1.0 / stored[".scales"]).unsqueeze(1)  # as the codec computes it
        lo = level_below(t)
        codes = c.unpack(stored[".codes"])
        assert torch.all((codes == lo) | (codes == lo + 1) | ((lo == 0) & (codes == 1) & (r > 0)))
        assert torch.equal(codes > 0, r > 0)
        y = c.decode(stored)
        assert torch.equal(y == 0, x == 0)
        assert (t[r > 0] < 1).any()  # the tiny value: below level 1, kept at level 1


def test_small_magnitudes_survive():
    """A block's grid is its own: a root far below the block's largest takes level 1 (never 0), one a
    few binades below rounds between its neighbouring levels, and a block of tiny values keeps them."""
    x = torch.ones(3, BLOCK)
    x[0, 5] = 1e-30  # 100 binades below the block's largest value
    x[1, 5] = 1e-3  # 10 binades below: between levels 1 and 2
    x[2] = 1e-30 * torch.linspace(0.5, 1.0, BLOCK)  # a block of tiny values (roots ~2**-50)
    c = root4(x.shape)
    stored = c.encode(x, draw(0, 1, x.shape))
    y, units = c.decode(stored), stored[".scales"]
    assert y[0, 5] == units[0] * units[0]  # level 1
    assert units[1] ** 2 <= y[1, 5] <= (2 * units[1]) ** 2
    assert torch.all(y > 0)
    rel = (y[2].sqrt() / x[2].sqrt() - 1).abs()
    assert rel.max() < 0.3  # the top three binades' level spacing


def test_junk_saturates_and_never_makes_nan_or_inf():
    """inf and values above 2**100 saturate at 2**100 (root 2**50), NaN and negative values store 0;
    fresh or decayed, the decoded moment is finite and nonnegative."""
    shape = torch.Size([2, BLOCK])
    c = root4(shape)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) + 0.5
    stored = c.encode(x, draw(0, 1, shape))
    bad = x.clone()
    bad[0, :5] = torch.tensor([float("inf"), float("nan"), -1.0, -float("inf"), 3e38])
    bad[1, 7] = float("nan")
    fresh = c.encode(bad, draw(0, 2, shape))
    decayed = c.encode_decayed(bad, draw(0, 2, shape), stored, BETA2)
    for out in (fresh, decayed):
        y = c.decode(out)
        assert torch.isfinite(y).all() and torch.all(y >= 0)
        assert y[0, 1] == 0 and y[0, 2] == 0 and y[0, 3] == 0 and y[1, 7] == 0
        assert out[".scales"][0] == 2.0**50 * FRESH_UNIT  # refitted to the saturated root
        codes = c.unpack(out[".codes"])[0]
        assert set(codes[[0, 4]].tolist()) <= {13, 14}  # 2**50 is between levels 36 and 44 of that unit
    # the second block's NaN is a 0, on its decayed grid: no refit
    assert fresh[".scales"][1] == fp32_root(x[1]).max() * FRESH_UNIT
    assert decayed[".scales"][1] == stored[".scales"][1] * root_decay(BETA2)


# --- the decay on the unit -----------------------------------------------------------------------


@pytest.mark.parametrize("decay", [BETA2, 0.9])
def test_without_increments_the_codes_stay_and_the_units_decay_by_sqrt_d(decay):
    """The EMA decays (it does not freeze as a nearest rounding of ``d * v`` would): each step the
    decoded moment is ``d`` times the last within fp32 rounding, and the codes stay."""
    shape = SHAPES[1]
    c = root4(shape)
    stored = c.encode(second_moment(shape, 0), draw(0, 1, shape))
    first = c.decode(stored)
    steps = 100
    for step in range(2, 2 + steps):
        before = c.decode(stored)
        new = c.encode_decayed(before * decay, draw(0, step, shape), stored, decay)
        assert torch.equal(new[".codes"], stored[".codes"])
        assert torch.equal(new[".scales"], stored[".scales"] * root_decay(decay))
        torch.testing.assert_close(c.decode(new), before * decay, rtol=2**-20, atol=0)
        stored = new
    last = c.decode(stored)
    assert torch.all(last[first > 0] < first[first > 0]) and torch.all(last[first == 0] == 0)
    torch.testing.assert_close(c.decode(stored).double(), first.double() * decay**steps, rtol=1e-4, atol=0)


def test_increments_round_on_the_decayed_grid_unbiased_in_the_root():
    """Elements with an increment take one of the two levels of the decayed grid around their new root,
    up with the probability of the way to the upper level: over N draws the mean root is the root, within
    5 standard errors (per element, and 5 over the elements' mean z-score). The others keep their codes;
    no block is refitted.

    An element's draw is its 12-bit word mixed with its index: one of 4096 fixed uniforms, so its own
    probability of rounding up is the way to the upper level only within the discrepancy of 4096 points
    (variance ``p (1 - p) / 4096``), which more draws do not average out; the errors add it."""
    shape = torch.Size([4, BLOCK])
    c = root4(shape)
    gen = torch.Generator().manual_seed(4)
    stored = c.encode(torch.rand(shape, generator=gen) + 0.1, draw(1, 1, shape))
    units = stored[".scales"] * root_decay(BETA2)
    # new roots at a random fraction (0.1 to 0.9) of the way between two random neighbouring levels
    lo = torch.randint(1, 15, shape, generator=gen)
    frac = 0.1 + 0.8 * torch.rand(shape, generator=gen)
    low, high = LEVELS.level(lo), LEVELS.level(lo + 1)
    target = (low + frac * (high - low)) * units.unsqueeze(1)
    changed = (torch.arange(shape.numel()) % 2 == 1).view(shape)
    x = torch.where(changed, target * target, c.decode(stored) * BETA2)
    t = fp32_root(x) * (1.0 / units).unsqueeze(1)  # the new roots in units of the decayed grid
    below = level_below(t)
    assert torch.equal(below[changed], lo[changed].int())
    n = 1000
    total = torch.zeros(shape, dtype=torch.float64)
    old_codes = c.unpack(stored[".codes"])
    for k in range(n):
        new = c.encode_decayed(x, draw(2, k + 2, shape), stored, BETA2)
        assert torch.equal(new[".scales"], units)
        codes = c.unpack(new[".codes"])
        assert torch.equal(codes[~changed], old_codes[~changed])
        assert torch.all((codes[changed] == below[changed]) | (codes[changed] == below[changed] + 1))
        total += LEVELS.level(codes).double()
    mean, tv = (total / n)[changed], t.double()[changed]
    lower, upper = LEVELS.level(below).double()[changed], LEVELS.level(below + 1).double()[changed]
    z = (mean - tv) / ((upper - tv) * (tv - lower) * (1 / n + 1 / 4096)).sqrt()  # the rounding's standard error
    assert z.abs().max() < 5, z.abs().max()
    assert z.mean().abs() < 5 / math.sqrt(z.numel()), z.mean()


def test_tiny_increments_round_up_with_their_probability():
    """A root growing by 2e-4 of its level gap per step (decay 1): 0.2 levels per element over 1000 steps
    (the 24-bit draw; the moment's 12-bit field alone would round up with probability 2**-12, 0.24)."""
    shape = torch.Size([16, BLOCK])
    c = root4(shape)
    units = torch.ones(c.blocks)
    codes = torch.full((c.blocks, BLOCK), 4, dtype=torch.int32)  # level 4; levels 4, 6, 8: gaps of 2
    stored = {".codes": c.pack(codes), ".scales": units}
    steps, fraction = 1000, 2e-4
    for step in range(1, steps + 1):
        grown = c.decode(stored).sqrt() + fraction * 2
        stored = c.encode_decayed(grown * grown, draw(7, step, shape), stored, 1.0)
    assert torch.equal(stored[".scales"], units)
    rise = c.unpack(stored[".codes"]).double() - 4
    expected, std = steps * fraction, math.sqrt(steps * fraction / shape.numel())
    assert abs(rise.mean().item() - expected) < 5 * std, rise.mean()


# --- refits --------------------------------------------------------------------------------------


def test_a_root_above_the_decayed_top_refits_its_block_only():
    """A root above the decayed top level refits its block (unit: the largest root times FRESH_UNIT), as
    does a first value in a block of zeros (its unit decayed to 0); a root within fp32 rounding of the
    top, or an increment on the grid, keeps the decayed unit and the other codes."""
    shape = torch.Size([4, BLOCK])
    c = root4(shape)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) + 0.5
    x[3] = 0.0  # a block that never had a gradient
    stored = c.encode(x, draw(0, 1, shape))
    kept = stored[".scales"] * root_decay(BETA2)
    y = c.decode(stored) * BETA2
    top_root = TOP * kept
    y[0, 7] = float(top_root[0] * 1.01) ** 2  # above the decayed top
    y[1, 7] = float(top_root[1]) ** 2 * (1 + 2.0**-22)  # at the top, up to fp32 rounding
    y[2, 7] = float(0.5 * top_root[2]) ** 2  # an increment on the grid
    y[3, 3] = 1e-3  # a first nonzero value in a zero block
    new = c.encode_decayed(y, draw(0, 2, shape), stored, BETA2)
    units = new[".scales"]
    assert units[0] == fp32_root(y[0]).max() * FRESH_UNIT and units[0] != kept[0]
    assert torch.equal(units[1:3], kept[1:3])
    assert units[3] == fp32_root(torch.tensor(1e-3)) * FRESH_UNIT
    old_codes, codes = c.unpack(stored[".codes"]), c.unpack(new[".codes"])
    others = torch.ones(BLOCK, dtype=torch.bool)
    others[7] = False
    assert torch.equal(codes[1:3, others], old_codes[1:3, others])
    assert codes[1, 7] == 15
    out = c.decode(new)
    assert out[3, 3] > 0 and torch.count_nonzero(out[3]) == 1


# --- the square root of the decoded moment -------------------------------------------------------


def test_the_square_root_of_the_decoded_moment_is_the_stored_root():
    """``sqrt(decode)`` is ``L(c) * w`` exactly, so a first moment in units of ``sqrt(v)`` needs no square
    root: roots from 2**-90 to 2**60, and around 2**-63, below which they decode as 0 (their squares
    would be subnormal and lose the root)."""
    gen = torch.Generator().manual_seed(3)
    rows = 64
    shape = torch.Size([rows, BLOCK])
    c = root4(shape)
    codes = torch.randint(0, 16, (rows, BLOCK), generator=gen, dtype=torch.int32)
    units = (1 + torch.rand(rows, generator=gen)) * torch.exp2(torch.randint(-95, 55, (rows,), generator=gen).float())
    # the last 16 blocks: the unit puts the block's levels at 2**-63, an ulp or two either side
    edge = torch.randint(1, 16, (16,), generator=gen)
    units[-16:] = SMALLEST_ROOT / LEVELS.level(edge)
    units[-16:] = (units[-16:].view(torch.int32) + (torch.arange(16, dtype=torch.int32) % 5 - 2)).view(torch.float32)
    codes[-16:] = edge.int().unsqueeze(1)
    stored = {".codes": c.pack(codes), ".scales": units}
    v = c.decode(stored)
    r = RootGridCodec.roots(codes, units)
    assert torch.equal(v.sqrt(), r.view(shape))
    assert torch.equal(r == 0, (LEVELS.level(codes) * units.unsqueeze(1)) < SMALLEST_ROOT)
    assert torch.all((v == 0) | (v >= 2.0**-126))  # never subnormal
    near = r[-16:]
    assert (near == 0).any() and (near == SMALLEST_ROOT).any() and (near > SMALLEST_ROOT).any()
    # and on what an encode writes: the roots of values from many binades
    x = second_moment(SHAPES[1], 1) * 1e-20
    stored = root4(SHAPES[1]).encode(x, draw(1, 1, SHAPES[1]))
    flat = the_roots(root4(SHAPES[1]), stored).reshape(-1)[: x.numel()].view(x.shape)
    assert torch.equal(root4(SHAPES[1]).decode(stored).sqrt(), flat)


# --- through the optimizer ----------------------------------------------------------------------


def test_the_optimizer_hands_the_decay_to_root4():
    """A step with a zero gradient: v's units are multiplied by fp32(sqrt(beta2)) and its codes stay."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(67, 61, generator=gen))
    opt = fusedopt.AdamW([w], lr=1e-2, state_format="norm2-root4", min_compress_numel=0)
    for _ in range(3):
        w.grad = torch.randn(67, 61, generator=gen)
        opt.step()
    before = {k: v.clone() for k, v in opt.state[w].items()}
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(opt.state[w]["exp_avg_sq.scales"], before["exp_avg_sq.scales"] * root_decay(BETA2))
    assert torch.equal(opt.state[w]["exp_avg_sq.codes"], before["exp_avg_sq.codes"])


def test_adam_second_moment_is_tracked_and_decays_when_the_gradient_stops():
    """1200 updates of v from a gradient stream (rows scaled over decades), decode -> EMA -> encode_decayed
    as the optimizer does: mean sqrt(v) within a few percent of fp32's, on the rows whose gradient stopped
    halfway too (they decay, not freeze). Rounding unbiased in the root adds its variance to v at every
    rounded step (E[r'**2] = r**2 + Var), so the stored v reads high, never low: a smaller Adam step."""
    shape = torch.Size([16, 256])
    gen = torch.Generator().manual_seed(3)
    row_scale = torch.exp(1.5 * torch.randn(shape[0], 1, generator=gen))
    c = root4(shape)
    stored, v = c.zeros(shape, "cpu"), torch.zeros(shape)
    for step in range(1, 1201):
        g = torch.randn(shape, generator=gen) * row_scale
        if step > 600:
            g[:4] = 0.0
        v = BETA2 * v + 0.001 * g * g
        stored = c.encode_decayed(BETA2 * c.decode(stored) + 0.001 * g * g, draw(2, step, shape), stored, BETA2)
    q = c.decode(stored)
    for rows in (slice(0, 4), slice(4, 16)):  # stopped, running
        ratio = (q[rows].sqrt() / v[rows].sqrt()).mean().item()
        assert 1 <= ratio < 1.05, (rows, ratio)


@pytest.mark.parametrize("shape", [(1, 1), (1, 127), (1, 129), (5, 32), (3, 300)])
def test_each_element_decodes_alone_as_in_its_block(shape):
    """A sharded checkpoint keeps a code and a scale per element; where another sharding split the blocks
    (checkpoint._from_elements) each element is decoded alone: as its block decodes it, bit for bit, for the
    second moment and for the first in its units."""
    torch.manual_seed(sum(shape))
    v_codec, m_codec = codec_named("root4", False, torch.Size(shape)), codec_named("norm2", True, torch.Size(shape))
    v = v_codec.encode(second_moment(shape, seed=1), draw(1, 1, shape))
    v_values = v_codec.decode(v)
    m = m_codec.encode(torch.randn(shape) * v_values.sqrt(), draw(2, 1, shape), frame=v_values)
    n = math.prod(shape)
    for codec, stored, frame in ((v_codec, v, None), (m_codec, m, v_values)):
        codes = codec.unpack(stored[".codes"]).reshape(-1)[:n]
        scales = stored[".scales"].repeat_interleave(codec.block)[:n]
        alone = codec.decode_elements(codes.to(torch.uint8), scales, frame)
        whole = codec.decode(stored, frame=frame) if codec.frame else codec.decode(stored)
        assert torch.equal(alone, whole.reshape(-1))
