"""Finite checks run ahead on a side stream in ``step()`` (fusedopt/streams.py, CheckStreams), on the GPU.

A large parameter's check runs on a high-priority side stream and its update waits for the
check's event. Each case is held against the same optimizer with every check on the current
stream, bit for bit: parameters, corrections, codes, scales, step counts and the skip counter.
"""

import pytest
import torch

import fusedopt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LARGE = (4096, 4097)  # 16.8M elements: at least CHECK_AHEAD_NUMEL, launched alone
SMALL = (1000, 33)  # below it: bucketed, checked on the current stream


def _params():
    gen = torch.Generator().manual_seed(0)
    shapes = [LARGE, SMALL, LARGE]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to("cuda", torch.bfloat16)) for s in shapes]


def _grads(steps: int):
    gen = torch.Generator().manual_seed(1)
    grads = [
        [torch.randn(s, generator=gen).to("cuda", torch.bfloat16) for s in (LARGE, SMALL, LARGE)] for _ in range(steps)
    ]
    grads[1][2].view(-1)[12345] = float("nan")  # step 2: the second large parameter is skipped
    grads[2][0].view(-1)[-1] = float("inf")  # step 3: the first one
    return grads


def _snapshot(opt, params):
    state = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]
    return [p.detach().clone() for p in params], state, opt.num_skipped_updates.clone()


def _assert_same(a, b):
    (pa, sa, ka), (pb, sb, kb) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key
    assert torch.equal(ka, kb)


def _train(ahead: bool, late_gradients: bool = False, steps: int = 3):
    params = _params()
    opt = fusedopt.AdamW(params, lr=1e-2, weight_decay=0.1)
    if not ahead:
        opt._check_ahead_numel = 1 << 62
    snapshots = []
    for grads in _grads(steps):
        for p, g in zip(params, grads):
            if late_gradients:
                # the gradient is written on the current stream after ~10 ms of GPU work, over a
                # finite one: a check that did not wait for the current stream reads the old one
                p.grad = torch.ones_like(p)
                torch.cuda._sleep(20_000_000)
                p.grad.copy_(g)
            else:
                p.grad = g.clone()
        opt.step()
        opt.zero_grad()
        snapshots.append(_snapshot(opt, params))
    torch.cuda.synchronize()
    return opt, params, snapshots


def test_checks_ahead_match_checks_in_the_current_stream():
    opt, params, ahead = _train(ahead=True)
    base_opt, _, base = _train(ahead=False)
    assert opt._check_streams._streams, "no check ran on the side stream"
    assert not base_opt._check_streams._streams
    for a, b in zip(ahead, base):
        _assert_same(a, b)
    # two updates skipped (steps 2 and 3), which leaves those parameters' step counts at 2
    assert int(opt.num_skipped_updates) == 2
    assert [int(opt.state[p]["step"]) for p in params] == [2, 3, 2]


def test_checks_ahead_wait_for_gradients_of_the_current_stream():
    opt, params, ahead = _train(ahead=True, late_gradients=True)
    _, _, base = _train(ahead=False)
    for a, b in zip(ahead, base):
        _assert_same(a, b)
    assert int(opt.num_skipped_updates) == 2
    assert all(torch.isfinite(p).all() for p in params)
