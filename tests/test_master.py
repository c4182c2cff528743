"""Master-weight splitting: bf16/fp16 head + int8/int16 correction (``master_weight_bits`` 24/32)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from cases import LOW_DTYPES, algorithm_cases, cross, dtype_cases, master_cases
from helpers import save_load
from helpers import ulp as _ulp

import fusedopt
from fusedopt.master import join_master, split_master

LOW = dtype_cases(*LOW_DTYPES)  # the dtypes split into a head and a correction
CORRECTION = {24: torch.int8, 32: torch.int16}
BF16_MAX_PATTERN = 0x7F7F7FFF  # the largest fp32 that still rounds to a finite bf16


# --- helpers ---------------------------------------------------------------------------------


def patterns_with_all_low_bits(highs: list[int]) -> torch.Tensor:
    """fp32 values whose top 16 bits run over ``highs`` and low 16 bits over all 65536 patterns."""
    high = torch.tensor(highs, dtype=torch.int64)[:, None] << 16
    bits = (high | torch.arange(1 << 16, dtype=torch.int64)[None, :]).reshape(-1)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    return bits.view(torch.float32)


def nearest_ties_away(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Independent oracle (float64): the nearest ``dtype`` value, ties away from zero (x must round finite)."""
    rne = x.to(dtype)
    toward = torch.where(x.double() > rne.double(), float("inf"), float("-inf")).to(dtype)
    other = torch.nextafter(rne, toward)
    tie = (x.double() - rne.double()).abs() == (other.double() - x.double()).abs()
    tie &= x.double() != rne.double()
    away = torch.where(other.double().abs() > rne.double().abs(), other, rne)
    return torch.where(tie, away, rne)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance from |x| (in ``dtype``) to the next larger magnitude, as fp32."""
    return _ulp(x.to(dtype).abs())


def random_values(shape, seed: int, low: float = 0.05, high: float = 4.0) -> torch.Tensor:
    """Random non-zero fp32 values of both signs with magnitudes log-uniform in [low, high)."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(shape).uniform_(math.log(low), math.log(high), generator=gen))
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return mag * sign


def step_with(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype, copy=True)
    opt.step()
    opt.zero_grad()


# --- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,bits", cross(dtype_cases(), master_cases()))
def test_valid_master_weight_bits(dtype, bits):
    p = torch.nn.Parameter(torch.randn(3, 5).to(dtype))
    opt = fusedopt.AdamW([p], state_bits=32, master_weight_bits=bits)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    if dtype != torch.float32 and bits is not None:
        assert state["master_correction"].dtype == CORRECTION[bits]
        assert state["master_correction"].shape == p.shape
    else:
        assert "master_correction" not in state


@pytest.mark.parametrize("bits", [16, 8, 0, 33, -24, True, 24.0, "32"])
def test_invalid_master_weight_bits(bits):
    p = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="master_weight_bits"):
        fusedopt.AdamW([p], master_weight_bits=bits)
    with pytest.raises(ValueError, match="master_weight_bits"):  # also checked per group, fp32 included
        fusedopt.SGD([{"params": [torch.nn.Parameter(torch.randn(3))], "master_weight_bits": bits}], lr=0.1)


# --- the split, exhaustively -----------------------------------------------------------------

# bf16 heads (sign added below): zero and subnormals, the smallest normals, binade edges
# (lowest and highest mantissa) at small, unit and large exponents, and the top of the range.
BF16_HEADS = [0x0000, 0x0001, 0x007F, 0x0080, 0x0081, 0x00FF, 0x0100, 0x3F00, 0x3F7F, 0x3F80, 0x3FFF, 0x4000]
BF16_HEADS += [0x1A55, 0x6000, 0x65C3, 0x7F00, 0x7F7E, 0x7F7F]


