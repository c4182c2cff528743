"""What a failed step leaves behind with gradient release (``fused=True``).

A backward pass that stops early (here: an out-of-memory error raised between two layers) has already
updated the layers after the fault. The optimizer notices it at its next call, or at the next pass's
first hook, and closes the step: the updates that ran stay, every other parameter skips the step,
held and accumulated gradients are dropped, a warning and ``num_interrupted_steps`` say so. Each case
then checks the updated set, every step count, finite state, a bit-exact checkpoint round trip, and
that the next batch trains exactly as a fresh optimizer loaded from that checkpoint does (so nothing
of the failed batch leaked into it)."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from cases import ALGORITHM, algorithm_cases, cross, dtype_cases
from helpers import OutOfMemory, save_load

import fusedopt

WIDTHS = (24, 72, 56, 40, 16)  # four layers; weights big enough to compress with min_compress_numel=0
LAYERS = len(WIDTHS) - 1
# Where the fault sits, in backward order: before any hook ran (the optimizer never hears of the pass),
# in the first update (its allocation fails; with buckets: in the end-of-backward launch of what was
# held), after two layers, after all but the first.
FAULTS = {"before-hooks": LAYERS - 1, "first-update": None, "middle": 1, "last": 0}


def _model(dtype, seed=0, device="cpu") -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])).to(device, dtype)


def _loss(model, x, fault_after: int | None = None) -> torch.Tensor:
    """Forward through every layer; the fault sits after layer ``fault_after`` (its backward runs
    after the hooks of the layers above it and before that layer's own)."""
    for i, layer in enumerate(model):
        x = torch.tanh(layer(x))
        if i == fault_after:
            x = OutOfMemory.apply(x)
    return x.float().pow(2).mean()


def _batches(n, dtype, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, WIDTHS[0], generator=gen).to(device, dtype) for _ in range(n)]


class Loop:
    """One model and optimizer and the user's loop: ``k`` backward passes per ``step()``, fp16-style
    loss scaling with a scaler when given."""

    def __init__(self, model, opt, k, scaler=None):
        self.model, self.opt, self.k, self.scaler = model, opt, k, scaler

    def backward(self, x, fault_after=None):
        loss = _loss(self.model, x, fault_after)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self):
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()

    def train(self, xs):
        for i in range(0, len(xs), self.k):
            for x in xs[i : i + self.k]:
                self.backward(x)
            self.step()


def _build(algorithm, dtype, mode, model=None, device="cpu", **options):
    model = model if model is not None else _model(dtype, device=device)
    k = 2 if mode.startswith("accumulation") else 1
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10) if mode == "scaler" else None
    opt = algorithm.make(
        model.parameters(),
        lr=1e-2,
        min_compress_numel=0,
        fused=True,
        accumulation_steps=k,
        max_grad_norm=0.05 if mode == "clipping" else None,
        grad_scaler=scaler,
        **options,
    )
    return Loop(model, opt, k, scaler)


def _steps(opt) -> list[int]:
    return [int(opt.state[p]["step"]) if p in opt.state else 0 for g in opt.param_groups for p in g["params"]]


