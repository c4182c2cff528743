"""Plain-PyTorch reference of every update: the CPU path and the oracle for the Triton kernels.

One parameter at a time: decode the stored state to fp32, apply the algorithm's fp32 math,
re-encode the state and write the parameter. A parameter whose gradient is not finite is
left exactly as it was (parameter, state, step count): everything is computed, then
committed with ``torch.where`` on a device-side flag, so no host synchronisation is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import rng
from .codecs.base import MomentCodec, decode_moments, encode_moments, first_draws_whole
from .master import read_master, write_master
from .rounding import round_stochastic


@dataclass
class ParamUpdate:
    """Everything one parameter's update needs (built by the optimizer, consumed by a backend)."""

    param: torch.Tensor
    grad: torch.Tensor  # gradient of this step (any float dtype)
    accum: torch.Tensor | None  # earlier micro-batches' gradient, held by the optimizer (or None)
    state: dict  # the parameter's optimizer state (updated in place)
    codecs: dict[str, MomentCodec]  # slot name -> codec, in slot order
    hyper: dict  # algorithm hyperparameters (floats and bools)
    master_weight_bits: int | None
    seed: int
    index: int  # the parameter's index in the optimizer (a hash input)
    skipped: torch.Tensor  # counter of skipped updates (0-d int64 tensor)
    # slot -> the factor the math multiplies the old moment by (an EMA's decay), for codecs that
    # keep it exact (``MomentCodec.encode_decayed``); None: not known
    decays: dict[str, float] | None = None
    first: int = 0  # global index of the first element (a sharded parameter's local shard)
    # slot -> the slot a framed format stores it relative to (``MomentCodec.frame``)
    frames: dict[str, str] | None = None


# An algorithm's fp32 math (in its own file): takes the fp32 master ``p``, the fp32 gradient ``g``
# (already negated for maximize), the decoded moments and the new step count (a 0-d tensor) and the
# hyperparameters as keywords, and returns (p, moments).
UpdateMath = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


# --- the generic decode -> update -> encode -> commit chain ------------------------------------


def reference_update(math: UpdateMath, job: ParamUpdate) -> None:
    """Apply one update to ``job.param`` and its state with the plain-PyTorch reference."""
    p, state, hyper = job.param, job.state, job.hyper
    g = job.grad.float()
    if job.accum is not None:
        g = g + job.accum.float()
    if hyper.get("maximize", False):
        g = -g
    ok = torch.isfinite(g).all()
    step = state["step"] + ok.to(state["step"].dtype)

    stored = {slot: {s: state[slot + s] for s in codec.suffixes} for slot, codec in job.codecs.items()}
    frames = job.frames or {}
    moments = decode_moments(job.codecs, stored, frames)
    math_hyper = {k: v for k, v in hyper.items() if k != "maximize"}
    master = read_master(p, state, job.master_weight_bits)
    new_p, new_moments = math(master, g, moments, step, **math_hyper)

    new_state = {}
    draws = rng.UpdateDraws(
        job.seed, job.index, step, p, job.master_weight_bits, job.first, first_draws_whole(job.codecs)
    )
    encoded = encode_moments(job.codecs, new_moments, draws.moment, frames, stored, job.decays)
    for slot, storage in encoded.items():
        new_state.update({slot + s: t for s, t in storage.items()})
    new_param, corrections = write_master(p, new_p, state, job.master_weight_bits, draws.param())
    new_state.update(corrections)

    # Commit, or keep everything as it was if the gradient was not finite.
    p.copy_(torch.where(ok, new_param, p))
    for key, value in new_state.items():
        state[key].copy_(torch.where(ok, value, state[key]))
    state["step"].copy_(step)
    job.skipped.add_((~ok).to(job.skipped.device, torch.int64))


# Elements per chunk of the low-precision accumulation: its fp32 sum and 64-bit random words take
# ~30 bytes per element, so a whole 65M-element embedding gradient would need ~2 GiB of temporaries.
ACCUMULATION_CHUNK = 1 << 21


def accumulate_low_precision(
    buffer: torch.Tensor | None,
    grad: torch.Tensor,
    *,
    seed: int,
    index: int,
    micro_batch: int,
    step: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """Add a micro-batch gradient to a bf16/fp16 buffer with stochastic rounding (small parts survive).

    The first gradient becomes the buffer; later ones are added into it in place (as torch
    accumulates ``.grad``), chunk by chunk so the temporaries stay small. The result is the same
    bits as one whole-tensor rounding: element ``i`` always draws the hash of index ``first + i``
    (``first``: the global index of a shard's first element).
    """
    if buffer is None:
        return grad
    key = rng.host_key(seed, index, rng.STREAM_GRAD_ACCUM + micro_batch)
    h = rng.step_hash(key, step.to(grad.device))
    target = buffer if buffer.is_contiguous() else buffer.contiguous()
    flat, addend = target.view(-1), grad.reshape(-1)
    n = flat.numel()
    for start in range(0, n, ACCUMULATION_CHUNK):
        end = min(n, start + ACCUMULATION_CHUNK)
        total = flat[start:end].float() + addend[start:end].float()
        idx = torch.arange(first + start, first + end, dtype=torch.int64, device=grad.device)
        bits = rng.element_bits(h, idx, beyond_32_bits=first + n > 1 << 32)
        flat[start:end] = round_stochastic(total, bits, grad.dtype)
    return target
