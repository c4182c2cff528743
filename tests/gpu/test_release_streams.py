"""Gradient release and CUDA streams (fusedopt/release.py), on the GPU.

Held updates launch on the device's default stream, where autograd made their gradients ready; a
gradient made ready on a side stream is updated at once, on that stream; a caller whose current
stream is a side stream waits for the updates launched at the end of backward. Each case is held
against ``fused=False`` on the same inputs, bit for bit, and reads the parameters on the caller's
stream right after ``backward()``, without a synchronisation.
"""

import pytest
import torch

import fusedopt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [1 << 16, 1 << 17, 3 << 16, 1 << 21]  # bf16: 128 KiB, 256 KiB, 384 KiB, 4 MiB


class Identity(torch.autograd.Function):
    """The identity with a plain backward (a gradient the size of its input, allocated on its stream)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class LateGradient(Identity):
    """The identity, whose backward first keeps its stream busy: a gradient made ready late."""

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles on this node's stream
        return Identity.backward(ctx, grad)


def _loss(params, coefs, side: torch.cuda.Stream | None, late: bool = True):
    """Parameter 0 is used last (its gradient comes first in backward); with ``side`` its forward
    runs on that stream, behind a node whose backward is slow (``late``)."""
    total = sum((p * c).sum() for p, c in zip(params[1:], coefs[1:]))
    if side is None:
        return total + (params[0] * coefs[0]).sum()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        last = ((LateGradient if late else Identity).apply(params[0]) * coefs[0]).sum()
    torch.cuda.current_stream().wait_stream(side)
    return total + last


def _unfused_step(opt):
    """The baseline's step, synchronised: a gradient made on a side stream and read by ``step()``
    on another would otherwise be freed (``zero_grad``) and its memory reused on the side stream
    while the update still reads it (the user's to guard with ``record_stream``, as with torch's
    optimizers)."""
    opt.step()
    torch.cuda.synchronize()


def _train(fused: bool, monkeypatch, side_forward=False, backward_on_side=False, steps=3, late=True, **options):
    # 1 MiB: backward reaches parameter 0 first (held), then 3 (4 MiB: drains both, mid-backward),
    # then 2 and 1 (held until the end of backward)
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "1")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to("cuda", torch.bfloat16)) for n in SIZES]
    coefs_per_step = [[torch.randn(n, generator=gen).to("cuda", torch.bfloat16) for n in SIZES] for _ in range(steps)]
    opt = fusedopt.AdamW(params, lr=1e-2, fused=fused, **options)
    side = torch.cuda.Stream()
    seen = []
    for coefs in coefs_per_step:
        loss = _loss(params, coefs, side if side_forward else None, late)
        if backward_on_side:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss.backward()
                seen.append([p.detach().clone() for p in params])  # on the caller's stream, no sync
                if not fused:
                    _unfused_step(opt)
                opt.zero_grad()
            torch.cuda.current_stream().wait_stream(side)
        else:
            loss.backward()
            seen.append([p.detach().clone() for p in params])
            if not fused:
                _unfused_step(opt)
            opt.zero_grad()
        if fused:
            opt.step()  # nothing left to update: starts the next accumulation window
    torch.cuda.synchronize()
    return [p.detach().cpu() for p in params], [[t.cpu() for t in step] for step in seen]


def _assert_same_updates(released, unfused):
    (final_r, seen_r), (final_u, seen_u) = released, unfused
    for a, b in zip(final_r, final_u):
        assert torch.equal(a, b)
    # what the caller's stream saw right after backward: released, the step's updates; unfused,
    # the parameters before them (its step() comes later): so compare with the next step's view
    for step_r, step_u in zip(seen_r[:-1], seen_u[1:]):
        for a, b in zip(step_r, step_u):
            assert torch.equal(a, b)


def test_held_updates_on_the_default_stream(monkeypatch):
    _assert_same_updates(_train(True, monkeypatch), _train(False, monkeypatch))


def test_a_gradient_made_ready_on_a_side_stream(monkeypatch):
    _assert_same_updates(_train(True, monkeypatch, side_forward=True), _train(False, monkeypatch, side_forward=True))


def test_clipping_folds_a_side_streams_gradient_in_the_order_the_hooks_ran(monkeypatch):
    """Release clipping keeps one history: the batch of parameter 0 (made ready on a side stream,
    late) must fold into it before the batches the default stream clips after it, as when it is
    made ready at once; otherwise the later batches' estimates miss it."""
    options = dict(max_grad_norm=0.5, side_forward=True, steps=4)
    late = _train(True, monkeypatch, **options)
    prompt = _train(True, monkeypatch, late=False, **options)
    _assert_same(late, prompt)
    unclipped = _train(True, monkeypatch, side_forward=True, steps=4)
    assert not torch.equal(late[0][1], unclipped[0][1])  # it clips


