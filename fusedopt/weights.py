"""Full-precision weights of a model whose bf16/fp16 parameters are split by a fusedopt optimizer.

With ``master_weight_bits`` 24 or 32 the model holds only the rounded weights; the low bits
live in the optimizer state. These helpers move the full-precision (fp32) weights in and out:

* ``master_state_dict(model, optimizer)``: the model's state dict with every parameter the
  optimizer holds replaced by its fp32 master (other floating entries converted to fp32,
  integer buffers unchanged). It loads into an fp32 copy of the model with
  ``load_state_dict``; with ``master_weight_bits=32`` on bf16 it is exactly the fp32 master.
* ``load_master_state_dict(model, optimizer, state_dict)``: loads a model state dict (any
  float dtype; usually fp32) and sets each split parameter and its correction so that the
  master is the given value: bit for bit with 32 on bf16 (fp16: for ``|x| >= 2**-17``), to
  the nearest 24-bit master with 24 (ties away from zero). Call it *after*
  ``optimizer.load_state_dict``: an optimizer checkpoint carries corrections but no weights,
  and one without corrections (from fp32 parameters or torch.optim) sets them to zero.
"""

from __future__ import annotations

import torch

from .master import is_split, set_master
from .optimizer import FusedOptimizer


def _check(optimizer) -> dict[int, torch.Tensor]:
    if not isinstance(optimizer, FusedOptimizer):
        raise TypeError(f"expected a fusedopt optimizer, got {type(optimizer).__name__}")
    optimizer.sync_groups()  # param_groups may have been edited since the last step
    return {id(p): p for group in optimizer.param_groups for p in group["params"]}


def master_state_dict(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with full-precision masters: {name: fp32 tensor} (new tensors)."""
    held = _check(optimizer)
    out = {}
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            if id(value) in held:
                out[name] = optimizer.master_weight(value)
            elif value.is_floating_point():
                out[name] = value.detach().to(torch.float32, copy=True)
            else:
                out[name] = value.detach().clone()
    return out


def load_master_state_dict(model: torch.nn.Module, optimizer, state_dict: dict, strict: bool = True):
    """Load full-precision weights into ``model``, setting the optimizer's corrections to match.

    Names, shapes and ``strict`` behave as ``model.load_state_dict`` (which does the loading of
    everything the optimizer does not split); returns its result (missing/unexpected keys).
    """
    held = _check(optimizer)
    params = model.state_dict(keep_vars=True)
    _check_fits(params, state_dict, strict)  # before anything is written
    try:
        return model.load_state_dict(state_dict, strict=strict)
    finally:
        # Even if torch raised after copying some entries: a split parameter torch wrote gets the
        # correction of its new value, never keeps the old one (the master would be neither).
        for name, value in state_dict.items():
            p = params.get(name)
            if p is None or id(p) not in held or not isinstance(value, torch.Tensor) or value.shape != p.shape:
                continue
            group, _ = optimizer.position(p)
            if is_split(p, group["master_weight_bits"]):  # the rest was loaded exactly as torch loads it
                set_master(p, optimizer.ensure_state(p), group["master_weight_bits"], torch.as_tensor(value))


def _check_fits(own: dict, state_dict: dict, strict: bool) -> None:
    """Raise as ``model.load_state_dict`` would, but before it copies anything: torch copies
    what fits and raises at the end."""
    problems = [
        f"size mismatch for {name}: copying a param with shape {tuple(value.shape)} from checkpoint, "
        f"the shape in current model is {tuple(own[name].shape)}"
        for name, value in state_dict.items()
        if name in own and isinstance(value, torch.Tensor) and value.shape != own[name].shape
    ]
    if strict:
        missing = [name for name in own if name not in state_dict]
        unexpected = [name for name in state_dict if name not in own]
        if missing:
            problems.append(f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}")
        if unexpected:
            problems.append(f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}")
    if problems:
        message = "\n\t".join(problems)
        raise RuntimeError(f"Error(s) in loading state_dict for the model (nothing was loaded):\n\t{message}")
