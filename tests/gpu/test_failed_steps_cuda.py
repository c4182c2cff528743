"""A failed releasing backward on the GPU (tests/test_failed_steps.py on CUDA): the default format and
``norm2-root4`` through their kernels, updates held for buckets, backward run on the engine's device
threads. The pass that stopped early is noticed at ``zero_grad()``; the updates it ran stay, what it
held is dropped, and the next batches equal those of a fresh optimizer loaded from its checkpoint."""

import pytest
import torch
from cases import ALGORITHM
from helpers import OutOfMemory
from test_failed_steps import (
    FAULTS,
    LAYERS,
    CheckpointedLoop,
    _batches,
    _build,
    _check_closed_and_resumable,
    _fail_a_step,
    _steps,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FORMATS = [pytest.param({}, id="default"), pytest.param({"state_format": "norm2-root4"}, id="norm2-root4")]
# a fault in the launch of held updates needs held updates: plain passes (accumulated bf16 gradients
# are updated at once, from the optimizer's buffer)
CASES = [("middle", m) for m in ("plain", "accumulation-second", "clipping")]
CASES += [("last", "plain"), ("flush", "plain"), ("flush", "clipping")]


@pytest.mark.parametrize("where, mode", [pytest.param(w, m, id=f"{w}-{m}") for w, m in CASES])
@pytest.mark.parametrize("options", FORMATS)
def test_a_failed_backward_on_the_gpu_is_closed_and_the_next_batch_trains(options, where, mode, monkeypatch):
    algorithm, dtype = ALGORITHM["adamw"], torch.bfloat16
    loop = _build(algorithm, dtype, mode, device="cuda", **options)
    loop.train(_batches(2 * loop.k, dtype, device="cuda"))  # the second step's updates are held
    params = [p.detach().clone() for p in loop.model.parameters()]
    steps = _steps(loop.opt)
    held = [loop.opt.can_hold_update(p) and mode != "accumulation-second" for p in loop.model.parameters()]
    assert any(held) or mode == "accumulation-second"
    reached = [where == "flush" or i // 2 > FAULTS[where] for i in range(2 * LAYERS)]
    updated = [r and not h for r, h in zip(reached, held)]
    _fail_a_step(loop, where, mode, _batches(1, dtype, seed=3, device="cuda")[0], monkeypatch)
    with pytest.warns(UserWarning, match=rf"stopped early.*; {sum(updated)} parameter update\(s\)"):
        loop.opt.zero_grad()
    assert loop.opt.num_interrupted_steps == 1
    exact = mode != "clipping"  # (see _check_closed_and_resumable)
    _check_closed_and_resumable(loop, params, steps, updated, algorithm, dtype, mode, exact, **options)


@pytest.mark.parametrize("kind, nested", [("recompute", False), ("recompute", True), ("half", True)])
@pytest.mark.parametrize("options", FORMATS)
def test_a_failed_recomputation_under_reentrant_checkpointing_on_the_gpu_is_closed(options, kind, nested):
    """Out of memory in a layer's recomputation under reentrant checkpointing, after the nested passes of
    the layers above it ran (and launched their held updates at their ends), on the device threads; with
    checkpoints nested in checkpoints, in a layer's or a half's recomputation."""
    algorithm, dtype, layer = ALGORITHM["adamw"], torch.bfloat16, 1
    plain = _build(algorithm, dtype, "plain", device="cuda", **options)
    loop = CheckpointedLoop(plain.model, plain.opt, plain.k, plain.scaler)
    loop.nested = nested
    loop.train(_batches(2, dtype, device="cuda"))
    params = [p.detach().clone() for p in loop.model.parameters()]
    steps = _steps(loop.opt)
    OutOfMemory.armed = True
    with pytest.raises(torch.OutOfMemoryError):
        loop.backward(_batches(1, dtype, seed=3, device="cuda")[0], (kind, layer))
    updated = [i > layer for i in range(LAYERS) for _ in range(2)]
    with pytest.warns(UserWarning, match=rf"stopped early.*; {sum(updated)} parameter update\(s\)"):
        loop.opt.zero_grad()
    assert loop.opt.num_interrupted_steps == 1
    _check_closed_and_resumable(loop, params, steps, updated, algorithm, dtype, "plain", True, **options)
