"""A parameter's prepared kernel launch (kernels/update.py ``PreparedUpdate``) is reused from
step to step and rebuilt whenever something it was built from changes.

The same scripted run goes through the kernel (Triton's interpreter on CPU, the compiled
kernel on a GPU) and through the PyTorch reference: lr changes every step (reuse), then
``maximize`` flips, the optimizer is reloaded from its own checkpoint, the seed changes and a
gradient arrives with an accumulated buffer (each must rebuild or bypass the prepared launch).
In the interpreter both paths agree bit for bit; a stale prepared launch would not.
"""

import pytest
import torch

import fusedopt
from fusedopt.kernels import update

SHAPE = (37, 41)


def _script(backend, monkeypatch, device, built: list):
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    device = "cpu" if backend == "reference" else device
    gen = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(SHAPE, generator=gen).to(device, torch.bfloat16))
    opt = fusedopt.AdamW([w], lr=1e-2, weight_decay=0.1)

    def step(accum=None):
        g = torch.randn(SHAPE, generator=gen).to(device, torch.bfloat16)
        n = len(built)
        with torch.no_grad():
            opt.update_param(w, g, accum)
        return len(built) - n  # prepared launches built by this update

    rebuilt = [step()]
    for lr in (3e-3, 1e-3, 2e-3):  # a schedule: runtime scalars only
        opt.param_groups[0]["lr"] = lr
        rebuilt.append(step())
    opt.param_groups[0]["maximize"] = True
    rebuilt.append(step())
    opt.load_state_dict(opt.state_dict())
    rebuilt.append(step())
    opt.seed = 99
    rebuilt.append(step())
    rebuilt.append(step(accum=torch.randn(SHAPE, generator=gen).to(device, torch.bfloat16)))
    rebuilt.append(step())
    return w.detach().cpu(), {k: v.cpu() for k, v in opt.state[w].items()}, rebuilt


@pytest.fixture
def built(monkeypatch):
    """Records every PreparedUpdate built."""
    record = []
    original = update.PreparedUpdate.__init__

    def init(self, *args, **kwargs):
        record.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(update.PreparedUpdate, "__init__", init)
    return record


def test_prepared_launch_is_reused_and_rebuilt_when_it_must(monkeypatch, device, built):
    ref_w, ref_state, _ = _script("reference", monkeypatch, device, [])
    got_w, got_state, rebuilt = _script("triton", monkeypatch, device, built)
    # first step builds; lr changes reuse; maximize, reload and seed rebuild; the accumulated
    # gradient reuses (both configurations are prepared); the last step reuses
    assert rebuilt == [1, 0, 0, 0, 1, 1, 1, 0, 0]
    if not torch.cuda.is_available():  # the interpreter: bit for bit
        assert torch.equal(ref_w, got_w)
        for key in ref_state:
            assert torch.equal(ref_state[key], got_state[key]), key
    else:
        assert ((ref_w.float() - got_w.float()).abs() <= 2**-7 * ref_w.float().abs() + 1e-6).all()


def test_reference_backend_bypasses_a_prepared_launch(monkeypatch, device, built):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    w = torch.nn.Parameter(torch.randn(SHAPE).to(device, torch.bfloat16))
    opt = fusedopt.AdamW([w], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()
    assert len(built) == 1
    calls = []
    monkeypatch.setattr(update.PreparedUpdate, "launch", lambda self, *a: calls.append(a))
    monkeypatch.setenv("FUSEDOPT_BACKEND", "reference")
    opt.step()
    assert calls == [] and opt.state[w]["step"].item() == 2
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    opt.step()
    assert len(calls) == 1