def test_bf16_int16_split_is_bit_exact_for_every_fp32():
    x = patterns_with_all_low_bits(BF16_HEADS + [h | 0x8000 for h in BF16_HEADS])
    head, correction = split_master(x, torch.bfloat16, torch.int16, None)
    master = join_master(head, correction)
    magnitude = x.view(torch.int32) & 0x7FFFFFFF
    top = magnitude > BF16_MAX_PATTERN  # would round to inf: 2**15 values per sign
    assert top.sum() == 2 * (1 << 15)
    assert same_bits(master[~top], x[~top])
    assert torch.isfinite(head).all()
    assert same_bits(head[~top], nearest_ties_away(x[~top], torch.bfloat16))
    # the head differs from torch's rounding (ties to even) exactly on ties that go to the even side
    ties = (x.view(torch.int32) & 0xFFFF) == 0x8000
    differs = head.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(differs[~top], (ties & ((x.view(torch.int32) >> 16) & 1 == 0))[~top])
    assert torch.equal(correction[ties & ~top], torch.full_like(correction[ties & ~top], -32768))
    # the top saturates: largest finite head, master clamped to the largest value rounding to it
    assert torch.equal(head[top].abs().float(), torch.full_like(x[top], torch.finfo(torch.bfloat16).max))
    assert torch.equal(master[top].view(torch.int32) & 0x7FFFFFFF, torch.full_like(magnitude[top], BF16_MAX_PATTERN))
    assert torch.equal(master[top].sign(), x[top].sign())


def test_fp16_int16_split_is_bit_exact_in_range():
    # fp32 binades (lowest and highest mantissa tops): fp16 subnormals from 2**-24, the smallest
    # normals (2**-14 is exponent 113), 1.0, and the top binade of fp16 (2**15)
    exponents = [103, 104, 109, 110, 111, 112, 113, 114, 127, 141, 142]
    highs = [(e << 7) | m for e in exponents for m in (0x00, 0x7F)]
    x = patterns_with_all_low_bits(highs + [h | 0x8000 for h in highs] + [0x477F, 0x7F7F, 0xC77F])
    head, correction = split_master(x, torch.float16, torch.int16, None)
    master = join_master(head, correction)
    a = x.abs()
    exact = (a >= 2.0**-17) & (a < 65520)
    assert same_bits(master[exact], x[exact])
    assert same_bits(head[exact], nearest_ties_away(x[exact], torch.float16))
    small = a < 2.0**-17  # fixed point with step 2**-40 (nearest)
    assert small.any() and ((master[small] - x[small]).abs() <= 2.0**-41).all()
    assert ((master[small] * 2.0**40).frac() == 0).all()
    big = a >= 65520  # would round to inf: saturates below 65520 with a finite head
    assert big.any() and torch.isfinite(head).all()
    assert torch.equal(head[big].abs().float(), torch.full_like(x[big], 65504.0))
    assert (master[big].abs() < 65520).all() and (master[big].abs() > 65519.99).all()
    assert torch.equal(master.sign(), x.sign())


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("correction_dtype", [torch.int8, torch.int16])
def test_non_finite_values_pass_through(dtype, correction_dtype):
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    head, correction = split_master(x, dtype, correction_dtype, torch.randint(0, 2**32, x.shape))
    master = join_master(head, correction)
    assert torch.equal(master[:2], x[:2]) and master[2].isnan()
    assert same_bits(master[3:], x[3:])  # signed zeros kept
    assert torch.equal(correction, torch.zeros_like(correction))


@pytest.mark.parametrize("dtype", LOW)
def test_int8_split_rounds_onto_the_24_bit_grid(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40_001, generator=gen) * torch.exp(torch.randn(40_001, generator=gen) * 3)
    x[:7] = torch.tensor([2.0**-14, -(2.0**-14) * 0.999, 2.0**-20, 1.0, -1.0 + 2.0**-20, 3e-9, 60000.0])
    x = x[x.abs() < 6e4]
    a = x.abs()
    fp16_small = (dtype == torch.float16) & (a < 2.0**-14)
    step = torch.where(fp16_small, torch.full_like(x, 2.0**-32), ulp(x, dtype) * 2.0**-8)
    for bits in (None, torch.randint(0, 2**32, x.shape, generator=gen)):
        head, correction = split_master(x, dtype, torch.int8, bits)
        master = join_master(head, correction)
        # on the master grid (the grid step just below a binade edge is half of it above)
        err = (master.double() - x.double()).abs()
        limit = step.double() * (0.5 if bits is None else 1.0)
        assert (err <= limit).all()
        assert same_bits(head, nearest_ties_away(master, dtype))
        # re-encoding a master is exact, whatever the random bits: it is on the grid
        again = split_master(master, dtype, torch.int8, torch.randint(0, 2**32, x.shape, generator=gen))
        assert same_bits(again[0], head) and same_bits(again[1], correction)
        # widening to int16 (24 -> 32 bits) keeps the master bit for bit
        assert same_bits(join_master(head, correction.to(torch.int16) * 256), master)