def _assert_same(a, b):
    for x, y in zip(a[0] + [t for step in a[1] for t in step], b[0] + [t for step in b[1] for t in step]):
        assert torch.equal(x, y)


def test_backward_called_on_a_side_stream(monkeypatch):
    _assert_same_updates(
        _train(True, monkeypatch, backward_on_side=True), _train(False, monkeypatch, backward_on_side=True)
    )


# Accumulation buffers (accumulation_steps > 1) live from one backward pass to the next and may be
# written and read on different streams. The buffer is micro-batch 1's gradient: its memory belongs
# to the stream where autograd made it.

N_ACCUM = 1 << 21  # bf16, 4 MiB per gradient: every parameter the same size (one allocator block size)


def _accumulate(scenario: str | None, windows=3):
    """fused=True, accumulation_steps=2, two bf16 parameters; the final parameters and moments.

    Each micro-batch's graph is dropped after its backward: autograd keeps a parameter's
    AccumulateGrad node (and runs its hook on the node's stream) while a graph refers to it, so a
    live ``loss`` would keep every micro-batch's hook on the first one's stream.

    ``scenario``:
    * None: every stream the default one (the expected bits);
    * "freed_buffer": micro-batch 1 runs parameter 0's forward on a side stream, so the buffer's
      memory belongs to that stream; micro-batch 2 runs it on the default stream behind a slow
      node, so its update from the buffer is queued behind a sleep, and the buffer is dropped.
      Right after backward the side stream fills new tensors: without ``record_stream`` the
      allocator hands them the buffer's memory, written before the update reads it;
    * "caller_streams": each micro-batch's forward and backward run under its own side stream,
      the two not ordered: micro-batch 1's gradient of parameter 0 is made late, and micro-batch 2
      adds to it (and updates) on the other stream.
    """
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(N_ACCUM, generator=gen).to("cuda", torch.bfloat16)) for _ in range(2)]
    coefs = [
        [[torch.randn(N_ACCUM, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)] for _ in range(2)]
        for _ in range(windows)
    ]
    opt = fusedopt.AdamW(params, lr=1e-2, fused=True, accumulation_steps=2)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()  # every input is ready: the side streams need not wait for anything
    for window in coefs:
        for micro_batch, (c0, c1) in enumerate(window):
            if scenario is None:
                loss = (params[1] * c1).sum() + (params[0] * c0).sum()
                loss.backward()
                del loss
            elif scenario == "freed_buffer":
                side = streams[0]
                if micro_batch == 0:
                    with torch.cuda.stream(side):
                        term0 = (Identity.apply(params[0]) * c0).sum()
                    torch.cuda.current_stream().wait_stream(side)
                else:
                    term0 = (LateGradient.apply(params[0]) * c0).sum()
                loss = (params[1] * c1).sum() + term0
                loss.backward()
                del loss, term0
                with torch.cuda.stream(side):  # the side stream does not wait for the sleeping default one
                    junk = [torch.full((N_ACCUM,), 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
                del junk
            else:
                with torch.cuda.stream(streams[micro_batch]):
                    op = LateGradient.apply if micro_batch == 0 else Identity.apply
                    loss = (params[1] * c1).sum() + (op(params[0]) * c0).sum()
                    loss.backward()
                    del loss
        torch.cuda.synchronize()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    state = [{k: v.cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]
    return [p.detach().cpu() for p in params], state


@pytest.mark.parametrize("scenario", ["freed_buffer", "caller_streams"])
def test_accumulation_buffers_across_streams(scenario):
    (expected, expected_state), (got, got_state) = _accumulate(None), _accumulate(scenario)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    for a, b in zip(expected_state, got_state):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
