"""Checkpoint state no encoder writes is refused, and a refused load leaves the optimizer as it was.

Each case trains an optimizer two steps, corrupts one entry of its last parameter's saved state and loads
that into an optimizer which has stepped on its own (other hyperparameters, seed and state): the error
names the parameter, the slot and the problem, and the optimizer's state, step counts, groups and
parameters stay bit for bit as they were (the parameters before the corrupt one, converted first, are not
committed either), and its next step is that of a twin that never saw the load.
"""

import copy
import functools

import pytest
import torch
from cases import ALGORITHM, DTYPE_IDS
from helpers import moment_draws, random_steps, second_moment

import fusedopt
from fusedopt.codecs import codec_named
from fusedopt.codecs.base import value_problems

SHAPES = ((64, 96), (96,), (64, 96))  # 2-D weights compressed under the default min_compress_numel
CORRUPT = len(SHAPES) - 1  # the parameter whose state is corrupted: the last one
NAN, INF = float("nan"), float("inf")

# How a state format keeps a moment: one value per element ("plain": fp32, bf16), or codes and scales.
PLAIN_FORMATS = {"state32": {"state_bits": 32}, "state16": {"state_bits": 16}}
BLOCK_FORMATS = {"state8": {"state_bits": 8}, "state4": {"state_bits": 4}}
# Entries to corrupt, per algorithm: (slot, storage suffix, value, the problem the error names).
PLAIN_CORRUPTIONS = {
    "adamw": [
        ("exp_avg", "", NAN, "1 of its 6144 values are NaN"),
        ("exp_avg", "", INF, "1 of its 6144 values are infinite"),
        ("exp_avg", "", -INF, "1 of its 6144 values are infinite"),
        ("exp_avg_sq", "", -1e-3, "1 of its 6144 values are negative, in a moment that is never negative"),
        ("exp_avg_sq", "", -INF, "1 of its 6144 values are negative"),
        ("exp_avg_sq", "", NAN, "1 of its 6144 values are NaN"),
    ],
    "sgd-momentum": [
        ("momentum_buffer", "", NAN, "values are NaN"),
        ("momentum_buffer", "", -INF, "values are infinite"),
    ],
    "lion": [("exp_avg", "", INF, "values are infinite"), ("exp_avg", "", NAN, "values are NaN")],
    # the factored statistics are fp32 whatever the format; the first moment is in the format
    "adafactor": [
        ("exp_avg", "", -INF, "values are infinite"),
        ("row_var", "", -1.0, "1 of its 64 values are negative"),
        ("col_var", "", NAN, "1 of its 96 values are NaN"),
    ],
}
SCALES_OUTSIDE = "block scales are outside"
BLOCK_CORRUPTIONS = {
    "adamw": [("exp_avg", ".scales", 255, SCALES_OUTSIDE), ("exp_avg_sq", ".scales", 0, SCALES_OUTSIDE)],
    "sgd-momentum": [("momentum_buffer", ".scales", 0, SCALES_OUTSIDE)],
    "lion": [("exp_avg", ".scales", 255, SCALES_OUTSIDE)],
    "adafactor": [("exp_avg", ".scales", 255, SCALES_OUTSIDE), ("col_var", "", -INF, "values are negative")],
}
SCALES_BAD = "block scales are negative or not finite"
NORM2_ROOT4_CORRUPTIONS = [
    ("exp_avg", ".scales", NAN, SCALES_BAD),
    ("exp_avg", ".scales", -1.0, SCALES_BAD),
    ("exp_avg", ".scales", 2.0**61, "block scales are above the largest an encode writes"),
    ("exp_avg_sq", ".scales", INF, SCALES_BAD),
    ("exp_avg_sq", ".scales", -1.0, SCALES_BAD),
    ("exp_avg_sq", ".scales", 1e30, "block units are above the largest an encode writes"),
]