@pytest.mark.parametrize("dtype", LOW)
def test_int8_stochastic_rounding_is_unbiased(dtype):
    n = 100_000
    for value in (1.2345678, -0.0123456, 3.0e-6):
        x = torch.full((n,), value)
        head, correction = split_master(x, dtype, torch.int8, torch.randint(0, 2**32, (n,)))
        master = join_master(head, correction).double()
        assert len(master.unique()) == 2  # the two grid neighbours
        spread = (master.max() - master.min()).item()
        assert abs(master.mean().item() - x[0].item()) < 4 * 0.5 * spread / n**0.5


# --- the optimizer: updates below one ulp ------------------------------------------------------


@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_thousand_tenth_ulp_updates_move_like_fp32(bits):
    shapes = {torch.bfloat16: (37, 3), torch.float16: (129,)}
    params = [torch.nn.Parameter(random_values(s, seed=1, low=0.3, high=3.0).to(d)) for d, s in shapes.items()]
    inits = [p.detach().float() for p in params]
    gen = torch.Generator().manual_seed(7)
    units = [ulp(p, p.dtype) for p in params]
    signs = [torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0) for p in params]
    # lr 1, gradient a tenth of an ulp (in the parameter dtype, as autograd would give it)
    grads = [(s * u / 10).to(p.dtype) for s, u, p in zip(signs, units, params)]
    opt = fusedopt.SGD(params, lr=1.0, state_bits=32, master_weight_bits=bits)
    reference = [w.clone() for w in inits]
    for _ in range(1000):
        step_with(opt, params, grads)
        reference = [w - g.float() for w, g in zip(reference, grads)]  # fp32 master weights
    for p, w0, ref, g, unit in zip(params, inits, reference, grads, units):
        master = opt.master_weight(p)
        unit = unit.double()
        expected = -1000 * g.double() / unit  # about -/+100 ulps
        moved = (p.float() - w0).double() / unit
        assert ((moved - expected).abs() <= 1.5).all()  # moved by itself, to the nearest head
        if bits == 32:
            assert same_bits(master, ref), p.dtype  # fp32 bit for bit
        else:  # stochastic rounding on a 256-steps-per-ulp grid: ~sqrt(1000)/3 steps of noise
            assert ((master.double() - ref.double()).abs() / unit).max() < 0.3
        assert same_bits(p.detach(), nearest_ties_away(master, p.dtype))


def test_updates_below_the_24_bit_grid_still_accumulate():
    # a thousandth of a bf16 ulp is a quarter of a 24-bit grid step: nearest rounding would freeze
    w0 = random_values((4099,), seed=3, low=1.0, high=1.9)  # one binade: unit ulp 2**-7
    p = torch.nn.Parameter(w0.to(torch.bfloat16))
    g = torch.full(p.shape, -(2.0**-7) / 1000)
    opt = fusedopt.SGD([p], lr=1.0, state_bits=32, master_weight_bits=24)
    start = opt.master_weight(p)
    for _ in range(1000):
        step_with(opt, [p], [g])
    moved = (opt.master_weight(p) - start) / 2.0**-7
    expected = -1000 * g.to(torch.bfloat16).float()[0].item() / 2.0**-7  # one ulp, as fp32 would move
    assert abs(expected - 1.0) < 0.01 and abs(moved.mean().item() - expected) < 0.02
    assert moved.std().item() < 0.1


