"""The fused kernel's branch for the paired low-bit format ``norm2-root4`` (``kernels/rootgrid.py``,
``kernels/normalised.py``) against the PyTorch reference.

On the CPU the kernel runs in Triton's interpreter (conftest.py), where it repeats the reference's
operations in the reference's order, so every stored bit must agree: parameters, master
corrections, codes, scales, step counts. On a GPU this file runs the compiled kernel with IEEE
arithmetic (``update.APPROXIMATE_DENOMINATOR`` off) and asserts the same;
``tests/gpu/test_state_formats_on_cuda.py`` holds CUDA, approximate as it runs, to the CPU reference
with the bounds of a compiled kernel.
"""

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from helpers import launch_constexprs, step_with

import fusedopt
from fusedopt.codecs import PAIRED_FORMATS, codec_named
from fusedopt.codecs.normalised import block_rms
from fusedopt.codecs.rootgrid import TOP, RootGridCodec, root_decay
from fusedopt.kernels import hashing, moments, normalised, rootgrid, update

# The interpreter computes every lane, masked or not (a 0 / 0 in a lane whose result is discarded):
# numpy warns about those.
pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def _ieee_on_a_gpu(monkeypatch):
    """The GPU's approximate square root and divisions move bits; the interpreter computes them exactly."""
    if torch.cuda.is_available():
        monkeypatch.setattr(update, "APPROXIMATE_DENOMINATOR", False)


PAIRED = list(PAIRED_FORMATS)
# 15 elements: less than one block of every codec; 1517: several blocks over two programs, the last
# block of each codec partial; 1024: whole blocks, one program
SHAPES = [(3, 5), (37, 41), (4, 256)]