def _cases() -> list:
    out = []
    for formats, corruptions in ((PLAIN_FORMATS, PLAIN_CORRUPTIONS), (BLOCK_FORMATS, BLOCK_CORRUPTIONS)):
        for fmt_id in formats:
            for algo, entries in corruptions.items():
                for slot, suffix, value, problem in entries:
                    case = (algo, fmt_id, slot, suffix, value, problem)
                    out.append(pytest.param(*case, id=f"{algo}-{fmt_id}-{slot}{suffix}={value}"))
    for slot, suffix, value, problem in NORM2_ROOT4_CORRUPTIONS:
        case = ("adamw", "norm2-root4", slot, suffix, value, problem)
        out.append(pytest.param(*case, id=f"adamw-norm2-root4-{slot}{suffix}={value}"))
    return out


def _format(fmt_id: str) -> dict:
    if fmt_id == "norm2-root4":
        return {"state_format": fmt_id}
    return {**PLAIN_FORMATS, **BLOCK_FORMATS}[fmt_id]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in SHAPES]


TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd-momentum": functools.partial(torch.optim.SGD, momentum=0.9)}


@functools.cache
def _trained(algo: str, options: tuple, dtype: torch.dtype, torch_optim: bool) -> dict:
    params = _params(dtype)
    if torch_optim:
        opt = TORCH_OPTIMIZERS[algo](params, lr=1e-3)
    else:
        opt = ALGORITHM[algo].make(params, lr=1e-3, **dict(options))
    random_steps(opt, params, 2, seed=1)
    return copy.deepcopy(opt.state_dict())


def _checkpoint(algo: str, dtype: torch.dtype, *, torch_optim: bool = False, **options) -> dict:
    """The state dict of the case's fusedopt optimizer (or of torch.optim's counterpart) after two steps,
    a copy of its own to corrupt."""
    return copy.deepcopy(_trained(algo, tuple(sorted(options.items())), dtype, torch_optim))


def _stepped_target(algo: str, dtype: torch.dtype, **options):
    """An optimizer of its own (other lr and seed than the checkpoint's), one step in: what a refused
    load must leave as it is."""
    params = _params(dtype)
    opt = ALGORITHM[algo].make(params, lr=2e-3, seed=3, **options)
    random_steps(opt, params, 1, seed=2)
    return opt, params


