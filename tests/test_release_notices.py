"""What a user is told when their code meets gradient release (``fusedopt/release_notices.py``).

* Building an optimizer, training with it and importing fusedopt leave ``torch.autograd.backward``
  and ``torch.nn.utils.clip_grad_norm_`` torch's own.
* A ``fused=True`` optimizer built without a ``max_grad_norm`` argument warns once per process,
  pointing at the caller and naming the fix; ``max_grad_norm=None`` or a number says what is meant
  and does not warn; ``fused=False`` never does.
* Opt-in (``release_notices.enable()``, undone by ``disable()``):
  ``torch.nn.utils.clip_grad_norm_`` after a ``fused=True`` backward finds no gradients and warns
  once, naming ``max_grad_norm``, and otherwise returns exactly what torch's own function returns
  (and clips exactly as it does where there are gradients, warning about nothing). A second
  backward through a graph kept with ``retain_graph=True``, after release updated the parameters in
  the first: torch's error, with a note naming release and the way out. An in-place error that
  release did not cause gets no note; a double backward that release does not break (accumulation
  still open) works and equals ``fused=False``.
"""

import gc
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import loss_fn, make_model

import fusedopt
from fusedopt import release_notices

# torch's own functions, from the modules that define them (fusedopt replaces only the names
# torch.nn.utils.clip_grad_norm_ and torch.autograd.backward)
TORCH_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
OPTIMIZERS = [fusedopt.AdamW, fusedopt.SGD, fusedopt.Lion, fusedopt.Adafactor]


def _torch_s_backward(function) -> bool:
    return function.__code__.co_filename == torch.autograd.__file__


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    monkeypatch.setattr(release_notices, "_warned", False)
    monkeypatch.setattr(release_notices, "_release_warned", False)
    gc.collect()  # optimizers of earlier tests, which a note would count
    yield
    release_notices.disable()


@pytest.fixture
def notices():
    release_notices.enable()
    assert torch.nn.utils.clip_grad_norm_ is release_notices.clip_grad_norm_
    assert torch.autograd.backward is release_notices.backward


def _backward(model, seed=1):
    loss = loss_fn(model, torch.randn(4, 7, generator=torch.Generator().manual_seed(seed)))
    loss.backward()


def _untouched() -> bool:
    return torch.nn.utils.clip_grad_norm_ is TORCH_CLIP and _torch_s_backward(torch.autograd.backward)


# --- by default: torch untouched, one warning at construction -------------------------------


def test_building_and_training_leave_torch_untouched():
    """In a fresh process: the functions torch had before fusedopt was imported are still torch's
    after every optimizer was built with and without release, trained and garbage-collected."""
    code = """
import torch
backward, clip = torch.autograd.backward, torch.nn.utils.clip_grad_norm_
import fusedopt, fusedopt.integrations
for cls in (fusedopt.AdamW, fusedopt.SGD, fusedopt.Lion, fusedopt.Adafactor):
    for kwargs in ({}, dict(fused=True), dict(fused=True, max_grad_norm=1.0), dict(fused=True, max_grad_norm=None)):
        model = torch.nn.Linear(8, 8)
        opt = cls(model.parameters(), **kwargs)
        model(torch.randn(2, 8)).square().sum().backward()
        opt.step()
        assert torch.autograd.backward is backward, (cls, kwargs)
        assert torch.nn.utils.clip_grad_norm_ is clip, (cls, kwargs)
print("untouched")
"""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "untouched" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_release_without_max_grad_norm_warns_once_per_process(cls):
    assert _untouched()
    with pytest.warns(UserWarning, match="fused=True") as record:
        cls(make_model(seed=0).parameters(), fused=True)
    (warning,) = [w for w in record if "fusedopt" in str(w.message)]
    assert warning.filename == __file__  # points at the caller, whatever the subclass's depth
    message = str(warning.message)
    for part in ("clip_grad_norm_", "finds no gradients", "max_grad_norm=1.0", "max_grad_norm=None", "FusedOptTrainer"):
        assert part in message, part
    assert _untouched()  # warned, and replaced nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls(make_model(seed=1).parameters(), fused=True)  # once per process


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_an_explicit_max_grad_norm_or_no_release_does_not_warn(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = cls(make_model(seed=0).parameters(), fused=True, max_grad_norm=None)  # "I do not clip"
        assert opt.max_grad_norm is None
        opt = cls(make_model(seed=1).parameters(), fused=True, max_grad_norm=1.0)
        assert opt.max_grad_norm == 1.0
        opt = cls(make_model(seed=2).parameters())  # fused=False: clip_grad_norm_ finds its gradients
        assert opt.max_grad_norm is None and not opt.fused
    assert not release_notices._release_warned  # still to come, for the first release left unsaid


# --- opt-in: torch's two functions wrapped, and given back ---------------------------------


def test_enable_installs_the_wrappers_and_disable_gives_torch_its_own_back():
    assert _untouched() and not release_notices.is_enabled()
    release_notices.enable()
    release_notices.enable()  # twice: no wrapper of a wrapper
    assert torch.nn.utils.clip_grad_norm_ is release_notices.clip_grad_norm_
    assert torch.autograd.backward is release_notices.backward and release_notices.is_enabled()
    release_notices.disable()
    assert _untouched() and not release_notices.is_enabled()
    release_notices.disable()  # when not enabled: nothing to do
    assert _untouched()

    # a function someone else replaced after enable() is theirs: disable() leaves it
    release_notices.enable()
    theirs = lambda *args, **kwargs: None
    torch.nn.utils.clip_grad_norm_ = theirs
    try:
        release_notices.disable()
        assert torch.nn.utils.clip_grad_norm_ is theirs and _torch_s_backward(torch.autograd.backward)
    finally:
        torch.nn.utils.clip_grad_norm_ = TORCH_CLIP


def test_clip_grad_norm_after_release_warns_once_and_delegates_to_torch(notices):
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=None)
    _backward(model)
    with pytest.warns(UserWarning, match=r"found no gradient on 5 parameter\(s\).*max_grad_norm=") as record:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller
    assert torch.equal(norm, TORCH_CLIP(model.parameters(), 1.0))  # torch's 0.0
    opt.step()
    _backward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # once only


