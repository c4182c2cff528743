"""What a user is told about gradient release (``fused=True``) where a call of theirs meets it.

Under release each parameter is updated inside backward and its gradient freed, so a
``torch.nn.utils.clip_grad_norm_`` of the user's own after backward (a plain training loop's, or the
plain Hugging Face ``Trainer``'s) finds no gradients: it clips nothing and returns a norm of 0.

**By default** fusedopt replaces no torch function. A ``fused=True`` optimizer built without a
``max_grad_norm`` argument warns once per process (``warn_release_without_clipping``), naming the
fix: clip through the optimizer (``max_grad_norm=1.0``; with the Hugging Face Trainer,
``fusedopt.integrations.huggingface.FusedOptTrainer``; with Lightning,
``fusedopt.integrations.lightning.FusedOptCallback``), or pass ``max_grad_norm=None`` to say that
there is no clipping, which silences the warning.

**Opt-in** (``enable()``, undone by ``disable()``): two torch functions are replaced, process-wide,
by wrappers that call torch's own with the same arguments and return or raise what it does, only
adding:

* ``torch.nn.utils.clip_grad_norm_``: a warning, once per process, when a parameter given belongs
  to a releasing optimizer and holds no gradient. Until it warns, the wrapper reads each parameter's
  ``grad`` and looks up those without one (a dictionary lookup each); after that it only delegates.
* ``torch.autograd.backward`` (what ``Tensor.backward`` calls): autograd refuses a backward through
  a graph whose saved tensors were modified in place, before any hook of that backward runs, and
  names nothing of release. When a releasing optimizer updated parameters during an earlier backward
  since its last ``step()`` (a second backward through a graph kept with ``retain_graph=True``), a
  note saying so is added to that error. A backward that does not fail pays one Python call.

Only calls through those two names are seen: code that bound a function before ``enable()`` (``from
torch.nn.utils import clip_grad_norm_`` at import time), or that computes the norm another way
(accelerate's ``Accelerator.clip_grad_norm_`` uses ``torch.nn.utils.get_total_norm``), is not told.
"""

from __future__ import annotations

import functools
import os
import sys
import types
import warnings

import torch

from .release import _OWNERS  # param -> weakref to the GradientRelease whose hook it carries

_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
_torch_backward = torch.autograd.backward
_warned = False  # the clip_grad_norm_ warning was given (enable())
_release_warned = False  # warn_release_without_clipping's warning was given


class _NotGiven:
    """The default of the optimizers' ``max_grad_norm``: no clipping, and not said so (see the module)."""

    def __repr__(self) -> str:
        return "<not given: no clipping>"


NOT_GIVEN = _NotGiven()

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_fusedopt() -> int:
    """The ``stacklevel`` of the first caller outside the fusedopt package, for a warning given by
    the function that calls this one."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def warn_release_without_clipping() -> None:
    """Once per process: a ``fused=True`` optimizer was built without a ``max_grad_norm`` argument."""
    global _release_warned
    if _release_warned:
        return
    _release_warned = True
    warnings.warn(
        "fusedopt: fused=True (gradient release) updates each parameter inside backward and frees its gradient, "
        "so a clip_grad_norm_ of your own after backward (torch.nn.utils.clip_grad_norm_, a plain Hugging Face "
        "Trainer's max_grad_norm) finds no gradients and clips nothing. Clip in the optimizer: max_grad_norm=1.0 "
        "(Hugging Face: fusedopt.integrations.huggingface.FusedOptTrainer; Lightning's gradient_clip_val: "
        "fusedopt.integrations.lightning.FusedOptCallback), or pass max_grad_norm=None to say you do not clip; "
        "either silences this warning (shown once per process)",
        UserWarning,
        stacklevel=_outside_fusedopt(),
    )


def enable() -> None:
    """Replace ``torch.nn.utils.clip_grad_norm_`` and ``torch.autograd.backward`` with the wrappers
    of this module, for the whole process, until ``disable()``. Enabling twice changes nothing."""
    if torch.nn.utils.clip_grad_norm_ is _torch_clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    if torch.autograd.backward is _torch_backward:
        torch.autograd.backward = backward


def disable() -> None:
    """Give torch its own two functions back. A function replaced again since ``enable()`` (by
    someone else) is left as it is."""
    if torch.nn.utils.clip_grad_norm_ is clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = _torch_clip_grad_norm_
    if torch.autograd.backward is backward:
        torch.autograd.backward = _torch_backward


def is_enabled() -> bool:
    """Whether a wrapper of this module is in place of a torch function."""
    return torch.nn.utils.clip_grad_norm_ is clip_grad_norm_ or torch.autograd.backward is backward


def _released(p: torch.Tensor) -> bool:
    """Whether ``p`` carries the hook of a live optimizer's attached gradient release."""
    ref = _OWNERS.get(p)
    release = ref() if ref is not None else None
    return release is not None and release.attached


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(parameters, *args, **kwargs):
    global _warned
    if not _warned and _OWNERS:
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
                "fusedopt.integrations.huggingface.FusedOptTrainer; with Lightning, "
                "fusedopt.integrations.lightning.FusedOptCallback). This warning is shown once",
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
    releases = {id(r): r for r in (ref() for ref in list(_OWNERS.values())) if r is not None and r.attached}
    return sum(release.updated_since_step() for release in releases.values())