def _differences(a, b, path: str = "") -> list[str]:
    """Where two state dicts differ: tensors by dtype, shape and bits, containers entry by entry."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return [] if same and torch.equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys"]
        return [d for key in a for d in _differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def _assert_refused_and_intact(target, saved: dict, match: str):
    """``opt.load_state_dict(saved)`` raises a ValueError matching ``match`` and leaves the optimizer and
    its parameters bit for bit as they were; its next step is that of a twin that never saw the load
    (``target()``: a new optimizer and its parameters, the same each call). Returns them."""
    opt, params = target()
    twin, twin_params = target()
    before = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert not _differences(opt.state_dict(), before)
    for p, value in zip(params, values):
        assert torch.equal(p.detach(), value)
    random_steps(opt, params, 1, seed=4)
    random_steps(twin, twin_params, 1, seed=4)
    assert not _differences(opt.state_dict(), twin.state_dict())
    for p, q in zip(params, twin_params):
        assert torch.equal(p.detach(), q.detach()) and torch.isfinite(p).all()
    return opt, params


def _corrupt(entry: dict, key: str, value) -> None:
    entry[key].view(-1)[7] = value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("into", ["same", "converted"])
@pytest.mark.parametrize("algo,fmt_id,slot,suffix,value,problem", _cases())
def test_a_corrupt_moment_is_refused_and_leaves_the_optimizer_as_it_was(
    algo, fmt_id, slot, suffix, value, problem, into, dtype
):
    """Copied as it is ("same": the loading optimizer keeps the saved format) or decoded to be re-encoded
    ("converted": the saved groups lose their format options, so the loading optimizer's own apply)."""
    fmt = _format(fmt_id)
    saved = _checkpoint(algo, dtype, **fmt)
    name = saved["fusedopt"]["codecs"][CORRUPT][slot]
    _corrupt(saved["state"][CORRUPT], slot + suffix, value)
    target_format = fmt
    if into == "converted":
        for group in saved["param_groups"]:
            del group["state_bits"], group["state_format"]
        target_format = {"state_bits": 8 if fmt.get("state_bits") == 32 else 32}
    target = functools.partial(_stepped_target, algo, dtype, **target_format)
    match = rf"state '{slot}' of parameter {CORRUPT} \(shape \(64, 96\)\) \({name}\) is corrupt: .*{problem}"
    opt, params = _assert_refused_and_intact(target, saved, match)
    if into == "converted" and not name.startswith("fp32-"):  # (the factored statistics are fp32 in both)
        assert opt.codecs(params[CORRUPT], opt.param_groups[0])[slot].name != name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize(
    "algo,slot,value,problem",
    [
        ("adamw", "exp_avg_sq", -1e-3, "1 of its 6144 values are negative"),
        ("adamw", "exp_avg_sq", NAN, "1 of its 6144 values are NaN"),
        ("adamw", "exp_avg", INF, "1 of its 6144 values are infinite"),
        ("sgd-momentum", "momentum_buffer", NAN, "1 of its 6144 values are NaN"),
    ],
)
def test_a_torch_optim_checkpoint_with_a_corrupt_moment_is_refused(algo, slot, value, problem, state_bits, dtype):
    """torch.optim's plain tensors (in the parameters' dtype): copied (fp32 into fp32) or converted."""
    saved = _checkpoint(algo, dtype, torch_optim=True)
    _corrupt(saved["state"][CORRUPT], slot, value)
    target = functools.partial(_stepped_target, algo, dtype, state_bits=state_bits)
    match = rf"state '{slot}' of parameter {CORRUPT} \(shape \(64, 96\)\) \(\w+\) is corrupt: {problem}"
    _assert_refused_and_intact(target, saved, match)


@pytest.mark.filterwarnings("ignore:checkpoint state was converted")  # torch.optim's fp32 into bf16 state
@pytest.mark.parametrize("state_bits", [32, 16])
@pytest.mark.parametrize("source", ["fusedopt", "torch"])
def test_an_overflowed_second_moment_is_not_corrupt(source, state_bits):
    """A finite gradient whose square overflows makes an fp32 / bf16 second moment +inf (the update of
    that element is then 0): fusedopt and torch.optim save it so, and it loads and steps on."""
    params = _params(torch.float32)
    make = torch.optim.AdamW if source == "torch" else functools.partial(fusedopt.AdamW, state_bits=state_bits)
    opt = make(params, lr=1e-3)
    random_steps(opt, params, 1, seed=1)
    params[CORRUPT].grad = torch.full(SHAPES[CORRUPT], 1e22)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert torch.isinf(saved["state"][CORRUPT]["exp_avg_sq"]).all()
    other = fusedopt.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3, state_bits=state_bits)
    other.load_state_dict(saved)
    loaded = other.state_dict()["state"][CORRUPT]["exp_avg_sq"]
    assert torch.isinf(loaded).all() and torch.isfinite(other.state_dict()["state"][CORRUPT]["exp_avg"]).all()
    other_params = [p for g in other.param_groups for p in g["params"]]
    random_steps(other, other_params, 1, seed=2)
    assert all(torch.isfinite(p).all() for p in other_params)