def _assert_same(a, b, where=""):
    """Nested state dicts (or tensors) equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _assert_finite_state(opt):
    for state in opt.state.values():
        for name, t in state.items():
            if t.is_floating_point():
                assert torch.isfinite(t).all(), name


def _fail_once(monkeypatch, name):
    """Make ``UpdateDispatcher.<name>`` raise an out-of-memory error at its next call (once)."""
    original = getattr(fusedopt.dispatch.UpdateDispatcher, name)

    def failing(*args, **kwargs):
        monkeypatch.setattr(fusedopt.dispatch.UpdateDispatcher, name, original)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    monkeypatch.setattr(fusedopt.dispatch.UpdateDispatcher, name, failing)
    return original


def _fail_a_step(loop, where, mode, x, monkeypatch):
    """The user's batch that runs out of memory: with accumulation, in the first or second micro-batch.
    ``where="flush"``: in the launch of the updates held for buckets, at the end of backward."""
    if mode == "accumulation-second":
        loop.backward(x)
    name = {"first-update": "update", "flush": "_launch_bucket"}.get(where)
    original = _fail_once(monkeypatch, name) if name else None
    OutOfMemory.armed = name is None
    with pytest.raises(torch.OutOfMemoryError):
        loop.backward(x, FAULTS.get(where))
    assert not OutOfMemory.armed
    if name:
        assert getattr(fusedopt.dispatch.UpdateDispatcher, name) is original  # it was called


def _updated_by_failure(mode, where) -> list[bool]:
    """Which parameters (weight, bias per layer) the failed pass updated before it stopped."""
    releases = mode != "accumulation-first" and where in ("middle", "last")
    return [releases and layer > FAULTS[where] for layer in range(LAYERS) for _ in range(2)]


def _expect_closing(where):
    """The warning of the closed step; a pass that stopped before its first hook left nothing to close."""
    if where == "before-hooks":
        return warnings.catch_warnings(record=True)
    return pytest.warns(UserWarning, match=r"stopped early")


def _check_closed_and_resumable(
    loop, before_params, before_steps, updated, algorithm, dtype, mode, twin_equal=True, **options
):
    """The failed step closed: ``updated`` says which parameters it updated. Then a checkpoint round trip,
    and the next batches against a fresh optimizer loaded from that checkpoint: equal bit for bit when
    ``twin_equal`` (not where clipping sees the fresh optimizer's first updates one by one and the old
    one's in buckets, which it estimates in other batches)."""
    opt = loop.opt
    params = [p for g in opt.param_groups for p in g["params"]]
    assert [int(s) for s in _steps(opt)] == [s + u for s, u in zip(before_steps, updated)]
    for p, b, u in zip(params, before_params, updated):
        assert torch.equal(p.detach(), b) != u, "an updated parameter changed; the others are untouched"
        assert p.grad is None
    assert opt.held_gradients() == []
    closed = opt.num_interrupted_steps
    _assert_finite_state(opt)

    saved = save_load(opt.state_dict())
    device = before_params[0].device
    twin = _build(algorithm, dtype, mode, copy.deepcopy(loop.model), device, **options)
    twin.opt.load_state_dict(saved)
    _assert_same(saved, twin.opt.state_dict(), "round trip")
    assert saved["fusedopt"]["num_interrupted_steps"] == closed
    if loop.scaler is not None:
        assert loop.scaler.get_scale() == 2.0**10  # no overflow was reported for the failed step
        twin.scaler.load_state_dict(loop.scaler.state_dict())

    xs = _batches(2 * loop.k, dtype, seed=7, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the step was closed once: no second warning
        loop.train(xs)
        twin.train(xs)
    if twin_equal:
        _assert_same(loop.opt.state_dict(), twin.opt.state_dict(), "after the next batches")
        for p, q in zip(loop.model.parameters(), twin.model.parameters()):
            assert torch.equal(p, q)
    _assert_finite_state(opt)
    assert [s - b for s, b in zip(_steps(opt), before_steps)] == [2 + u for u in updated]


def _finish_the_next_window(loop, dtype, steps, updated):
    """After a failed step closed by the next backward, which opened a new window: the rest of that window
    and its step, without another warning; every parameter one step on, those the failed pass updated two."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for x in _batches(loop.k - 1, dtype, seed=10):
            loop.backward(x)
        loop.step()
    assert [s - b for s, b in zip(_steps(loop.opt), steps)] == [1 + u for u in updated]
    _assert_finite_state(loop.opt)
    assert loop.opt.num_interrupted_steps == 1


MODES = ("plain", "accumulation-first", "accumulation-second", "clipping", "scaler")
ALGORITHMS = algorithm_cases("adamw", "sgd-momentum", "lion", "adafactor")


# the first of two micro-batches updates nothing, so no update can fail in it
CASES = [(w, m) for m in MODES for w in FAULTS if (w, m) != ("first-update", "accumulation-first")]


@pytest.mark.parametrize("where, mode", [pytest.param(w, m, id=f"{w}-{m}") for w, m in CASES])
@pytest.mark.parametrize("algorithm, dtype", cross(ALGORITHMS, dtype_cases(torch.float32, torch.bfloat16)))
def test_a_failed_backward_is_closed_at_zero_grad_and_the_next_batch_trains(algorithm, dtype, where, mode, monkeypatch):
    loop = _build(algorithm, dtype, mode)
    loop.train(_batches(2 * loop.k, dtype))
    params = [p.detach().clone() for p in loop.model.parameters()]
    steps = _steps(loop.opt)
    _fail_a_step(loop, where, mode, _batches(1, dtype, seed=3)[0], monkeypatch)
    updated = _updated_by_failure(mode, where)
    with _expect_closing(where) as record:
        loop.opt.zero_grad()
    if where == "before-hooks":
        assert [str(w.message) for w in record] == [] and loop.opt.num_interrupted_steps == 0
    else:
        assert f"; {sum(updated)} parameter update(s)" in str(record[0].message)
        assert len(record) == 1 and loop.opt.num_interrupted_steps == 1
    _check_closed_and_resumable(loop, params, steps, updated, algorithm, dtype, mode)


@pytest.mark.parametrize("recovery", ["next-backward", "step", "state_dict", "reload"])
@pytest.mark.parametrize("mode", ["plain", "accumulation-second", "clipping", "scaler"])
@pytest.mark.parametrize("dtype", dtype_cases(torch.float32, torch.bfloat16))
def test_every_entry_point_closes_a_failed_backward(recovery, mode, dtype, monkeypatch):
    """The next backward (no zero_grad: bf16 accumulates in the optimizer's buffers, float32 in p.grad),
    step() (a loop that steps whatever happened: with a scaler, scaler.step(opt) and scaler.update()),
    state_dict() and a reload of the last checkpoint."""
    algorithm = ALGORITHM["adamw"]
    loop = _build(algorithm, dtype, mode)
    loop.train(_batches(2 * loop.k, dtype))
    checkpoint = save_load({"model": loop.model.state_dict(), "opt": loop.opt.state_dict()})
    params = [p.detach().clone() for p in loop.model.parameters()]
    steps = _steps(loop.opt)
    _fail_a_step(loop, "middle", mode, _batches(1, dtype, seed=3)[0], monkeypatch)
    updated = _updated_by_failure(mode, "middle")
    with pytest.warns(UserWarning, match=rf"stopped early.*; {sum(updated)} parameter update\(s\)"):
        if recovery == "next-backward":
            loop.backward(_batches(1, dtype, seed=9)[0])
        elif recovery == "step":
            loop.step()
        elif recovery == "state_dict":
            loop.opt.state_dict()
        else:
            loop.model.load_state_dict(checkpoint["model"])
            loop.opt.load_state_dict(checkpoint["opt"])
    if recovery == "reload":
        _assert_same(checkpoint["opt"]["state"], loop.opt.state_dict()["state"])
        assert _steps(loop.opt) == steps
        return
    if recovery == "next-backward":
        _finish_the_next_window(loop, dtype, steps, updated)
        return
    _check_closed_and_resumable(loop, params, steps, updated, algorithm, dtype, mode)


class CheckpointedLoop(Loop):
    """The loop with every layer a reentrant activation checkpoint (``use_reentrant=True``, as Hugging Face's
    gradient checkpointing by default): each layer's backward runs as a pass of its own, nested in the pass
    that recomputes the layers. ``nested``: checkpoints in checkpoints (``_checkpointed_loss``)."""

    nested = False

    def backward(self, x, fault=None):
        loss = _checkpointed_loss(self.model, x, *(fault or (None, None)), nested=self.nested)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()


def _checkpointed_loss(model, x, kind=None, layer=None, nested=False):
    """``_loss`` through reentrant checkpoints; the fault in ``layer``'s recomputation (``kind="recompute"``:
    in the outer pass, after the nested passes of the layers above it ended) or in its nested backward
    (``"nested"``), or in a hook on the gradient of its output, which runs in the outer pass before anything
    below it (``"hook"``). ``nested``: each half of the layers a checkpoint too, so a layer's backward is a
    pass nested in a nested pass; ``kind="half"``: the fault in the recomputation of ``layer``'s half (in
    the outermost pass)."""
    from torch.utils.checkpoint import checkpoint

    def segment(i, t):
        if kind == "recompute" and i == layer:
            OutOfMemory.fail_in_recomputation()
        t = torch.tanh(model[i](t))
        return OutOfMemory.apply(t) if kind == "nested" and i == layer else t

    def half(first, t):
        if kind == "half" and first <= layer < first + LAYERS // 2:
            OutOfMemory.fail_in_recomputation()
        for i in range(first, first + LAYERS // 2):  # (the half's first forward, without grad, checkpoints nothing)
            t = checkpoint(segment, i, t, use_reentrant=True) if torch.is_grad_enabled() else segment(i, t)
        return t

    x = x.detach().requires_grad_(True)  # a checkpoint passes gradients only to inputs that require them
    if nested:
        for first in (0, LAYERS // 2):
            x = checkpoint(half, first, x, use_reentrant=True)
    else:
        for i in range(LAYERS):
            x = checkpoint(segment, i, x, use_reentrant=True)
            if kind == "hook" and i == layer:
                x.register_hook(lambda g: OutOfMemory.fail() or g)
    return x.float().pow(2).mean()


@pytest.mark.parametrize(
    "kind, layer, nested",
    [
        ("recompute", 1, False),
        ("recompute", 0, False),
        ("nested", 1, False),
        ("hook", LAYERS - 2, False),
        ("recompute", 1, True),
        ("half", 1, True),
    ],
)
@pytest.mark.parametrize("recovery", ["zero_grad", "next-backward"])
@pytest.mark.parametrize("mode", ["plain", "accumulation-second", "scaler"])
@pytest.mark.parametrize("dtype", dtype_cases(torch.float32, torch.bfloat16))
def test_a_failure_under_reentrant_checkpointing_is_closed(kind, layer, nested, recovery, mode, dtype):
    """Out of memory while a layer is recomputed fails the outer pass after the nested passes of the layers
    above it ended and updated them, where no release hook of the outer pass itself ran: the step is still
    closed (the outer pass queues its end-of-pass marker too), so the retry trains instead of meeting
    parameters already updated in its window. Also a failure inside a nested pass, in a gradient hook as a
    checkpoint returns, and checkpoints nested in
    checkpoints: a layer's recomputation fails the pass of its half, a half's the outermost pass."""
    algorithm = ALGORITHM["adamw"]
    plain = _build(algorithm, dtype, mode)
    loop = CheckpointedLoop(plain.model, plain.opt, plain.k, plain.scaler)
    loop.nested = nested
    loop.train(_batches(2 * loop.k, dtype))
    params = [p.detach().clone() for p in loop.model.parameters()]
    steps = _steps(loop.opt)
    x = _batches(1, dtype, seed=3)[0]
    if mode == "accumulation-second":
        loop.backward(x)
    OutOfMemory.armed = True
    with pytest.raises(torch.OutOfMemoryError):
        loop.backward(x, (kind, layer))
    assert not OutOfMemory.armed
    updated = [i > layer for i in range(LAYERS) for _ in range(2)]
    with pytest.warns(UserWarning, match=rf"stopped early.*; {sum(updated)} parameter update\(s\)"):
        if recovery == "zero_grad":
            loop.opt.zero_grad()
        else:
            loop.backward(_batches(1, dtype, seed=9)[0])
    if recovery == "next-backward":
        _finish_the_next_window(loop, dtype, steps, updated)
        return
    assert loop.opt.num_interrupted_steps == 1
    _check_closed_and_resumable(loop, params, steps, updated, algorithm, dtype, mode)


@pytest.mark.parametrize("where, closed", [("middle", False), ("middle", True), ("first-update", False)])
def test_an_optimizer_dropped_after_a_failed_backward_says_what_the_pass_left(where, closed, monkeypatch):
    """A retry loop that builds a new optimizer over the same model (accelerate's find_executable_batch_size)
    drops the old one with its failed step never closed: the updates the pass applied stay in the parameters,
    and the optimizer's end says so, once. Closed first (zero_grad), failed in its first update (nothing
    applied), or after plain training, it says nothing."""
    loop = _build(ALGORITHM["adamw"], torch.float32, "plain")
    loop.train(_batches(2, torch.float32))
    _fail_a_step(loop, where, "plain", _batches(1, torch.float32, seed=3)[0], monkeypatch)
    if closed:
        with pytest.warns(UserWarning, match="stopped early"):
            loop.opt.zero_grad()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loop.opt = None
        gc.collect()
    dropped = [str(w.message) for w in record if "was dropped" in str(w.message)]
    updates = sum(_updated_by_failure("plain", where))
    assert len(dropped) == (0 if closed or not updates else 1)
    assert all(f"the {updates} parameter update(s) the pass had already applied stay" in m for m in dropped)
    fresh = _build(ALGORITHM["adamw"], torch.float32, "plain", model=loop.model)  # the hooks went with it
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fresh.train(_batches(2, torch.float32, seed=5))
        fresh.opt = None
        gc.collect()


def test_a_float32_partial_accumulation_left_in_p_grad_is_refused_not_added_to(monkeypatch):
    """float32 gradients accumulate in p.grad, where a pass that failed in the first micro-batch left its
    partial sum; the next pass adds to it before any hook runs. As with torch.optim, zero_grad() clears
    it: the next pass says so instead of updating from the sum, and after zero_grad() training goes on."""
    loop = _build(ALGORITHM["adamw"], torch.float32, "accumulation-first")
    loop.train(_batches(2, torch.float32))
    steps = _steps(loop.opt)
    _fail_a_step(loop, "middle", "accumulation-first", _batches(1, torch.float32, seed=3)[0], monkeypatch)
    with pytest.warns(UserWarning, match="stopped early"), pytest.raises(RuntimeError, match=r"zero_grad\(\)"):
        loop.backward(_batches(1, torch.float32, seed=9)[0])
    assert all(p.grad is None for p in loop.model.parameters())  # the sum is dropped, not left to add to
    loop.opt.zero_grad()
    assert loop.opt.num_interrupted_steps == 1  # the refused pass stopped at its first hook: nothing to close
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loop.train(_batches(2, torch.float32, seed=11))
    assert _steps(loop.opt) == [s + 1 for s in steps]


@pytest.mark.parametrize("zeroing", ["optimizer", "model-in-place"])
def test_a_float32_partial_accumulation_zeroed_before_the_next_pass_trains(zeroing, monkeypatch):
    """The partial sum cleared before the next pass, by the optimizer's zero_grad() or by the model's
    zero_grad(set_to_none=False) (zeros in the same tensors): the next window trains from its own
    gradients only, as a twin that never failed does from the same state."""
    loop = _build(ALGORITHM["adamw"], torch.float32, "accumulation-first")
    loop.train(_batches(2, torch.float32))
    twin = _build(ALGORITHM["adamw"], torch.float32, "accumulation-first", copy.deepcopy(loop.model))
    twin.opt.load_state_dict(save_load(loop.opt.state_dict()))  # the failed first micro-batch updates nothing
    _fail_a_step(loop, "middle", "accumulation-first", _batches(1, torch.float32, seed=3)[0], monkeypatch)
    xs = _batches(2, torch.float32, seed=11)
    if zeroing == "optimizer":
        with pytest.warns(UserWarning, match="stopped early"):
            loop.opt.zero_grad()
        loop.train(xs)
    else:
        loop.model.zero_grad(set_to_none=False)  # the optimizer hears of the failure at the next pass
        assert all(p.grad is None or not p.grad.any() for p in loop.model.parameters())
        with pytest.warns(UserWarning, match="stopped early"):
            loop.train(xs)
    twin.train(xs)
    assert loop.opt.num_interrupted_steps == 1
    _assert_same(loop.opt.state_dict()["state"], twin.opt.state_dict()["state"])
    assert all(torch.equal(p, q) for p, q in zip(loop.model.parameters(), twin.model.parameters()))


@pytest.mark.parametrize("fail", [False, True])
def test_a_parameter_unfrozen_after_construction_is_released_and_skips_a_failed_step(fail):
    """Staged unfreezing: a parameter frozen when the optimizer was built gets its release hook once it
    requires gradients (at the first hook of the next backward). The last layer's bias accumulates
    before any hook of that pass runs: then step() updates it as torch.optim would, from then on it is
    released like the others; and if that first pass fails, the step() that closes it does not update
    the bias from the failed pass's gradient."""
    model = _model(torch.float32)
    twin = _build(ALGORITHM["adamw"], torch.float32, "plain", copy.deepcopy(model))
    unfrozen = model[LAYERS - 1].bias
    unfrozen.requires_grad_(False)
    loop = Loop(model, ALGORITHM["adamw"].make(model.parameters(), lr=1e-2, min_compress_numel=0, fused=True), 1)
    unfrozen.requires_grad_(True)
    if fail:
        before = [p.detach().clone() for p in model.parameters()]
        OutOfMemory.armed = True
        with pytest.raises(torch.OutOfMemoryError):
            loop.backward(_batches(1, torch.float32, seed=3)[0], FAULTS["middle"])
        assert unfrozen.grad is not None  # accumulated before its hook existed
        with pytest.warns(UserWarning, match="stopped early"):
            loop.step()
        updated = _updated_by_failure("plain", "middle")
        assert updated[2 * LAYERS - 1]  # the bias's slot: the others of its layer were released
        for i, (p, b) in enumerate(zip(model.parameters(), before)):
            assert torch.equal(p, b) != (updated[i] and p is not unfrozen) and p.grad is None
        assert unfrozen not in loop.opt.state or int(loop.opt.state[unfrozen]["step"]) == 0
        twin.opt.load_state_dict(save_load(loop.opt.state_dict()))
        for p, q in zip(twin.model.parameters(), model.parameters()):
            p.data.copy_(q)
    xs = _batches(2, torch.float32, seed=5)
    loop.backward(xs[0])
    assert (unfrozen.grad is None) == fail  # hooked at this pass's first hook, or the failed one's
    loop.step()
    loop.backward(xs[1])
    assert all(p.grad is None for p in model.parameters())  # released, the unfrozen bias too
    loop.step()
    twin.train(xs)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.model.parameters()))