def _gradient(shape, step, gen):
    """Step 0: magnitudes within a factor 2 on every other element (v's grids span a few binades, below
    the widest spacing). Step 1: only the other elements, half the smallest of step 0 in the second
    half of the rows (between their grids' two lowest levels: rounded on the kept grids) and a
    thousandth of it in the first half (below the bottom levels: refitted); the elements of step 0 keep
    their codes. Step 2: Gaussian and a thousand times larger (above the tops: refitted at the widest
    spacing), but the second half of the rows (codes kept, tops decayed). Later steps: Gaussian."""
    sign = torch.randn(shape, generator=gen).sign()
    odd = (torch.arange(sign.numel()) % 2 == 1).view(shape)
    if step == 0:
        return torch.where(odd, 0.0, torch.empty(shape).uniform_(0.5, 1.0, generator=gen) * sign * 1e-3)
    if step == 1:
        second_half = (torch.arange(shape[0]) >= shape[0] // 2)[:, None]
        return torch.where(odd, sign * torch.where(second_half, 0.5e-3, 0.5e-6), 0.0)
    g = torch.randn(shape, generator=gen)
    if step == 2:
        g[shape[0] // 2 :] = 0.0
    return g


def _gradients(shapes, steps, seed):
    """Per step, a gradient per shape (``_gradient``)."""
    gen = torch.Generator().manual_seed(seed)
    return [[_gradient(s, i, gen) for s in shapes] for i in range(steps)]


def _train(backend, device, monkeypatch, fmt, shapes, *, dtype=torch.float32, master=None, fused=False,
           steps=4, algo=fusedopt.AdamW, firsts=None, grads=None, seed=0, **kwargs):  # fmt: skip
    """Parameters of ``shapes`` after ``steps`` updates; the reference runs on the CPU, where its
    arithmetic is defined. Returns (parameters, states, the optimizer)."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    device = "cpu" if backend == "reference" else device
    gen = torch.Generator().manual_seed(seed + 1)
    ws = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in shapes]
    opt = algo(ws, lr=1e-2, state_format=fmt, min_compress_numel=0, master_weight_bits=master, fused=fused, **kwargs)
    if firsts is not None:
        offsets = dict(zip(ws, firsts))
        opt.element_offset = lambda p: offsets[p]  # as a shard's offset in its parameter
    for step_grads in grads or _gradients(shapes, steps, seed):
        step_with(opt, ws, [g.to(device=device, dtype=dtype) for g in step_grads], fused)
    states = [{k: v.cpu() for k, v in opt.state[w].items()} for w in ws]
    return [w.detach().cpu() for w in ws], states, opt


def _assert_identical(ref, got):
    """Parameters and every state tensor bit for bit; the moments hold something (parity of two paths
    that both kept zeros proves nothing)."""
    (ref_ws, ref_states, _), (got_ws, got_states, _) = ref, got
    for r, g in zip(ref_ws, got_ws):
        assert r.dtype == g.dtype and torch.equal(r, g)
    for r, g in zip(ref_states, got_states):
        assert r.keys() == g.keys()
        for key in r:
            assert r[key].dtype == g[key].dtype and torch.equal(r[key], g[key]), key
        assert r["exp_avg.codes"].any() and r["exp_avg.scales"].any()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", PAIRED)
def test_the_kernel_stores_the_references_bits(monkeypatch, device, fmt, shape):
    ref = _train("reference", device, monkeypatch, fmt, [shape])
    got = _train("triton", device, monkeypatch, fmt, [shape])
    assert ref[1][0]["exp_avg_sq.codes"].any() and ref[1][0]["exp_avg_sq.scales"].any()
    _assert_identical(ref, got)


@pytest.mark.parametrize("tile", [(256, 2), (512, 2), (2048, 4), (2048, 8), (4096, 8)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_any_tile_of_whole_blocks_stores_the_references_bits(monkeypatch, device, tile):
    """The update's tile for these formats (``update.ROOT_GRID_TILE``) is a speed choice: programs of
    two to thirty-two root-grid blocks, the last one partial, store the reference's bits (bf16 weights, a
    24-bit master, so the parameter's own draws are tiled too)."""
    monkeypatch.setattr(update, "ROOT_GRID_TILE", tile)
    shape = (37, 41)
    ref = _train("reference", device, monkeypatch, PAIRED[0], [shape], dtype=torch.bfloat16, master=24)
    got = _train("triton", device, monkeypatch, PAIRED[0], [shape], dtype=torch.bfloat16, master=24)
    assert got[2]._dispatch._prepared[next(iter(got[2]._dispatch._prepared))].launch.programs == -(-1517 // tile[0])
    _assert_identical(ref, got)


CASES = [
    pytest.param(fmt, dtype, master, fused, id=f"{fmt}-{str(dtype)[6:]}-{master}-{mode}")
    for fmt in PAIRED
    for dtype in (torch.bfloat16, torch.float16)
    for master in (24, None)
    for fused, mode in ((False, "step"), (True, "release"))
]


@pytest.mark.parametrize("fmt,dtype,master,fused", CASES)
def test_low_precision_parameters_corrections_and_release(monkeypatch, device, fmt, dtype, master, fused):
    """bf16 / fp16 parameters with an 8-bit correction or none, updated in step() or in the gradient
    hooks: the same parameters, corrections and state as the reference's."""
    shapes = [(29, 67)]
    ref = _train("reference", device, monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    got = _train("triton", device, monkeypatch, fmt, shapes, dtype=dtype, master=master, fused=fused)
    assert ("master_correction" in got[1][0]) == (master is not None)
    assert not torch.equal(ref[0][0], torch.randn(shapes[0], generator=torch.Generator().manual_seed(1)).to(dtype))
    _assert_identical(ref, got)


@pytest.mark.parametrize("fmt", PAIRED)
def test_buckets_and_shards(monkeypatch, device, fmt):
    """Parameters launched as buckets from the second step (sizes a bucket takes, and one it does not),
    and as shards at global offsets (draws from the global index; past 2**31, or not a multiple of the
    tile's row: 64-bit offsets, launched alone)."""
    shapes = [(32, 48), (8, 50), (37, 41), (16, 16)]
    base = _train("reference", device, monkeypatch, fmt, shapes, steps=3)
    for firsts, fused, bucketed in (
        ((0, 0, 0, 0), True, 3),
        ((256, 512, 0, 2**31 + 256), False, 2),
        ((64, 37, 300, 2**33), False, 0),  # tile rows off the blocks' alignment: 64-bit offsets, alone
    ):
        ref = _train("reference", device, monkeypatch, fmt, shapes, steps=3, firsts=firsts, fused=fused)
        if any(firsts):
            assert not all(torch.equal(a[k], b[k]) for a, b in zip(ref[1], base[1]) for k in a), "offsets unused"
        got = _train("triton", device, monkeypatch, fmt, shapes, steps=3, firsts=firsts, fused=fused)
        built = [len(b.members) for b in got[2]._dispatch._built.values()]
        assert max(built, default=0) == bucketed, (firsts, built)
        _assert_identical(ref, got)


@pytest.mark.parametrize("fmt", PAIRED)
def test_a_non_finite_gradient_leaves_everything_untouched(monkeypatch, device, fmt):
    shape = (40, 80)
    good = _gradients([shape], 3, 5)  # step 2's gradient leaves every grid: its blocks would be refitted
    bad, worse = good[2][0].clone(), good[2][0].clone()
    bad[39, 79] = float("nan")  # in the last program's last block
    worse[0, 0] = float("-inf")
    sequence = [good[0], [bad], [worse], good[2]]
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    w = torch.nn.Parameter(torch.randn(shape).to(device))
    opt = fusedopt.AdamW([w], lr=1e-2, state_format=fmt, min_compress_numel=0, master_weight_bits=None)
    w.grad = good[0][0].to(device)
    opt.step()
    snapshot = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    for g in (bad, worse):
        w.grad = g.to(device)
        opt.step()
        assert torch.equal(w, snapshot[0])
        for key, value in snapshot[1].items():
            assert torch.equal(opt.state[w][key], value), key
    assert int(opt.num_skipped_updates) == 2
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ref = _train("reference", device, monkeypatch, fmt, [shape], grads=sequence)
    got = _train("triton", device, monkeypatch, fmt, [shape], grads=sequence)
    assert float(got[1][0]["step"]) == 2 and not torch.equal(got[0][0], w0)
    _assert_identical(ref, got)


def test_the_kernel_refuses_layouts_it_has_no_branch_for():
    """What the branch needs, named: the root grid as the second moment with its EMA decay, normalised
    codes framed by it, blocks that divide the tile's row."""
    shape = torch.Size([64, 64])
    norm, root, block4 = (
        codec_named("norm2", True, shape),
        codec_named("root4", False, shape),
        codec_named("block4", True, shape),
    )
    AdamW = fusedopt.AdamW
    decays = {"exp_avg": 0.9, "exp_avg_sq": 0.999}
    frames = {"exp_avg": "exp_avg_sq"}

    def reason(codecs, decays=decays, frames=frames):
        return update.unsupported(AdamW, SimpleNamespace(codecs=codecs, decays=decays, frames=frames))

    assert reason({"exp_avg": norm, "exp_avg_sq": root}) is None
    assert "needs the EMA decay of 'exp_avg_sq'" in reason({"exp_avg": norm, "exp_avg_sq": root}, decays={})
    assert "only as the second moment" in reason({"exp_avg_sq": root, "exp_avg": block4}, frames={})
    assert "in units of a root-grid second moment" in reason({"exp_avg": norm, "exp_avg_sq": root}, frames={})
    assert "in units of a root-grid second moment" in reason({"exp_avg": norm, "exp_avg_sq": block4})
    with pytest.raises(ValueError, match="one quantisation block size"):
        update._tile_row(block4.kernel_format, root.kernel_format)
    assert update._tile_row(norm.kernel_format, root.kernel_format) == 128


def test_the_approximate_root_grid_branch_stores_the_references_bits(monkeypatch, device):
    """``update.APPROXIMATE_ROOT_GRID``'s branch (a root and divisions a GPU approximates, the units still the
    IEEE root of a block's largest moment) computes exactly in the interpreter: the reference's bits there."""
    monkeypatch.setattr(update, "APPROXIMATE_ROOT_GRID", True)
    shapes = [(37, 41), (4, 256)]
    ref = _train("reference", device, monkeypatch, PAIRED[0], shapes, dtype=torch.bfloat16, master=24)
    got = _train("triton", device, monkeypatch, PAIRED[0], shapes, dtype=torch.bfloat16, master=24)
    flags = {c["IEEE_DENOMINATOR"] for c in launch_constexprs(got[2])}
    assert flags == {torch.cuda.is_available()}  # a GPU runs this file with IEEE arithmetic
    _assert_identical(ref, got)


@triton.jit
def _shared_word_fields_kernel(words_ptr, moment_ptr, param_ptr, PARAM_BITS: tl.constexpr, N: tl.constexpr):
    words = tl.load(words_ptr + tl.arange(0, N)).to(tl.uint32)
    moment, param = hashing.shared_word_fields(words, PARAM_BITS)
    tl.store(moment_ptr + tl.arange(0, N), moment.to(tl.int64))
    tl.store(param_ptr + tl.arange(0, N), param.to(tl.int64))


@pytest.mark.parametrize("master,bits", [(24, 8), (None, 16)])
def test_the_kernels_split_of_the_shared_word_is_the_references(device, master, bits):
    """``hashing.shared_word_fields`` against ``rng.UpdateDraws`` beside a whole-word first moment: the moment's
    word and the bf16 parameter's field (the int8 correction's 8 bits, or without a correction 16)."""
    p = torch.zeros(4, 256, dtype=torch.bfloat16)
    ups = fusedopt.rng.UpdateDraws(5, 2, torch.tensor(3.0), p, master, first_moment_whole=True)
    words = ups.shared().reshape(-1)
    moment, param = torch.empty_like(words, device=device), torch.empty_like(words, device=device)
    _shared_word_fields_kernel[(1,)](words.to(device), moment, param, PARAM_BITS=bits, N=words.numel())
    assert torch.equal(moment.cpu() & fusedopt.rng.MASK32, ups.moment(0, whole=True)().reshape(-1))
    assert torch.equal(param.cpu() & fusedopt.rng.MASK32, ups.param()().reshape(-1))


@triton.jit
def _thirds_and_reciprocals_kernel(x_ptr, third_ptr, reciprocal_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(third_ptr + tl.arange(0, N), normalised.third(x))
    tl.store(reciprocal_ptr + tl.arange(0, N), moments.reciprocal_rn(x))


def test_the_kernels_thirds_and_reciprocals_are_ieee(device):
    """``normalised.third`` (a product and an fma's correction) and ``moments.reciprocal_rn`` on every bf16
    value: the correctly rounded ``x / 3`` of every finite one (a block's scale is), ``1 / x`` of each and of
    fp32 values over the whole range (a root grid's units)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([x, torch.randint(0, 2**31 - 1, (2**16,), generator=gen, dtype=torch.int32).view(torch.float32)])
    third, reciprocal = torch.empty_like(x, device=device), torch.empty_like(x, device=device)
    _thirds_and_reciprocals_kernel[(1,)](x.to(device), third, reciprocal, N=x.numel(), enable_fp_fusion=False)
    finite = x.isfinite()
    assert torch.equal(third.cpu()[: 2**16][finite[: 2**16]], x[: 2**16][finite[: 2**16]] / 3)
    assert torch.equal(reciprocal.cpu().nan_to_num(), (1 / x).nan_to_num())


@triton.jit
def _rms_kernel(q_ptr, rms_ptr, R: tl.constexpr):
    rows = tl.arange(0, R)
    q = tl.load(q_ptr + rows[:, None] * 64 + tl.arange(0, 64)[None, :])
    tl.store(rms_ptr + rows, normalised.block_rms(q, R))


def test_the_kernels_block_rms_is_the_references(device):
    """A block's rms, a sum whose order matters: rows of alike magnitudes, and rows over 40 binades."""
    gen = torch.Generator().manual_seed(4)
    rows = 64
    q = torch.randn(rows, 64, generator=gen)
    q[::2] *= torch.exp2(torch.randint(-20, 20, (rows // 2, 64), generator=gen).float())
    rms = torch.empty(rows, device=device)
    _rms_kernel[(1,)](q.to(device), rms, R=rows, enable_fp_fusion=False)  # as update.py
    assert torch.equal(rms.cpu(), block_rms(q))


@triton.jit
def _roots_kernel(codes_ptr, units_ptr, out_ptr, R: tl.constexpr):
    at = tl.arange(0, R)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(out_ptr + at, rootgrid.roots(tl.load(codes_ptr + at), tl.load(units_ptr + tl.arange(0, R))))


def test_the_kernels_roots_below_2_63_are_zero_as_the_references(device):
    """Every code under units that put roots at 2**-63, an ulp either side of it, far below it (subnormal units) and
    far above: the kernel's roots (on a GPU zeroed by a multiply toward zero that flushes subnormals) are the
    reference's."""
    below = 2.0**-63 * (1 - 2.0**-24)  # code 1's root (its level is 1) one ulp below the bound
    units = torch.tensor([2.0**-63, below, 2.0**-63 * (1 + 2.0**-23), 2.0**-67, 2.0**-140, 0.0, 1.0, 2.0**50 / 36])
    codes = torch.arange(16, dtype=torch.int32).repeat(len(units), 8)
    expected = RootGridCodec.roots(codes, units)
    assert expected[0, 1] == 2.0**-63 and expected[1, 1] == 0 and expected[1, 2] > 0 and expected[4].max() == 0
    got = torch.empty(len(units), 128, device=device)
    _roots_kernel[(1,)](codes.to(device), units.to(device), got, R=len(units), enable_fp_fusion=False)
    assert torch.equal(got.cpu(), expected)


@triton.jit
def _root_store_kernel(x_ptr, draws_ptr, codes_ptr, units_ptr, n, decay, decay_root, EXACT: tl.constexpr,
                       R: tl.constexpr):  # fmt: skip
    at = tl.arange(0, R)[:, None] * 128 + tl.arange(0, 128)[None, :]
    codes, units, roots = rootgrid.load_root_grid(codes_ptr, units_ptr, 0, n, R)
    x, draws = tl.load(x_ptr + at), tl.load(draws_ptr + at)
    rootgrid.store_root_grid(x, tl.sqrt_rn(x), codes, units, roots * roots, decay, decay_root, draws, at, codes_ptr,
                             units_ptr, 0, n, 0, EXACT, R)  # fmt: skip


def _root_grid_case(huge: bool):
    """A previous root-grid state and a new moment that visit every branch of ``encode_decayed``: per
    block, elements without an increment, on a decayed level, an ulp either side, between levels, 0, above
    the decayed top (its block refitted), within fp32 rounding of the top, inf, NaN; blocks whose unit is 0,
    whose roots are around 2**-63, and (``huge``) whose decayed values exceed 2**100, where v saturates."""
    gen = torch.Generator().manual_seed(8)
    rows, decay = 16, 0.999
    codec = RootGridCodec(torch.Size([rows * 128]), "v")
    codes = torch.randint(0, 16, (rows, 128), generator=gen, dtype=torch.int32)
    units = (1 + torch.rand(rows, generator=gen)) * torch.exp2(torch.randint(-40, 40, (rows,), generator=gen).float())
    units[0], codes[0] = 0.0, 0  # a block that never had a value
    units[1] = 2.0**-63 / 16  # roots L * 2**-67: those of the levels below 16 are under 2**-63, decoded as 0
    if huge:
        units[2:4] = 2.0**50 / 36  # levels 44 and 52: v above 2**100
    previous = {".codes": codec.pack(codes), ".scales": units}
    kept = units * root_decay(decay)
    values = codec.decode(previous).view(rows, 128)
    x = values * decay  # no increment
    on = RootGridCodec.roots(torch.randint(0, 16, (rows, 128), generator=gen, dtype=torch.int32), kept) ** 2
    x[:, 32:48] = on[:, 32:48]
    x[:, 48:56] = torch.nextafter(on[:, 48:56], torch.tensor(float("inf")))
    x[:, 56:64] = torch.nextafter(on[:, 56:64], torch.tensor(0.0))
    x[:, 64:96] = (torch.rand(rows, 32, generator=gen) * TOP * kept.unsqueeze(1)) ** 2
    x[:, 96:100] = 0.0
    x[4:8, 100] = (TOP * kept[4:8] * (1 + 2.0**-22)) ** 2  # at the top, up to rounding
    x[8:12, 101] = (TOP * kept[8:12] * 1.5) ** 2  # above it: refitted
    x[12, 102] = float("inf")
    x[8, 102] = float("nan")  # counts as 0 (its block refitted)
    edge = kept[13:16] * (TOP * (1 + 2.0**-20))  # the fit's bound itself: those blocks keep their units
    x[13:16, 103] = edge**2
    assert torch.equal(x[13:16, 103].sqrt(), edge)
    if huge:
        x[2:4, 32:] = values[2:4, 32:] * decay  # no increment, v above 2**100
    words = torch.randint(0, 2**32, (rows * 128,), generator=gen, dtype=torch.int64)
    # the largest draw where t is at the top or just above it: code 16 unless t (or the code) is capped
    words.view(rows, 128)[4:8, 100] = words.view(rows, 128)[13:16, 103] = 2**32 - 1
    draws = (words >> 11).to(torch.int32).view(rows, 128)  # the top 21 bits of the whole words
    expected = codec.encode_decayed(x.reshape(-1), lambda: words, previous, decay)
    return codec, previous, x, draws, decay, expected


def _store_root_grid(device, codec, previous, x, draws, decay, exact):
    codes, units = previous[".codes"].clone().to(device), previous[".scales"].clone().to(device)
    n, rows = codec.numel, codec.blocks
    _root_store_kernel[(1,)](x.to(device), draws.to(device), codes, units, n, decay, root_decay(decay), EXACT=exact,
                             R=rows, enable_fp_fusion=False)  # fmt: skip
    return {".codes": codes.cpu(), ".scales": units.cpu()}


@pytest.mark.parametrize("exact", [pytest.param(True, id="exact-root"), pytest.param(False, id="units-from-moments")])
@pytest.mark.parametrize("huge", [pytest.param(False, id="in-range"), pytest.param(True, id="above-2**100")])
def test_the_kernels_root_grid_store_is_the_references(device, huge, exact):
    """``store_root_grid`` on its own against ``RootGridCodec.encode_decayed``: the same units and codes for
    every branch (kept codes, decayed and refitted units, saturation, units of 0, roots around 2**-63), with
    refitted units from the largest root or (as under an approximate root) from the largest moment."""
    codec, previous, x, draws, decay, expected = _root_grid_case(huge)
    refitted = expected[".scales"] != previous[".scales"] * root_decay(decay)
    assert refitted[0] and refitted[8:13].all() and not refitted[4:8].any() and refitted.float().mean() < 0.5
    got = _store_root_grid(device, codec, previous, x, draws, decay, exact)
    assert torch.equal(got[".scales"], expected[".scales"])
    assert torch.equal(got[".codes"], expected[".codes"])


def test_a_moment_above_the_saturation_keeps_parity(monkeypatch, device):
    """Gradients of 1e17 (v = 1e31, above the 2**100 where the codec saturates), then none: the kernel
    and the reference store the same moments (both compare the moment itself, not its saturation, with
    the decayed old value: an element without increment keeps its code)."""
    shape = (4, 128)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)).sign() * 1e17
    grads = [[g], [torch.zeros(shape)], [g * 1e-17]]
    ref = _train("reference", device, monkeypatch, "norm2-root4", [shape], grads=grads)
    got = _train("triton", device, monkeypatch, "norm2-root4", [shape], grads=grads)
    _assert_identical(ref, got)


@triton.jit
def _normalised_store_kernel(x_ptr, r_ptr, u_ptr, codes_ptr, scales_ptr, n, CLIP: tl.constexpr, R: tl.constexpr):
    at = tl.arange(0, R)[:, None] * 64 + tl.arange(0, 64)[None, :]
    x, r, u = tl.load(x_ptr + at), tl.load(r_ptr + at), tl.load(u_ptr + at)
    normalised.store_normalised(x, r, u, codes_ptr, scales_ptr, 0, n, 0, 2, CLIP, True, R)


def test_the_normalised_encode_multiplies_by_the_blocks_reciprocal(device):
    """The kernel rounds ``q * (1 / scale)`` as the reference does, not ``q / scale``: values placed where
    the two differ by an ulp and the element's draw lands between them take the reference's codes."""
    gen = torch.Generator().manual_seed(6)
    rows = 8
    n = rows * 64
    codec = codec_named("norm2", True, torch.Size([n]))
    top, ones = codec.top, torch.ones(n)  # 3 gaps; a frame of ones: the codes are q's own
    words = torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)
    u = fusedopt.rng.top_uniform(words).view(rows, 64)
    # 16 anchors of each block (|q| = a, its absmax and, with the others, within the cap) keep its scale
    # at a while the other 48 elements are placed relative to it; placing them moves the scale a little, so place,
    # re-take the scales (the clipped half-range rounded up to bf16) and repeat until they stay
    a = 1.5 * torch.exp2(torch.arange(-8, 8, 2).float()).unsqueeze(1)  # exact in bf16; its reciprocal is not
    anchors = torch.arange(64) < 16
    sign = torch.randn(rows, 64, generator=gen).sign()
    target = torch.randint(1, top, (rows, 64), generator=gen).float()

    def codes(q, reciprocal, u=u, unit=None):
        ratio = q * (1.0 / unit) if reciprocal else q / unit
        t = ((ratio + 1) * (top / 2)).clamp(0, top)
        return torch.floor(t + u).clamp(max=top)

    def place(unit):
        """For each element, the first of 4001 neighbouring values (in ulps) of a random level crossing
        where the division and the reciprocal round to different codes."""
        q0 = ((target - u) / (top / 2) - 1) * unit
        ulps = torch.arange(-2000, 2001, dtype=torch.int32)
        candidates = (q0.view(torch.int32).unsqueeze(-1) + ulps).view(torch.float32)
        u3, unit3 = u.unsqueeze(-1), unit.unsqueeze(-1)
        split = codes(candidates, True, u3, unit3) != codes(candidates, False, u3, unit3)
        first = torch.where(split.any(-1), split.int().argmax(-1), 2000)
        q = candidates.gather(-1, first.unsqueeze(-1)).squeeze(-1)
        return torch.where(anchors, sign * a, q)

    unit = a
    for _ in range(20):
        q = place(unit)
        unit, previous = codec.encode(q.reshape(-1), lambda: words, frame=ones)[".scales"].float().unsqueeze(1), unit
        if torch.equal(unit, previous):
            break
    assert torch.equal(unit, previous) and torch.equal(unit, a)  # the scales held, at the anchors
    assert (codes(q, True, unit=unit) != codes(q, False, unit=unit)).sum() > n // 8  # the test can tell them apart

    expected = codec.encode(q.reshape(-1), lambda: words, frame=ones)
    assert torch.equal(expected[".scales"].float(), unit.squeeze(1))
    got_codes = torch.empty_like(expected[".codes"], device=device)
    got_scales = torch.empty_like(expected[".scales"], device=device)
    x, r, uu = (t.to(device).contiguous() for t in (q, torch.ones(rows, 64), u))
    clip = codec.kernel_format.clip
    _normalised_store_kernel[(1,)](x, r, uu, got_codes, got_scales, n, CLIP=clip, R=rows, enable_fp_fusion=False)
    assert torch.equal(got_scales.cpu(), expected[".scales"])
    assert torch.equal(got_codes.cpu(), expected[".codes"])