def test_a_moment_decoded_against_a_frame_of_another_format_is_refused():
    """A norm2 first moment is stored in units of its frame's root. Its storage and a bf16 frame with an
    infinite value are each what some encode writes, but decoded together the moment is infinite: no
    fusedopt optimizer pairs them, and converting it would carry that into the weights."""
    saved = _checkpoint("adamw", torch.float32, state_format="norm2-root4")
    entry = saved["state"][CORRUPT]
    root4 = codec_named("root4", False, torch.Size(SHAPES[CORRUPT]))
    frame = root4.decode({s: entry.pop("exp_avg_sq" + s) for s in root4.suffixes}).to(torch.bfloat16)
    frame.view(-1)[7] = INF
    entry["exp_avg_sq"] = frame
    saved["fusedopt"]["codecs"][CORRUPT]["exp_avg_sq"] = "bf16"
    for group in saved["param_groups"]:
        del group["state_bits"], group["state_format"]
    target = functools.partial(_stepped_target, "adamw", torch.float32, state_bits=32)
    match = rf"state 'exp_avg' of parameter {CORRUPT} .* \(norm2\) is corrupt: decoded, 1 of its 6144 values are"
    _assert_refused_and_intact(target, saved, match)


@pytest.mark.parametrize("split", [False, True], ids=["whole-block", "one-element"])
def test_element_wise_scales_no_encode_writes_are_refused(split):
    """A sharded parameter's block8 moments are saved one code and one scale per element. A scale byte no
    encode writes is refused whether the loading blocks share one scale (rebuilt as they were) or not
    (each element decoded on its own scale, which would hide the byte in a plain value)."""
    saved = _checkpoint("adamw", torch.float32, state_bits=8)
    entry = saved["state"][CORRUPT]
    names = saved["fusedopt"]["codecs"][CORRUPT]
    codec = codec_named(names["exp_avg"], True, torch.Size(SHAPES[CORRUPT]))
    for slot in names:
        scales = entry.pop(slot + ".scales").repeat_interleave(codec.block)
        entry[slot + ".element_scales"] = scales.reshape(SHAPES[CORRUPT])
        entry[slot + ".element_codes"] = entry.pop(slot + ".codes")
    entry["fusedopt"] = {"codecs": names, "layout": "elementwise"}
    element_scales = entry["exp_avg.element_scales"].view(-1)
    written = element_scales.clone()
    element_scales[32 : 32 + (1 if split else codec.block)] = 255
    target = functools.partial(_stepped_target, "adamw", torch.float32, state_bits=8)
    match = rf"state 'exp_avg' of parameter {CORRUPT} .* \(block8\) is corrupt: 1 of its \d+ {SCALES_OUTSIDE}"
    opt, params = _assert_refused_and_intact(target, saved, match)
    element_scales.copy_(written)
    opt.load_state_dict(saved)  # the same layout with the scales an encode wrote loads
    assert torch.equal(opt.state[params[CORRUPT]]["exp_avg.scales"], written[:: codec.block])


@pytest.mark.parametrize("step", [NAN, INF, -1.0])
def test_a_non_finite_or_negative_step_is_refused(step):
    saved = _checkpoint("adamw", torch.bfloat16, state_bits=8)
    saved["state"][CORRUPT]["step"] = torch.tensor(step)
    target = functools.partial(_stepped_target, "adamw", torch.bfloat16, state_bits=8)
    _assert_refused_and_intact(target, saved, rf"state of parameter {CORRUPT} .* has an invalid step count")


def test_a_floating_point_master_correction_is_refused():
    """A correction is an integer count of steps below the bf16 value, always finite; a float tensor in
    its place (a NaN one here) is no correction fusedopt writes."""
    saved = _checkpoint("adamw", torch.bfloat16, state_bits=8)
    saved["state"][CORRUPT]["master_correction"] = torch.full(SHAPES[CORRUPT], NAN)
    target = functools.partial(_stepped_target, "adamw", torch.bfloat16, state_bits=8)
    match = rf"master_correction of parameter {CORRUPT} .* must be an int8 or int16 tensor"
    _assert_refused_and_intact(target, saved, match)