@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_nonfinite_gradient_leaves_head_and_correction(bits):
    p = torch.nn.Parameter(torch.randn(5, 7, dtype=torch.bfloat16))
    opt = fusedopt.AdamW([p], lr=1e-3, state_bits=32, master_weight_bits=bits)
    step_with(opt, [p], [torch.randn(5, 7)])
    before = p.detach().clone(), opt.state[p]["master_correction"].clone()
    bad = torch.randn(5, 7)
    bad[2, 3] = float("nan")
    step_with(opt, [p], [bad])
    assert same_bits(p.detach(), before[0]) and same_bits(opt.state[p]["master_correction"], before[1])
    assert opt.num_skipped_updates.item() == 1


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_top_of_range_saturates_finite(dtype, bits):
    top = torch.finfo(dtype).max
    p = torch.nn.Parameter(torch.tensor([top, -top, 1.0], dtype=dtype))
    opt = fusedopt.SGD([p], lr=1.0, state_bits=32, master_weight_bits=bits)
    # 0.3 ulp per step: past the largest value with a finite nearest head after two steps (bf16's
    # fp32 headroom is one bf16 ulp: a larger push overflows fp32 itself, and inf passes through)
    top_ulp = top - torch.nextafter(torch.tensor(top, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()
    push = 0.3 * top_ulp
    for _ in range(3):
        step_with(opt, [p], [torch.tensor([-push, push, 0.0])])
    master = opt.master_weight(p)
    assert torch.isfinite(p).all() and torch.equal(p.detach()[:2].float(), torch.tensor([top, -top]))
    assert (master[:2].abs() > top).all() and torch.equal(master[:2].sign(), torch.tensor([1.0, -1.0]))
    if dtype == torch.bfloat16 and bits == 32:
        assert (master[0].view(torch.int32) == BF16_MAX_PATTERN).item()
    assert (master[:2].abs().double() < top + top_ulp / 2).all()  # rounds to the finite head


# --- training: bf16 + int16 is fp32 master weights -------------------------------------------


class RoundTiesAway(torch.autograd.Function):
    """fp32 -> bf16 with the split's rounding (ties away from zero); gradient passes through as fp32."""

    @staticmethod
    def forward(ctx, w):
        return nearest_ties_away(w, torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        return grad.float()


def make_mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


def mlp_loss(model, x, y, cast):
    h = x
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            h = torch.nn.functional.linear(h, cast(layer.weight), cast(layer.bias))
        else:
            h = layer(h)
    return ((h.float() - y) ** 2).mean()


def test_bf16_int16_split_trains_like_fp32_master_weights():
    steps = 25
    gen = torch.Generator().manual_seed(5)
    teacher = torch.randn(24, 5, generator=gen) / 5
    inputs = [torch.randn(16, 24, generator=gen) for _ in range(steps)]
    data = [(x, torch.tanh(x @ teacher)) for x in inputs]

    fp32_model = make_mlp(0)  # fp32 master weights, bf16 compute
    autocast_model = copy.deepcopy(fp32_model)
    split_model = copy.deepcopy(fp32_model).bfloat16()
    kwargs = dict(lr=1e-2, weight_decay=0.1, state_bits=32)
    fp32_opt = fusedopt.AdamW(fp32_model.parameters(), **kwargs)
    autocast_opt = fusedopt.AdamW(autocast_model.parameters(), **kwargs)
    split_opt = fusedopt.AdamW(split_model.parameters(), master_weight_bits=32, **kwargs)
    fusedopt.load_master_state_dict(split_model, split_opt, fp32_model.state_dict())  # exact fp32 start

    tie_seen = False
    compared = 0
    for x, y in data:
        split_loss = mlp_loss(split_model, x.bfloat16(), y, lambda w: w)
        fp32_loss = mlp_loss(fp32_model, x.bfloat16(), y, RoundTiesAway.apply)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_loss = autocast_model(x).float()
        autocast_loss = ((autocast_loss - y) ** 2).mean()
        assert torch.equal(split_loss, fp32_loss)
        # torch rounds ties to even, the split away from zero: identical until such a tie is seen
        for p in autocast_model.parameters():
            tie_seen |= not same_bits(p.to(torch.bfloat16), nearest_ties_away(p.detach(), torch.bfloat16))
        if not tie_seen:
            assert torch.equal(split_loss, autocast_loss)
        for opt, loss in ((split_opt, split_loss), (fp32_opt, fp32_loss)):
            loss.backward()
            opt.step()
            opt.zero_grad()
        autocast_loss.backward()
        autocast_opt.step()
        autocast_opt.zero_grad()
        for p32, pa, ps in zip(fp32_model.parameters(), autocast_model.parameters(), split_model.parameters()):
            master = split_opt.master_weight(ps)
            assert same_bits(master, p32.detach())  # the master is the fp32 weight, bit for bit
            assert same_bits(ps.detach(), nearest_ties_away(p32.detach(), torch.bfloat16))
            if not tie_seen:
                assert same_bits(master, pa.detach())
        compared += not tie_seen
    assert compared >= 10, compared
    x, y = data[0]
    assert mlp_loss(split_model, x.bfloat16(), y, lambda w: w) < 0.5 * mlp_loss(make_mlp(0), x, y, lambda w: w)


def test_autocast_differs_only_at_ties():
    w = random_values((7, 9), seed=11)
    pattern = w.view(torch.int32)
    pattern[2, 4] = (pattern[2, 4] & ~0x1FFFF) | 0x8000  # an exact tie whose lower neighbour is even
    pattern[5, 1] = (pattern[5, 1] & ~0x1FFFF) | 0x18000  # a tie whose lower neighbour is odd
    p = torch.nn.Parameter(torch.zeros(7, 9, dtype=torch.bfloat16))
    opt = fusedopt.SGD([p], lr=0.1, state_bits=32, master_weight_bits=32)
    fusedopt.load_master_state_dict(torch.nn.ParameterDict({"w": p}), opt, {"w": w})
    assert same_bits(opt.master_weight(p), w)
    differs = (p.detach().view(torch.int16) != w.to(torch.bfloat16).view(torch.int16)).nonzero().tolist()
    assert differs == [[2, 4]]
    assert p.detach()[2, 4].abs() > w[2, 4].abs()


# --- helpers: master_weight, master_state_dict, load_master_state_dict ----------------------


class Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.lin = torch.nn.Linear(13, 7).to(dtype)
        self.conv = torch.nn.Conv1d(2, 3, 3).to(dtype)
        self.norm = torch.nn.BatchNorm1d(3)  # fp32 parameters and buffers (an int64 counter too)

    def forward(self, x):
        h = self.conv(x.to(self.conv.weight.dtype)).float()
        h = self.norm(h).flatten(1)[:, :13]
        return self.lin(h.to(self.lin.weight.dtype)).float().sum()


def train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 2, 9, generator=gen)).backward()
        opt.step()
        opt.zero_grad()


def test_master_weight_method():
    p16 = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.bfloat16))
    p32 = torch.nn.Parameter(torch.randn(6, 5))
    plain = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float16))
    opt = fusedopt.AdamW([{"params": [p16, p32]}, {"params": [plain], "master_weight_bits": None}], state_bits=32)
    assert same_bits(opt.master_weight(p16), p16.detach().float())  # no state yet: the value itself
    step_with(opt, [p16, p32, plain], [torch.randn(6, 5) for _ in range(3)])
    master = opt.master_weight(p16)
    assert master.dtype == torch.float32 and not master.requires_grad
    assert same_bits(master, join_master(p16.detach(), opt.state[p16]["master_correction"]))
    assert not torch.equal(master, p16.detach().float())  # the low bits are there
    for p in (p32, plain):
        m = opt.master_weight(p)
        assert same_bits(m, p.detach().float())
        m.add_(1.0)  # a new tensor: the parameter is untouched
        assert not torch.equal(m, p.detach().float())
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.master_weight(torch.nn.Parameter(torch.randn(2)))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_master_state_dict_round_trip(dtype, bits):
    model = Net(dtype)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=32, master_weight_bits=bits)
    train(model, opt, 3, seed=0)
    full = fusedopt.master_state_dict(model, opt)
    assert full.keys() == model.state_dict().keys()
    assert full["norm.num_batches_tracked"].dtype == torch.int64
    for name, p in model.named_parameters():
        assert full[name].dtype == torch.float32
        assert same_bits(full[name], opt.master_weight(p))
    assert same_bits(full["norm.running_var"], model.norm.running_var)
    # into a fresh split model: the same masters and heads, bit for bit
    other = Net(dtype)
    other_opt = fusedopt.AdamW(other.parameters(), lr=1e-2, state_bits=32, master_weight_bits=bits)
    fusedopt.load_master_state_dict(other, other_opt, full)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert same_bits(q.detach(), p.detach()), name
        assert same_bits(other_opt.master_weight(q), full[name]), name
    # and into an fp32 model, as an ordinary state dict
    plain = Net(torch.float32)
    plain.load_state_dict(full)
    assert same_bits(plain.lin.weight.detach(), full["lin.weight"])


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_load_master_state_dict_sets_the_master(dtype, bits):
    model = Net(dtype)
    opt = fusedopt.AdamW(model.parameters(), state_bits=16, master_weight_bits=bits)
    values = {
        k: random_values(v.shape, seed=i) if v.is_floating_point() else v
        for i, (k, v) in enumerate(model.state_dict().items())
    }
    fusedopt.load_master_state_dict(model, opt, values)
    for name, p in model.named_parameters():
        master = opt.master_weight(p)
        if p.dtype == torch.float32 or bits == 32:
            assert same_bits(master, values[name]), name  # |values| >= 0.05: exact for fp16 too
        else:
            step = ulp(values[name], dtype) * 2.0**-8
            assert ((master - values[name]).abs() <= step / 2).all(), name
        assert same_bits(p.detach(), nearest_ties_away(master, p.dtype)), name
    missing = dict(values)
    del missing["lin.weight"]
    with pytest.raises(RuntimeError, match="lin.weight"):
        fusedopt.load_master_state_dict(model, opt, missing)
    result = fusedopt.load_master_state_dict(model, opt, missing, strict=False)
    assert result.missing_keys == ["lin.weight"]
    with pytest.raises(TypeError, match="fusedopt optimizer"):
        fusedopt.master_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("problem", ["shape", "missing", "unexpected"])
