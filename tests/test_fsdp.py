"""FSDP2 (``fully_shard``), ``replicate`` and DDP on CPU: gloo, two processes (one spawn per test).

Each test runs a worker function in every rank (``spawn``); a worker raises on a failed check,
which fails the test with the rank's traceback. Models shard every weight's rows on a multiple of
16 elements where a test compares against one process, so the quantisation blocks of a shard are
the whole parameter's blocks (the random draws are indexed by global element, docs say why).
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist

import fusedopt
from fusedopt.sharding import as_sharded, is_sharded, local

# Loss normalisation: each rank takes the mean over its half of the global batch; FSDP2 and DDP
# average the ranks' gradients, which is the gradient of the mean over the global batch.
BATCH = 8
FORMATS = [(bits, dtype) for bits in (32, 16, 8, 4) for dtype in (torch.float32, torch.bfloat16)]
ALGORITHMS = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "SGD": dict(lr=1e-1, momentum=0.9, weight_decay=0.01),
    "Lion": dict(lr=1e-3, weight_decay=0.1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, *args, world_size: int = 2) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes of one gloo group."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)


# --- models and loops --------------------------------------------------------------------


def make_mlp(dtype=torch.float32, seed=0) -> torch.nn.Module:
    """Weights (64, 16) and (32, 64), biases of 64 and 32: every shard of 2 ranks starts on a
    multiple of 16 elements. The head (5, 32) and its bias (5,) shard unevenly (3 + 2 rows)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5)
    )
    return model.to(dtype)


def shard(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def batch(step: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=gen).to(dtype)


def local_batch(step: int, rank: int, world_size: int, dtype=torch.float32) -> torch.Tensor:
    n = BATCH // world_size
    return batch(step, dtype)[rank * n : (rank + 1) * n]


def loss_of(model, x) -> torch.Tensor:
    return model(x).float().square().mean()  # the mean over this rank's part of the batch


def train(model, opt, rank, world_size, steps, first_step=0, dtype=torch.float32, micro=1, no_sync=False):
    """``steps`` optimizer steps of ``micro`` micro-batches each (the batch's rows split among them)."""
    for step in range(first_step, first_step + steps):
        x = local_batch(step, rank, world_size, dtype)
        for i, part in enumerate(x.chunk(micro)):
            if no_sync:
                model.set_requires_gradient_sync(i == micro - 1)
            (loss_of(model, part) / micro).backward()
        opt.step()
        opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def params_of(model) -> list[torch.Tensor]:
    return [full(p.detach()).clone() for p in model.parameters()]


def state_of(opt) -> list[torch.Tensor]:
    """Every parameter's decoded state (as torch.optim keeps it) and fp32 master, gathered."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            out.append(full(opt.master_weight(p)))
            group_codecs = opt.codecs(p, group) if state else {}
            for slot, codec in group_codecs.items():
                value = codec.decode({s: state[slot + s] for s in codec.suffixes}).float()
                out.append(full(as_sharded(p, value.reshape(local(p).shape)) if is_sharded(p) else value))
    return out


def assert_equal(ours, theirs, what: str) -> None:
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: tensor {i} differs, max {(a - b).abs().max()}"


# --- exact mode against torch.optim.AdamW ------------------------------------------------


def _exact_vs_torch(rank, world_size):
    reference = make_mlp()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    train(reference, torch_opt, 0, 1, steps=5)  # one process, the whole batch
    expected = params_of(reference)
    for fused in (False, True):
        model = shard(make_mlp())
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_bits=32, fused=fused)
        train(model, opt, rank, world_size, steps=5)
        for got, want in zip(params_of(model), expected):
            # the ranks' gradients are averaged: a rounding of the batch mean another order gives
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert all(int(opt.state[p]["step"]) == 5 for p in model.parameters())


def test_exact_mode_under_fsdp2_equals_torch_adamw_in_one_process():
    spawn(_exact_vs_torch)


# --- fused=True equals fused=False, every format -----------------------------------------


def _fused_vs_unfused(rank, world_size):
    for name, hyper in ALGORITHMS.items():
        for bits, dtype in FORMATS:
            results = []
            for fused in (False, True):
                model = shard(make_mlp(dtype))
                opt = getattr(fusedopt, name)(
                    model.parameters(), state_bits=bits, min_compress_numel=0, fused=fused, **hyper
                )
                train(model, opt, rank, world_size, steps=2, dtype=dtype)
                results.append((params_of(model), state_of(opt)))
                if fused:
                    assert all(p.grad is None for p in model.parameters())  # released in backward
            before = params_of(shard(make_mlp(dtype)))
            assert not any(torch.equal(a, b) for a, b in zip(results[0][0], before)), "nothing was trained"
            what = f"{name} state_bits={bits} {dtype}"
            assert_equal(results[1][0], results[0][0], what + " parameters")
            assert_equal(results[1][1], results[0][1], what + " state")


def test_fused_equals_unfused_under_fsdp2_for_every_format():
    spawn(_fused_vs_unfused)


# --- 2 ranks equal 1 process given the same gradients ------------------------------------


def _two_ranks_vs_one(rank, world_size):
    """The reduced gradients, gathered, drive a plain (unsharded) optimizer in every rank: shards
    on 2 ranks must hold exactly the single process's state and parameters."""
    for bits, dtype in FORMATS:
        model = shard(make_mlp(dtype))
        plain = make_mlp(dtype)
        kwargs = dict(lr=1e-2, weight_decay=0.1, state_bits=bits, min_compress_numel=0)
        opt, plain_opt = fusedopt.AdamW(model.parameters(), **kwargs), fusedopt.AdamW(plain.parameters(), **kwargs)
        for step in range(3):
            loss_of(model, local_batch(step, rank, world_size, dtype)).backward()
            for p, q in zip(model.parameters(), plain.parameters()):
                q.grad = full(p.grad)
            opt.step()
            plain_opt.step()
            opt.zero_grad()
            plain_opt.zero_grad()
        what = f"state_bits={bits} {dtype}"
        assert_equal(params_of(model), params_of(plain), what + " parameters")
        assert_equal(state_of(opt), state_of(plain_opt), what + " state")


def test_compressed_state_on_two_ranks_equals_one_process_given_the_same_gradients():
    spawn(_two_ranks_vs_one)
