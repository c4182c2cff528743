"""The planner's byte model and the profiler's categories agree with what fusedopt's optimizers keep.

Defaults are those a constructed optimizer holds; bytes per parameter are those a real optimizer
allocates on a large bf16 matrix after one step, for every selectable state format (whatever the
registry holds) and every algorithm that takes it. CPU only; no training beyond one step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tracked_step

import fusedopt
from fusedopt.codecs import SUPPORTED_STATE_BITS, registered_formats
from fusedopt.master import MASTER_CORRECTION
from fusedopt.profile import parse_config
from fusedopt.profile.planner import DEFAULT_FORMAT, byte_model, describe, format_of, options_of

# Each algorithm with the options that make it keep its parameter-sized moments.
ALGORITHMS = {
    "fusedopt.AdamW": {},
    "fusedopt.SGD": {"momentum": 0.9},
    "fusedopt.Lion": {},
    "fusedopt.Adafactor": {"beta1": 0.9},
}
# A matrix whose every dimension is a multiple of each format's block: no padding to tell apart.
SHAPE = (256, 1024)
GROUP_OPTIONS = ("state_bits", "state_format", "master_weight_bits", "min_compress_numel")
OPTIMIZER_OPTIONS = ("fused", "accumulation_steps", "seed", "max_grad_norm", "release_clipping")


def _optimizer(name: str, kwargs: dict, dtype=torch.bfloat16, shape=SHAPE):
    p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    return p, getattr(fusedopt, name.split(".")[1])([p], **kwargs)


def _allocated(opt, p) -> tuple[int, int]:
    """(correction bytes, other state bytes) that ``opt`` holds for ``p`` (the 0-d step counter aside)."""
    corrections = state = 0
    for key, value in opt.state[p].items():
        if key == "step":
            continue
        nbytes = value.numel() * value.element_size()
        if key == MASTER_CORRECTION:
            corrections += nbytes
        else:
            state += nbytes
    return corrections, state


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_planners_defaults_are_the_optimizers(name):
    """An option a configuration does not give is what the optimizer's own group or attribute holds."""
    _, opt = _optimizer(name, {})
    options = options_of(name, {})
    for key in GROUP_OPTIONS:
        assert options[key] == opt.param_groups[0][key], key
    for key in OPTIMIZER_OPTIONS:
        if key == "max_grad_norm":  # not given: no clipping
            assert opt.max_grad_norm is None
        elif key == "seed":  # not given: the optimizer's choice (0, or one per one-parameter optimizer)
            assert options[key] is None and isinstance(opt.seed, int) and opt.seed >= 0
        else:
            assert options[key] == getattr(opt, key), key


def test_the_default_format_is_the_default_adamw():
    _, opt = _optimizer("fusedopt.AdamW", {})
    group = opt.param_groups[0]
    assert group["state_format"] is None
    assert DEFAULT_FORMAT == (group["state_bits"], group["master_weight_bits"])
    assert format_of(parse_config("fusedopt")) == DEFAULT_FORMAT
    assert describe(parse_config("fusedopt"), torch.bfloat16).endswith("(default)")
    explicit = f"fusedopt:state_bits={group['state_bits']},master_weight_bits={group['master_weight_bits']}"
    assert describe(parse_config(explicit), torch.bfloat16).endswith("(default)")
    other = next(b for b in SUPPORTED_STATE_BITS if b != group["state_bits"])
    assert not describe(parse_config(f"fusedopt:state_bits={other}"), torch.bfloat16).endswith("(default)")


def _format_options():
    return [{"state_format": f} for f in registered_formats()] + [{"state_bits": b} for b in SUPPORTED_STATE_BITS]


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("fmt", _format_options(), ids=lambda o: str(next(iter(o.values()))))
def test_byte_model_is_what_the_optimizer_allocates(name, fmt):
    """Bytes per parameter of the moments and the correction: the planner's byte model equals a real
    optimizer's state after a step (Adafactor's factored statistics, R + C fp32 values, aside)."""
    kwargs = {**ALGORITHMS[name], **fmt}
    try:
        p, opt = _optimizer(name, kwargs)
    except ValueError:  # a format this algorithm refuses (a framed first moment needs a second)
        assert name != "fusedopt.AdamW", fmt  # AdamW takes every selectable format
        with pytest.raises(ValueError):  # the planner refuses it too, rather than count some bytes
            byte_model(name, kwargs, torch.bfloat16)
        return
    p.grad = torch.randn_like(p)
    opt.step()
    corrections, state = _allocated(opt, p)
    n = p.numel()
    if name == "fusedopt.Adafactor":
        state -= 4 * sum(SHAPE)
    per = byte_model(name, kwargs, torch.bfloat16)
    assert per.source == "byte model"
    assert per.state * n == state
    assert per.corrections * n == corrections
    assert per.params == p.element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("master_weight_bits", [None, 24, 32])
def test_correction_bytes_are_the_optimizers(dtype, master_weight_bits):
    """The correction kept beside each parameter dtype under each master_weight_bits (none for fp32)."""
    kwargs = {"master_weight_bits": master_weight_bits}
    p, opt = _optimizer("fusedopt.AdamW", kwargs, dtype)
    p.grad = torch.randn_like(p)
    opt.step()
    corrections, _ = _allocated(opt, p)
    per = byte_model("fusedopt.AdamW", kwargs, dtype)
    assert per.corrections * p.numel() == corrections
    assert per.params == p.element_size()


def test_min_compress_numel_above_a_tensor_keeps_fp32_moments():
    """A tensor below min_compress_numel keeps fp32 moments in the byte model as in the optimizer."""
    p, opt = _optimizer("fusedopt.AdamW", {"min_compress_numel": SHAPE[0] * SHAPE[1] + 1})
    p.grad = torch.randn_like(p)
    opt.step()
    per = byte_model("fusedopt.AdamW", {"min_compress_numel": 4096 * 4096 + 1}, torch.bfloat16)
    assert per.state * p.numel() == _allocated(opt, p)[1]


@pytest.mark.parametrize("config", ["fusedopt", "fusedopt:state_bits=4,master_weight_bits=32", "fusedopt.Lion"])
def test_the_profilers_categories_are_the_byte_models(config):
    """The profiler's tracker files a real optimizer's correction and state as the planner counts them."""
    parsed = parse_config(config)
    model = torch.nn.Linear(*reversed(SHAPE), bias=False).to(torch.bfloat16)
    opt = parsed.build(model.parameters(), model=model)
    x = torch.randn(4, SHAPE[1], dtype=torch.bfloat16)
    held = tracked_step(model, opt, x).persistent_breakdown.categories
    per = byte_model(parsed.optimizer, parsed.kwargs, torch.bfloat16)
    n = model.weight.numel()
    assert held["corrections"] == per.corrections * n
    assert held["optimizer_state"] - 4 == per.state * n  # + the 0-d fp32 step counter