def _extremes(signed: bool, saturating: bool = False) -> torch.Tensor:
    """Moments at the edges of what an update writes: zeros, subnormals, the largest values bf16 holds
    (fp32's, less its last bf16 step, which stochastic rounding may take to inf), and for a nonnegative
    moment +inf (an overflowed second moment). ``saturating``: NaN and infinities too, which formats of
    codes and scales saturate."""
    x = second_moment(SHAPES[0], seed=5)
    flat = x.view(-1)
    flat[:200] = 0.0
    flat[200:400] = 1e-44
    flat[400:600] = torch.finfo(torch.bfloat16).max
    if not signed:
        flat[600:610] = INF
    if saturating:
        flat[610:620], flat[620:630] = NAN, INF
    if signed:
        x = torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(6)) < 0.5, -x, x)
    return x


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "block8", "block4", "norm2-root4"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "nonnegative"])
def test_what_every_encode_writes_passes(fmt, signed):
    """The checks refuse nothing an encode writes, from the edges of the range (for block formats, from
    inf and NaN too, which they saturate)."""
    shape = torch.Size(SHAPES[0])
    codec = codec_named(fmt, signed, shape)
    frame_codec = codec_named(fmt, False, shape)
    bits = moment_draws(7, 1, shape)
    inputs = [_extremes(signed)]
    if codec.suffixes != ("",):
        inputs.append(_extremes(signed, saturating=True))
    for x in inputs:
        frame = {}
        if codec.frame:
            v = frame_codec.encode(_extremes(False, saturating=True), bits)
            assert frame_codec.invalid(v, signed=False) is None
            frame = {"frame": frame_codec.decode(v)}
        stored = codec.encode(x, bits, **frame)
        assert codec.invalid(stored, signed=signed) is None
        assert not value_problems(codec.decode(stored, **frame), signed)
        if not signed:  # an EMA's update keeps the decay exact on the scale where the format can
            again = codec.encode_decayed(x * 0.999, bits, stored, 0.999)
            assert codec.invalid(again, signed=signed) is None


@pytest.mark.parametrize(
    "corrupt",
    [("known", -1.0), ("known", float("nan")), ("norm_sq", float("inf")), ("norm_sq", -2.0), ("last_total", -1.0)],
    ids=lambda c: f"{c[0]}={c[1]}",
)
def test_a_corrupt_clipping_history_is_refused_and_leaves_the_optimizer_as_it_was(corrupt):
    """The history of clipping under release: squared norms are finite and never negative."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8))
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=0.1)
    for _ in range(2):
        model(torch.randn(4, 24)).square().mean().backward()
        opt.step()
    saved = opt.state_dict()
    before = copy.deepcopy(saved)
    key, value = corrupt
    history = saved["fusedopt"]["release_clipping"]
    if key == "norm_sq":
        history["params"][0]["norm_sq"] = torch.tensor(value, dtype=torch.float64)
    else:
        history[key] = torch.tensor(value, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"invalid release_clipping entry.*never negative"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert torch.equal(after["fusedopt"]["release_clipping"]["known"], before["fusedopt"]["release_clipping"]["known"])
    for index, state in before["state"].items():
        for name, t in state.items():
            assert torch.equal(after["state"][index][name], t)


def test_a_pairing_whose_draws_overlap_is_refused_before_anything_converts():
    """A plugin's pairing of a first moment that draws a whole word with a second that draws a 12-bit field of
    it (``codecs.base.check_draws``) is refused by a load as by a step, before the first parameter converts:
    the optimizer and its parameters stay as they were."""
    saved = _checkpoint("adamw", torch.float32, state_bits=32)
    opt, params = _stepped_target("adamw", torch.float32)
    own_codecs = opt.codecs

    def overlapping(p, group):
        codecs = own_codecs(p, group)
        if "exp_avg" in codecs:
            codecs["exp_avg"] = codec_named("norm2", True, p.shape)
            assert codecs["exp_avg"].whole_word and not codecs["exp_avg_sq"].whole_word
        return codecs

    before = copy.deepcopy(opt.state_dict())  # (saved under its own codecs: state_dict() checks the state fits)
    opt.codecs = overlapping
    values = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="the first draws a whole word, so the second must too"):
        opt.load_state_dict(saved)
    del opt.codecs
    assert not _differences(opt.state_dict(), before)
    assert all(torch.equal(p.detach(), value) for p, value in zip(params, values))
