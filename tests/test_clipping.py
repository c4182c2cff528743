"""Gradient clipping through the optimizer (``max_grad_norm``) with ``fused=False``: exactly
``torch.nn.utils.clip_grad_norm_`` over the step's gradients, then the update; ``opt.grad_norm`` is
torch's total norm, a device tensor. With ``fused=True`` it is refused (not silently skipped)."""

import pytest
import torch
from helpers import loss_fn, make_model

import fusedopt

N_STEPS = 30


def _run(make_opt, clip_in_loop: float | None, scales):
    model = make_model(seed=0)
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    norms = []
    for scale in scales:
        x = torch.randn(4, 7, generator=gen)
        opt.zero_grad()
        (loss_fn(model, x) * scale).backward()
        if clip_in_loop is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_in_loop))
        opt.step()
        if clip_in_loop is None:
            norms.append(opt.grad_norm.clone())
    return model, norms


# losses scaled so that some steps clip (norm above 1) and some do not
SCALES = [0.05 if i % 3 else 20.0 for i in range(N_STEPS)]


@pytest.mark.parametrize(
    "fused_cls, torch_cls, kwargs",
    [
        (fusedopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (fusedopt.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.01)),
    ],
    ids=["adamw", "sgd"],
)
def test_clipping_equals_torch_clip_then_torch_optimizer(fused_cls, torch_cls, kwargs):
    ours, our_norms = _run(lambda p: fused_cls(p, state_bits=32, max_grad_norm=1.0, **kwargs), None, SCALES)
    ref, ref_norms = _run(lambda p: torch_cls(p, **kwargs), 1.0, SCALES)
    clipped = [float(n) > 1.0 for n in ref_norms]
    assert any(clipped) and not all(clipped)  # steps that clip and steps that do not
    for a, b in zip(our_norms, ref_norms):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_clipping_changes_the_trajectory_and_grad_norm_is_a_device_tensor():
    clipped, norms = _run(lambda p: fusedopt.AdamW(p, lr=1e-2, state_bits=32, max_grad_norm=1.0), None, SCALES[:6])
    plain = make_model(seed=0)
    opt = fusedopt.AdamW(plain.parameters(), lr=1e-2, state_bits=32)
    gen = torch.Generator().manual_seed(1)
    for scale in SCALES[:6]:
        opt.zero_grad()
        (loss_fn(plain, torch.randn(4, 7, generator=gen)) * scale).backward()
        opt.step()
    assert opt.grad_norm is None  # nothing computed without max_grad_norm
    assert any(not torch.equal(a, b) for a, b in zip(clipped.parameters(), plain.parameters()))
    assert all(isinstance(n, torch.Tensor) and n.dim() == 0 for n in norms)


def test_a_non_finite_gradient_under_clipping_behaves_as_torch_and_never_enters_the_weights():
    """An inf makes the norm inf and torch's coefficient 0: the other gradients become 0 (as after
    torch's own clip_grad_norm_) and the parameter holding the inf (now NaN) is skipped."""
    model = make_model(seed=0)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, torch.randn(4, 7)).backward()
    first = next(model.parameters())
    first.grad[0, 0] = float("inf")
    opt.step()
    assert torch.isinf(opt.grad_norm)
    assert torch.equal(first, before[0])  # skipped
    assert int(opt.num_skipped_updates) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(t).all() for st in opt.state.values() for t in st.values() if t.is_floating_point())


def test_max_grad_norm_with_release_is_refused():
    with pytest.raises(ValueError, match="max_grad_norm with fused=True is not supported yet"):
        fusedopt.AdamW(make_model().parameters(), max_grad_norm=1.0, fused=True)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "1", True])
def test_invalid_max_grad_norm_is_refused(value):
    with pytest.raises(ValueError, match="max_grad_norm"):
        fusedopt.Lion(make_model().parameters(), max_grad_norm=value)


def test_max_grad_norm_in_a_group_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="'max_grad_norm' is an optimizer-wide option"):
        fusedopt.AdamW([{"params": list(model.parameters()), "max_grad_norm": 1.0}])