def test_a_refused_load_master_state_dict_leaves_every_master_as_it_was(problem):
    """torch's load_state_dict copies what fits and raises at the end: a split parameter would get
    its new bf16 value beside its old correction, a master that is neither. fusedopt raises first."""
    model = Net(torch.bfloat16)
    opt = fusedopt.AdamW(model.parameters(), state_bits=16, master_weight_bits=24)
    start = {k: random_values(v.shape, seed=i) for i, (k, v) in enumerate(model.state_dict().items())}
    fusedopt.load_master_state_dict(model, opt, start)
    before = {name: opt.master_weight(p) for name, p in model.named_parameters()}
    values = {k: random_values(v.shape, seed=10 + i) for i, (k, v) in enumerate(model.state_dict().items())}
    name = next(iter(values))
    if problem == "shape":
        values[name] = torch.zeros(2, 3)
    elif problem == "missing":
        del values[name]
    else:
        values["extra.weight"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match="nothing was loaded"):
        fusedopt.load_master_state_dict(model, opt, values)
    for name, p in model.named_parameters():
        assert same_bits(opt.master_weight(p), before[name]), name


# --- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bits", master_cases(24, 32))
def test_checkpoint_round_trip_and_resume(dtype, bits):
    model = Net(dtype)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=16, master_weight_bits=bits, seed=3)
    train(model, opt, 3, seed=1)
    saved_model, saved_opt = save_load(model.state_dict()), save_load(opt.state_dict())
    for p in (model.lin.weight, model.conv.weight, model.lin.bias):
        assert saved_opt["state"][opt.position(p)[1]]["master_correction"].dtype == CORRECTION[bits]
    other = Net(dtype)
    other.load_state_dict(saved_model)
    other_opt = fusedopt.AdamW(other.parameters(), lr=1.0, state_bits=32, master_weight_bits=None)
    other_opt.load_state_dict(saved_opt)  # saved options (bits included) win
    for p, q in zip(model.parameters(), other.parameters()):
        for key, value in opt.state[p].items():
            assert same_bits(other_opt.state[q][key], value), key
    train(model, opt, 3, seed=2)
    train(other, other_opt, 3, seed=2)
    for p, q in zip(model.parameters(), other.parameters()):
        assert same_bits(q.detach(), p.detach())
        assert same_bits(other_opt.master_weight(q), opt.master_weight(p))