def test_without_enable_clip_grad_norm_after_release_is_torch_s_and_silent():
    model = make_model(seed=0)
    _opt = fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=None)
    _backward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0


def test_clip_grad_norm_is_torch_s_where_release_is_not_involved(notices):
    _live = fusedopt.AdamW(make_model(seed=5).parameters(), fused=True, max_grad_norm=None)  # kept alive
    ours, ref = make_model(seed=0), make_model(seed=0)
    opt = fusedopt.AdamW(ours.parameters(), fused=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward(ours)
        _backward(ref)
        for args in [(0.01,), (0.01, 1.0), (0.5, float("inf"))]:  # clips; the 1-norm; the max-norm
            a = torch.nn.utils.clip_grad_norm_(ours.parameters(), *args, foreach=False)
            b = TORCH_CLIP(ref.parameters(), *args, foreach=False)
            assert torch.equal(a, b)
            for p, q in zip(ours.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
        # a single tensor, as torch takes it
        assert torch.equal(torch.nn.utils.clip_grad_norm_(ours.extra, 0.1), TORCH_CLIP(ref.extra, 0.1))
        opt.step()
    # torch's own warning for an empty generator still comes
    with pytest.warns(UserWarning, match="empty generator"):
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)


def test_second_backward_through_a_retained_graph_after_release_names_release(notices):
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=None)
    loss = loss_fn(model, torch.randn(4, 7))
    loss.backward(retain_graph=True)  # release updated every parameter in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        loss.backward()
    (note,) = info.value.__notes__
    assert "gradient release (fused=True) updated 5 parameter(s)" in note
    assert "retain_graph=True" in note and "fused=False" in note

    release_notices.disable()  # torch's own error again, without the note
    opt.step()
    loss = loss_fn(model, torch.randn(4, 7))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        loss.backward()
    assert not getattr(info.value, "__notes__", None)


def test_an_inplace_error_release_did_not_cause_gets_no_note_and_an_open_window_allows_double_backward(notices):
    model = make_model(seed=0)
    fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=None)  # attached, but has updated nothing
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.add_(1)  # the user's own in-place change of a saved tensor
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        y.sum().backward()
    assert not getattr(info.value, "__notes__", None)

    # accumulation_steps=2: the first backward does not update, so a second one through the graph works
    results = []
    for fused in (True, False):
        model = make_model(seed=0)
        opt = fusedopt.AdamW(model.parameters(), state_bits=32, fused=fused, accumulation_steps=2, max_grad_norm=None)
        loss = loss_fn(model, torch.randn(4, 7, generator=torch.Generator().manual_seed(3)))
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
