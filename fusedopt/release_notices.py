"""Say so when a torch call does nothing, or fails, because gradient release (``fused=True``) ran first.

``install()`` runs when the first ``fused=True`` optimizer is created and wraps two torch functions;
each wrapper calls torch's own function with the same arguments and returns or raises what it does,
only adding:

* ``torch.nn.utils.clip_grad_norm_``: a warning, once per process, when a parameter given belongs
  to a releasing optimizer and holds no gradient: release updated it and freed its gradient during
  backward, so it was not clipped; under release, clipping belongs in the optimizer
  (``max_grad_norm=``). Until it warns, the wrapper reads each parameter's ``grad`` and looks up
  those without one (a dictionary lookup each); after that it only delegates.
* ``torch.autograd.backward`` (what ``Tensor.backward`` calls): autograd refuses a backward through
  a graph whose saved tensors were modified in place, before any hook of that backward runs, and
  names nothing of release. When a releasing optimizer updated parameters during an earlier backward
  since its last ``step()`` (a second backward through a graph kept with ``retain_graph=True``), a
  note saying so is added to that error. A backward that does not fail pays one Python call.

Code that bound either function before the first ``fused=True`` optimizer was created (``from
torch.nn.utils import clip_grad_norm_`` at import time) calls torch's directly and is not told.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
_torch_backward = torch.autograd.backward
_warned = False  # the clip_grad_norm_ warning was given
_owners = None  # release.py's registry: param -> weakref to the GradientRelease whose hook it carries


def install(owners) -> None:
    """Wrap the two torch functions (once; later calls do nothing). ``owners``: release.py's registry."""
    global _owners
    _owners = owners
    if torch.nn.utils.clip_grad_norm_ is _torch_clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    if torch.autograd.backward is _torch_backward:
        torch.autograd.backward = backward


def _released(p: torch.Tensor) -> bool:
    """Whether ``p`` carries the hook of a live optimizer's attached gradient release."""
    ref = _owners.get(p)
    release = ref() if ref is not None else None
    return release is not None and release.attached


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(parameters, *args, **kwargs):
    global _warned
    if not _warned and _owners:
        if isinstance(parameters, torch.Tensor):
            params = [parameters]
        else:
            is_generator = isinstance(parameters, types.GeneratorType)
            params = list(parameters)
            # torch warns about an empty generator: hand it one again
            parameters = (p for p in params) if is_generator else params
        released = sum(1 for p in params if isinstance(p, torch.Tensor) and p.grad is None and _released(p))
        if released:
            _warned = True
            warnings.warn(
                f"torch.nn.utils.clip_grad_norm_ found no gradient on {released} parameter(s) of a fusedopt "
                "optimizer with fused=True: gradient release updated them and freed their gradients during "
                "backward, so nothing of theirs was clipped and the norm returned leaves them out. Clip through "
                "the optimizer: max_grad_norm=... (with the Hugging Face Trainer, "
                "fusedopt.integrations.huggingface.FusedOptTrainer). This warning is shown once",
                UserWarning,
                stacklevel=2,
            )
    return _torch_clip_grad_norm_(parameters, *args, **kwargs)


@functools.wraps(_torch_backward)
def backward(*args, **kwargs):
    try:
        return _torch_backward(*args, **kwargs)
    except RuntimeError as error:
        if "modified by an inplace operation" in str(error):
            updated = _updated_by_release()
            if updated:
                error.add_note(
                    f"fusedopt: gradient release (fused=True) updated {updated} parameter(s) in place during an "
                    "earlier backward since the last step(); a backward through a graph built before that update "
                    "(kept with retain_graph=True) needs their old values, which are gone. Release rules out a "
                    "second backward through the same graph before step(): use fused=False there"
                )
        raise


def _updated_by_release() -> int:
    """How many parameters live releasing optimizers updated since their last ``step()``."""
    releases = {id(r): r for r in (ref() for ref in list(_owners.values())) if r is not None and r.attached}
    count = 0
    for release in releases.values():
        optimizer = release._optimizer()
        if optimizer is not None:
            count += sum(n >= optimizer.accumulation_steps for n in release._counts.values())
    return count