@pytest.mark.parametrize("where", ["middle", "last", "flush"])
@pytest.mark.parametrize("state", [{}, {"state_format": "norm2-root4"}], ids=["default", "norm2-root4"])
def test_a_failed_backward_drops_the_updates_held_for_buckets(monkeypatch, device, state, where):
    """Kernel updates wait in buckets until the end of backward: a pass that fails before (or while
    launching them) updated nothing, and what it held never lands, at zero_grad() or later."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "64")
    model = _model(torch.bfloat16).to(device)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, min_compress_numel=0, fused=True, max_grad_norm=1.0, **state)
    loop = Loop(model, opt, 1)
    xs = [x.to(device) for x in _batches(4, torch.bfloat16)]
    loop.train(xs[:2])  # the second step's updates were held and bucketed
    assert opt._dispatch._built
    params = [p.detach().clone() for p in model.parameters()]
    steps = _steps(opt)
    reached = [where == "flush" or i // 2 > FAULTS[where] for i in range(2 * LAYERS)]  # hooks that ran
    held = [opt.can_hold_update(p) for p in model.parameters()]  # the others launch alone, in the hook
    assert any(held) and not all(held)
    updated = [r and not h for r, h in zip(reached, held)]
    _fail_a_step(loop, where, "plain", xs[2], monkeypatch)
    assert opt._release.holds_updates() == (where != "flush")  # the flush took them before it failed
    with pytest.warns(UserWarning, match=rf"stopped early.*; {sum(updated)} parameter update\(s\)"):
        opt.zero_grad()
    assert not opt._release.holds_updates() and not opt._dispatch._pending and opt.held_gradients() == []
    assert _steps(opt) == [s + u for s, u in zip(steps, updated)]
    for p, b, u in zip(model.parameters(), params, updated):
        assert torch.equal(p.detach(), b) != u and p.grad is None
    saved = save_load(opt.state_dict())
    twin_model = copy.deepcopy(model)
    twin = Loop(twin_model, fusedopt.AdamW(twin_model.parameters(), lr=1e-2, fused=True, max_grad_norm=1.0), 1)
    twin.opt.load_state_dict(saved)
    loop.train(xs[3:])
    twin.train(xs[3:])
    _assert_same(opt.state_dict(), twin.opt.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin_model.parameters()))
    assert _steps(opt) == [s + 1 + u for s, u in zip(steps, updated)]


def test_a_scaler_the_optimizer_was_not_given_is_refused_at_each_step_without_wedging_it():
    """The documented error at scaler.step(), every time, and never the misleading one from the next
    backward; once the optimizer is given the scaler, training goes on."""
    model = _model(torch.float32)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    xs = _batches(3, torch.float32)
    for x in xs[:2]:
        scaler.scale(_loss(model, x)).backward()
        with pytest.raises(RuntimeError, match=r"does not know it.*grad_scaler=scaler"):
            scaler.step(opt)
        assert opt._release.hooks_ran() is False and all(p.grad is None for p in model.parameters())
    steps = _steps(opt)
    opt.grad_scaler = scaler
    scaler.scale(_loss(model, xs[2])).backward()
    scaler.step(opt)
    scaler.update()
    assert _steps(opt) == [s + 1 for s in steps] and opt.num_interrupted_steps == 0


class _Shared(torch.nn.Module):
    """One weight used in two checkpointed segments (tied weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, reentrant):
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=reentrant)
        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=reentrant)
        return self.head(x).pow(2).mean()