@pytest.mark.parametrize("source", ["fusedopt_fp32", "torch"])
def test_checkpoint_from_fp32_parameters_into_split(source):
    fp32 = Net(torch.float32)
    if source == "torch":
        fp32_opt = torch.optim.AdamW(fp32.parameters(), lr=1e-2)
    else:
        # saved options win on load: master_weight_bits (ignored for fp32) travels with the checkpoint
        fp32_opt = fusedopt.AdamW(fp32.parameters(), lr=1e-2, state_bits=32, master_weight_bits=32)
    train(fp32, fp32_opt, 2, seed=4)
    split = Net(torch.bfloat16)
    split.load_state_dict(fp32.state_dict())  # torch rounds the weights to bf16
    split_opt = fusedopt.AdamW(split.parameters(), lr=1e-2, state_bits=32, master_weight_bits=32)
    split_opt.load_state_dict(fp32_opt.state_dict())
    for p in split.lin.parameters():  # no correction saved: zero, the master is the loaded bf16 value
        assert not split_opt.state[p]["master_correction"].any()
        assert same_bits(split_opt.master_weight(p), p.detach().float())
    # the fp32 weights come from the model's state dict, after the optimizer state
    fusedopt.load_master_state_dict(split, split_opt, fp32.state_dict())
    for p, q in zip(fp32.parameters(), split.parameters()):
        assert same_bits(split_opt.master_weight(q), p.detach())
        assert split_opt.state[q]["step"].item() == 2


