"""What a user is told when a torch call meets gradient release (``fusedopt/release_notices.py``).

* ``torch.nn.utils.clip_grad_norm_`` after a ``fused=True`` backward finds no gradients: it warns
  once, naming ``max_grad_norm``, and otherwise returns exactly what torch's own function returns
  (and clips exactly as it does where there are gradients, warning about nothing).
* A second backward through a graph kept with ``retain_graph=True``, after release updated the
  parameters in the first: torch's error, with a note naming release and the way out. An in-place
  error that release did not cause gets no note; a double backward that release does not break
  (accumulation still open) works and equals ``fused=False``.
"""

import gc
import warnings

import pytest
import torch
from helpers import loss_fn, make_model

import fusedopt
from fusedopt import release_notices


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    monkeypatch.setattr(release_notices, "_warned", False)
    gc.collect()  # optimizers of earlier tests, which a note would count


def _backward(model, seed=1):
    loss = loss_fn(model, torch.randn(4, 7, generator=torch.Generator().manual_seed(seed)))
    loss.backward()


def test_clip_grad_norm_after_release_warns_once_and_delegates_to_torch():
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), fused=True)
    assert torch.nn.utils.clip_grad_norm_ is release_notices.clip_grad_norm_  # installed with the optimizer
    _backward(model)
    with pytest.warns(UserWarning, match=r"found no gradient on 5 parameter\(s\).*max_grad_norm=") as record:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller
    assert torch.equal(norm, release_notices._torch_clip_grad_norm_(model.parameters(), 1.0))  # torch's 0.0
    opt.step()
    _backward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # once only


def test_clip_grad_norm_is_torch_s_where_release_is_not_involved():
    fusedopt.AdamW(make_model(seed=5).parameters(), fused=True)  # installs the wrapper
    ours, ref = make_model(seed=0), make_model(seed=0)
    opt = fusedopt.AdamW(ours.parameters(), fused=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward(ours)
        _backward(ref)
        for args in [(0.01,), (0.01, 1.0), (0.5, float("inf"))]:  # clips; the 1-norm; the max-norm
            a = torch.nn.utils.clip_grad_norm_(ours.parameters(), *args, foreach=False)
            b = release_notices._torch_clip_grad_norm_(ref.parameters(), *args, foreach=False)
            assert torch.equal(a, b)
            for p, q in zip(ours.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
        # a single tensor, as torch takes it
        assert torch.equal(
            torch.nn.utils.clip_grad_norm_(ours.extra, 0.1), release_notices._torch_clip_grad_norm_(ref.extra, 0.1)
        )
        opt.step()
    # torch's own warning for an empty generator still comes
    with pytest.warns(UserWarning, match="empty generator"):
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)


def test_second_backward_through_a_retained_graph_after_release_names_release():
    model = make_model(seed=0)
    fusedopt.AdamW(model.parameters(), fused=True)
    loss = loss_fn(model, torch.randn(4, 7))
    loss.backward(retain_graph=True)  # release updated every parameter in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        loss.backward()
    (note,) = info.value.__notes__
    assert "gradient release (fused=True) updated 5 parameter(s)" in note
    assert "retain_graph=True" in note and "fused=False" in note


def test_an_inplace_error_release_did_not_cause_gets_no_note_and_an_open_window_allows_double_backward():
    model = make_model(seed=0)
    fusedopt.AdamW(model.parameters(), fused=True)  # attached, but has updated nothing
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
        opt = fusedopt.AdamW(model.parameters(), state_bits=32, fused=fused, accumulation_steps=2)
        loss = loss_fn(model, torch.randn(4, 7, generator=torch.Generator().manual_seed(3)))
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