def test_reentrant_checkpointing_of_a_shared_parameter_names_its_cause_and_recovers():
    model = _Shared()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=None)
    x = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"second gradient within one backward pass.*use_reentrant=False"):
        model(x, reentrant=True).backward()
    with pytest.warns(UserWarning, match="stopped early"):
        opt.zero_grad()
    model(x, reentrant=False).backward()  # the documented alternative: every gradient once, whole
    opt.step()
    assert opt.num_interrupted_steps == 1 and all(int(opt.state[p]["step"]) >= 1 for p in model.parameters())


def test_a_second_backward_without_accumulation_steps_names_the_setting():
    model = _model(torch.bfloat16)
    _opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=None)
    x = _batches(1, torch.bfloat16)[0]
    _loss(model, x).backward()
    with pytest.raises(RuntimeError, match=r"accumulation_steps=1.*pass the same number as accumulation_steps"):
        _loss(model, x).backward()


@pytest.mark.parametrize("retained", [False, True], ids=["new-graph", "retained-graph"])
def test_a_second_backward_refused_at_its_first_hook_leaves_the_finished_step_alone(retained):
    """The first pass updated everything; the second is refused at its first hook, before it changes
    anything. So step() finds a finished window, not a failed one: no closing warning, the first pass's
    grad_norm, and the next step trains as a twin's that never saw the second backward."""
    model = _model(torch.float32)
    model.shift = torch.nn.Parameter(torch.zeros(()))  # added last, not saved: its hook runs first in backward
    twin = copy.deepcopy(model)
    opts = [fusedopt.AdamW(m.parameters(), lr=1e-2, fused=True, max_grad_norm=1.0) for m in (model, twin)]
    xs = _batches(2, torch.float32)

    def loss_of(m, x):
        return _loss(m, x) + m.shift

    for m, opt in zip((model, twin), opts):
        loss = loss_of(m, xs[0])
        loss.backward(retain_graph=retained)
        if m is model:
            norm = opt.grad_norm.clone()
            with pytest.raises(RuntimeError, match="received a gradient after its update was already applied"):
                (loss if retained else loss_of(m, xs[0])).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            opt.step()
        opt.zero_grad()
    assert opts[0].num_interrupted_steps == 0 and torch.equal(opts[0].grad_norm, norm)
    for m, opt in zip((model, twin), opts):
        loss_of(m, xs[1]).backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    _assert_same(opts[0].state_dict()["state"], opts[1].state_dict()["state"])