def test_checkpoint_correction_conversion():
    model = Net(torch.bfloat16)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=32, master_weight_bits=24)
    train(model, opt, 2, seed=5)
    masters = [opt.master_weight(p) for p in model.parameters()]
    saved = opt.state_dict()
    weight = opt.position(model.lin.weight)[1]

    def edited(bits, **entries):
        sd = copy.deepcopy(saved)
        for group in sd["param_groups"]:
            group["master_weight_bits"] = bits
        sd["state"][weight].update(entries)
        return sd

    # 24 -> 32: int8 widens to int16 exactly
    opt.load_state_dict(edited(32))
    assert opt.state[model.lin.weight]["master_correction"].dtype == torch.int16
    assert all(same_bits(opt.master_weight(p), m) for p, m in zip(model.parameters(), masters))
    # ... and back: int16 multiples of 256 narrow exactly
    wide = opt.state_dict()
    for group in wide["param_groups"]:
        group["master_weight_bits"] = 24
    opt.load_state_dict(wide)
    assert same_bits(opt.state[model.lin.weight]["master_correction"], saved["state"][weight]["master_correction"])

    before = {k: v.clone() for k, v in opt.state[model.lin.weight].items()}
    odd = saved["state"][weight]["master_correction"].to(torch.int16) * 256 + 1
    bad = [
        (edited(24, master_correction=odd), "cannot be narrowed"),  # 32 -> 24 would lose bits
        (edited(None), "master_weight_bits=None"),  # dropping a non-zero correction
        (edited(24, master_correction=odd.float()), "int8 or int16"),
        (edited(24, master_correction=odd[:, :5].to(torch.int8)), "int8 or int16"),
    ]
    for sd, message in bad:
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(sd)
    assert all(same_bits(opt.state[model.lin.weight][k], v) for k, v in before.items())  # all-or-nothing

    # an all-zero correction drops losslessly; a non-zero one on an fp32 parameter is refused
    zero = {
        i: {**s, "master_correction": torch.zeros_like(s["master_correction"])}
        for i, s in saved["state"].items()
        if "master_correction" in s
    }
    sd = copy.deepcopy(saved)
    sd["param_groups"][0]["master_weight_bits"] = None
    sd["state"].update(zero)
    opt.load_state_dict(sd)
    assert "master_correction" not in opt.state[model.lin.weight]
    fp32 = Net(torch.float32)
    with pytest.raises(ValueError, match="fp32 parameters are their own master"):
        fusedopt.AdamW(fp32.parameters(), state_bits=32).load_state_dict(saved)


@pytest.mark.parametrize("algo", algorithm_cases())
def test_gradient_release_matches_step_with_split_masters(algo):
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = Net(torch.bfloat16)
        for p in model.lin.parameters():
            p.data = p.data.half()
        groups = [
            {"params": list(model.conv.parameters()) + list(model.norm.parameters()), "master_weight_bits": 24},
            {"params": list(model.lin.parameters()), "master_weight_bits": 32},
        ]
        opt = algo.make(groups, lr=1e-2, weight_decay=0.1, state_bits=32, fused=fused, seed=9)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            model(torch.randn(4, 2, 9, generator=gen)).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    (model, opt), (fmodel, fopt) = runs
    assert fopt.state[fmodel.lin.weight]["master_correction"].dtype == torch.int16
    assert fopt.state[fmodel.conv.weight]["master_correction"].dtype == torch.int8
    for p, q in zip(model.parameters(), fmodel.parameters()):
        assert same_bits(q.detach(), p.detach())
        assert same_bits(fopt.master_weight(q), opt.master_weight(p))
        assert not torch.equal(fopt.master_weight(q), q.detach().float()) or q.dtype == torch.float32
