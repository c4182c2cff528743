"""Which path runs an update: the fused Triton kernel or the PyTorch reference.

``FUSEDOPT_BACKEND`` (read at every step, and at every update outside one, so tests and users
can switch it between steps):

* ``auto`` (default): CUDA tensors the kernel supports run the kernel; everything else
  (CPU tensors, non-contiguous parameters, formats the kernel lacks) runs the reference.
* ``reference``: always the PyTorch reference.
* ``triton``: always the kernel; an unsupported case is an error naming the reason. On CPU
  tensors this needs ``TRITON_INTERPRET=1`` (Triton's interpreter), set before the first
  update (Triton reads it when the kernels are first imported).
"""

from __future__ import annotations

import functools
import os

import torch

from . import rng
from .codecs import BF16, FP32, MomentCodec
from .master import MASTER_CORRECTION
from .reference import ParamUpdate, UpdateMath, reference_update

BACKENDS = ("auto", "triton", "reference")


def backend_choice() -> str:
    """The value of ``FUSEDOPT_BACKEND``, validated."""
    choice = os.environ.get("FUSEDOPT_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"FUSEDOPT_BACKEND={choice!r} is invalid; expected one of {', '.join(BACKENDS)}")
    return choice


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _moment_format(codec: MomentCodec):
    from .kernels.update import MomentFormat

    if codec is FP32:
        return MomentFormat(32)
    if codec is BF16:
        return MomentFormat(16)
    from .codec_blockwise import BlockCodec, MinifloatLevels, PowerLevels

    if type(codec) is not BlockCodec:  # not variants with other scales
        return None
    levels = codec.levels
    if type(levels) is PowerLevels and levels.power in (1, 2):
        power = levels.power
    elif type(levels) is MinifloatLevels:
        power = -levels.mantissa_bits
    else:
        return None
    return MomentFormat(
        codec.state_bits,
        signed=codec.signed,
        power=power,
        qmax=codec.qmax,
        k=codec.k,
        min_exponent=codec.min_exponent,
        threshold=codec.mantissa_threshold,
        top=codec.top,
        block=codec.block,
    )


_DEVICES = "parameter, gradient and optimizer state are on different devices"
_LAYOUT = "non-contiguous parameter or gradient"


def _gradient_problem(param: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None) -> str | None:
    """Why this step's gradient (and accumulated buffer) cannot go to the kernel (None: it can)."""
    # plain conditions, no generators: this runs for every parameter in every step
    if grad.device != param.device or (accum is not None and accum.device != param.device):
        return _DEVICES
    if not grad.is_contiguous() or (accum is not None and not accum.is_contiguous()):
        return _LAYOUT
    return None


def check_gradient(p: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None, optimizer_name: str) -> None:
    """Refuse a gradient (or accumulated buffer) the update cannot take, naming the problem. The
    kernel reads as many gradient elements as the parameter has: one of another shape (``p.grad.data
    = ...`` can set one) would be read out of bounds."""
    if grad.is_sparse:
        raise RuntimeError(f"fusedopt.{optimizer_name} does not support sparse gradients")
    for name, g in (("gradient", grad), ("accumulated gradient", accum)):
        if g is not None and g.shape != p.shape:
            raise ValueError(f"a {name} of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}")


def unsupported_reason(job: ParamUpdate) -> str | None:
    """Why the kernel cannot run this update (None: it can)."""
    p = job.param
    if job.state["step"].device != p.device or job.skipped.device != p.device:
        return _DEVICES
    problem = _gradient_problem(p, job.grad, job.accum)
    if problem is not None:
        return problem
    if not p.is_contiguous():
        return _LAYOUT
    correction = job.state.get(MASTER_CORRECTION)
    if p.dtype != torch.float32 and job.master_weight_bits is not None and correction is None:
        return "a split parameter without its correction tensor"
    if len(job.codecs) > 2 or any(_moment_format(c) is None for c in job.codecs.values()):
        return f"moment format {list(job.codecs.values())} is not in the kernel"
    return None


def run_update(algorithm: str, math: UpdateMath, job: ParamUpdate, scratch):
    """Apply one update through the chosen path. ``scratch(p)`` gives the kernel's scratch words.

    Returns the kernel's ``PreparedUpdate`` when the kernel ran (None: the reference did)."""
    choice = backend_choice()
    if choice == "reference":
        return reference_update(math, job)
    on_gpu = job.param.is_cuda
    if choice == "auto" and not on_gpu:
        return reference_update(math, job)
    if choice == "triton" and not on_gpu and not _interpreting():
        raise RuntimeError("FUSEDOPT_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's CPU interpreter)")
    reason = unsupported_reason(job)
    if reason is not None:
        if choice == "triton":
            raise RuntimeError(f"FUSEDOPT_BACKEND=triton: the fused kernel cannot run this update: {reason}")
        return reference_update(math, job)
    return _launch(algorithm, job, scratch(job.param))


def gradient_fits_prepared(param: torch.Tensor, grad: torch.Tensor, accum: torch.Tensor | None) -> bool:
    """Whether a gradient can go to a parameter's prepared kernel launch: the per-step part of
    ``unsupported_reason`` (the rest is fixed while the prepared launch is valid). The caller
    checks that the backend is not ``reference`` (``kernel_allowed``)."""
    return _gradient_problem(param, grad, accum) is None


def kernel_allowed() -> bool:
    """Whether ``FUSEDOPT_BACKEND`` lets a prepared kernel launch run (it is not ``reference``)."""
    return backend_choice() != "reference"


def new_scratch(device: torch.device) -> torch.Tensor:
    """A parameter's scratch words for the kernels (zeroed; the kernels leave them reusable)."""
    from .kernels.update import SCRATCH_WORDS

    return torch.zeros(SCRATCH_WORDS, dtype=torch.int32, device=device)


def _launch(algorithm: str, job: ParamUpdate, scratch: torch.Tensor):
    from .kernels.update import launch_update

    state = job.state
    moments = []
    for slot, codec in job.codecs.items():
        fmt = _moment_format(codec)
        values = state[slot] if fmt.fmt in (32, 16) else state[slot + ".codes"]
        moments.append((fmt, values, state.get(slot + ".scales")))
    split = job.param.dtype != torch.float32 and job.master_weight_bits
    return launch_update(
        algorithm,
        job.param,
        job.grad,
        job.accum,
        state.get(MASTER_CORRECTION) if split else None,
        moments,
        state["step"],
        scratch,
        job.skipped,
        (rng.host_key(job.seed, job.index, rng.STREAM_SHARED), rng.host_key(job.seed, job.index, rng.STREAM_PARAM)),
        not rng.param_shares_draw(job.param.dtype, job.master_weight_bits),
        job.hyper,
    )
