"""FSDP2 (``fully_shard``), ``replicate`` and DDP on CPU: gloo, two processes.

Every test is a scenario: a worker function run in every rank of a process group. The selected
tests' scenarios share one spawn per phase (starting a process costs seconds: importing torch and
torch._dynamo, which fully_shard imports): world size 1, then 2, then 1 again (checkpoints move
between them in that order). A scenario that raises fails its test with the rank's traceback and
ends its phase (the ranks' collectives would no longer match), failing the tests after it.
Models shard every weight on a multiple of 16 elements where a test compares against one process,
so a shard's quantisation blocks are the whole parameter's blocks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import OutOfMemory, spawned_rank, tiny_llama

import fusedopt
from fusedopt.codecs import decode_moments
from fusedopt.sharding import as_sharded, is_sharded, local

# Loss normalisation: each rank takes the mean over its part of the global batch; FSDP2 and DDP
# average the ranks' gradients, which is the gradient of the mean over the global batch.
BATCH = 8
FORMATS = [(bits, dtype) for bits in (32, 16, 8, 4) for dtype in (torch.float32, torch.bfloat16)]
ALGORITHMS = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "SGD": dict(lr=1e-1, momentum=0.9, weight_decay=0.01),
    "Lion": dict(lr=1e-3, weight_decay=0.1),
}
PHASES = ((1, "before"), (2, "main"), (1, "after"))  # (world size, name), run in this order


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phase_worker(rank: int, world_size: int, port: int, scenarios: list, out: str) -> None:
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    with spawned_rank():
        for name in scenarios:
            try:
                start = time.perf_counter()
                globals()[name](rank, world_size, Path(out))
                if rank == 0:
                    print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
            except BaseException:
                (Path(out) / f"{name}.rank{rank}.failed").write_text(traceback.format_exc())
                raise
            (Path(out) / f"{name}.rank{rank}.passed").touch()


def scenario(*workers):
    """A test made of ``(phase, worker)`` pairs: it passes when every rank of every phase ran them."""

    def test(fsdp_runs):
        for (_, phase), worker in workers:
            fsdp_runs.check(phase, worker.__name__)

    test.scenarios = [((world, phase), worker.__name__) for (world, phase), worker in workers]
    return test


class _Runs:
    def __init__(self, out: Path):
        self.out = out

    def check(self, phase, name):
        world = next(w for w, p in PHASES if p == phase)
        for rank in range(world):
            failed = self.out / f"{name}.rank{rank}.failed"
            if failed.exists():
                pytest.fail(f"{name} failed in rank {rank} of {world}:\n{failed.read_text()}", pytrace=False)
        missing = [rank for rank in range(world) if not (self.out / f"{name}.rank{rank}.passed").exists()]
        if missing:
            spawn_error = self.out / f"{phase}.spawn_error"
            why = "a scenario before it failed"
            if spawn_error.exists():
                why = f"its phase's processes failed before any scenario:\n{spawn_error.read_text()}"
            pytest.fail(f"{name} did not run in ranks {missing} ({why})", pytrace=False)


@pytest.fixture(scope="module")
def fsdp_runs(request, tmp_path_factory):
    """Run the selected tests' scenarios, one spawn per phase."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp")
    here = request.module.__name__
    selected = [item.function for item in request.session.items if item.module.__name__ == here]
    for world, phase in PHASES:
        names = [n for f in selected for (w, p), n in getattr(f, "scenarios", []) if p == phase]
        if not names:
            continue
        # A phase whose processes fail before any scenario starts (the free port taken by another
        # process before the rendezvous binds it) is started once more, on another port.
        ran = False
        for attempt in range(2):
            try:
                mp.spawn(_phase_worker, args=(world, _free_port(), names, str(out)), nprocs=world, join=True)
                ran = True
                break
            except Exception as error:
                if any(any(out.glob(f"{name}.rank*")) for name in names):
                    break  # a scenario ran: its failure is in its files, and the tests report it
                (out / f"{phase}.spawn_error").write_text(f"start {attempt + 1} of 2: {error!r}")
        if not ran:
            break  # later phases need this one's files
    return _Runs(out)


def spawn(fn, *args, world_size: int = 2) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (for experiments by hand)."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)


def _worker(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    with spawned_rank():
        fn(rank, world_size, *args)


ONE_BEFORE, TWO, ONE_AFTER = PHASES  # noqa: N816


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
    """FSDP2 over the ranks' CPUs (on a machine with a GPU too: fully_shard's default mesh would take CUDA, on
    which these gloo processes are not set up)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kwargs.setdefault("mesh", init_device_mesh("cpu", (dist.get_world_size(),)))
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
            stored = {slot: {s: state[slot + s] for s in codec.suffixes} for slot, codec in group_codecs.items()}
            values = decode_moments(group_codecs, stored, opt.frames)  # a framed one by its frame
            for slot in group_codecs:
                value = values[slot].float()
                out.append(full(as_sharded(p, value.reshape(local(p).shape)) if is_sharded(p) else value))
    return out


def assert_equal(ours, theirs, what: str) -> None:
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: tensor {i} differs, max {(a - b).abs().max()}"


# --- exact mode against torch.optim.AdamW ------------------------------------------------


def _exact_vs_torch(rank, world_size, out):
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


test_exact_mode_under_fsdp2_equals_torch_adamw_in_one_process = scenario((TWO, _exact_vs_torch))


# --- fused=True equals fused=False, every format -----------------------------------------


def _fused_vs_unfused(rank, world_size, out):
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


test_fused_equals_unfused_under_fsdp2_for_every_format = scenario((TWO, _fused_vs_unfused))


# --- 2 ranks equal 1 process given the same gradients ------------------------------------


def _two_ranks_vs_one(rank, world_size, out):
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


test_compressed_state_on_two_ranks_equals_one_process_given_the_same_gradients = scenario((TWO, _two_ranks_vs_one))


# --- accumulation --------------------------------------------------------------------------


def _accumulation(rank, world_size, out):
    """Two micro-batches per step: reduced every micro-batch with accumulation_steps=2, or with
    set_requires_gradient_sync(False) on the first (FSDP2 accumulates, the hooks fire once) and
    accumulation_steps=1 or 2. fused=True equals fused=False bit for bit in each."""
    for dtype in (torch.float32, torch.bfloat16):
        for no_sync, k in ((False, 2), (True, 1), (True, 2)):
            results = []
            for fused in (False, True):
                model = shard(make_mlp(dtype))
                opt = fusedopt.AdamW(
                    model.parameters(), lr=1e-2, state_bits=8, min_compress_numel=0, fused=fused, accumulation_steps=k
                )
                train(model, opt, rank, world_size, steps=2, dtype=dtype, micro=2, no_sync=no_sync)
                assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
                results.append((params_of(model), state_of(opt)))
            what = f"{dtype} no_sync={no_sync} accumulation_steps={k}"
            if dtype == torch.bfloat16 and not no_sync:
                # fused=True sums bf16 micro-batch gradients with stochastic rounding, FSDP2 into
                # .grad with nearest rounding (as in one process): equal up to bf16 rounding
                for a, b in zip(results[1][0], results[0][0]):
                    torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7)
                continue
            assert_equal(results[1][0], results[0][0], what + " parameters")
            assert_equal(results[1][1], results[0][1], what + " state")
    # released in backward: after the final micro-batch's backward no gradient is left
    model = shard(make_mlp())
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = local_batch(0, rank, world_size).chunk(2)
    model.set_requires_gradient_sync(False)
    loss_of(model, x[0]).backward()
    model.set_requires_gradient_sync(True)
    loss_of(model, x[1]).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())


test_accumulation_under_fsdp2 = scenario((TWO, _accumulation))


# --- clipping (fused=False) ----------------------------------------------------------------


def _clipping(rank, world_size, out):
    """max_grad_norm under FSDP2 equals torch's clip_grad_norm_ + AdamW in one process."""
    reference = make_mlp()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    norms = []
    for step in range(3):
        loss_of(reference, batch(step)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
        torch_opt.step()
        torch_opt.zero_grad()
    model = shard(make_mlp())
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=32, max_grad_norm=0.05)
    for step in range(3):
        loss_of(model, local_batch(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(full(opt.grad_norm), norms[step], rtol=1e-5, atol=0)
    assert norms[0] > 0.05  # the norm was clipped
    for got, want in zip(params_of(model), params_of(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


test_clipping_with_fused_false_under_fsdp2_equals_one_process = scenario((TWO, _clipping))


# --- clipping and loss scaling under release (fused=True) --------------------------------


def own_mesh():
    """A device mesh of this rank alone: ``fully_shard`` over it is a one-process run on the whole
    batch that calls the release hooks in the same order as the sharded run (plain autograd does not)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    return DeviceMesh.from_group(groups[dist.get_rank()], "cpu")


def train_step(model, opt, rank, world_size, step, dtype=torch.float32, scaler=None) -> torch.Tensor:
    """One step (with ``scaler``: fp16-style loss scaling); returns ``opt.grad_norm`` (gathered)."""
    loss = loss_of(model, local_batch(step, rank, world_size, dtype))
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()
    return None if opt.grad_norm is None else full(opt.grad_norm).clone()


def same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, t) for g in gathered)


def _release_clipping(rank, world_size, out):
    """max_grad_norm with fused=True: each parameter's norm is its whole gradient's (an all-reduce
    of the shards' squared norms), so every rank clips alike."""
    # nothing clips: fused=True equals fused=False bit for bit (4-bit state, bf16), and grad_norm is
    # the same norm (fused=False's is in the gradients' dtype, bf16; fp32 below)
    results = []
    for fused in (False, True):
        model = shard(make_mlp(torch.bfloat16))
        opt = fusedopt.AdamW(
            model.parameters(), lr=1e-2, state_bits=4, min_compress_numel=0, fused=fused, max_grad_norm=100.0
        )
        norms = [train_step(model, opt, rank, world_size, step, torch.bfloat16).float() for step in range(3)]
        results.append((params_of(model), state_of(opt), torch.stack(norms)))
    assert_equal(results[1][0], results[0][0], "nothing clipped, parameters")
    assert_equal(results[1][1], results[0][1], "nothing clipped, state")
    torch.testing.assert_close(results[1][2], results[0][2], rtol=2**-7, atol=0)
    # clipping at every step: 2 ranks equal one process (the same hook order) within fp32 round-off
    mesh = own_mesh()
    runs = []
    for alone in (False, True):  # "adagc": the default "scaled" estimate and a per-tensor average on top
        model = shard(make_mlp(), mesh=mesh) if alone else shard(make_mlp())
        opt = fusedopt.AdamW(
            model.parameters(), lr=1e-2, state_bits=32, fused=True, max_grad_norm=0.05, release_clipping="adagc"
        )
        ranks = (0, 1) if alone else (rank, world_size)
        norms = torch.stack([train_step(model, opt, *ranks, step) for step in range(4)])
        runs.append((params_of(model), norms))
    (two, two_norms), (one, one_norms) = runs
    assert (one_norms > 0.05).all(), one_norms  # clipped at every step
    assert same_on_every_rank(two_norms)
    torch.testing.assert_close(two_norms, one_norms, rtol=1e-5, atol=0)
    for got, want in zip(two, one):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # updates left to step(): set_requires_gradient_sync(False) on the first of two micro-batches
    # and accumulation_steps=2 (step() clips them, against the same reduced norms)
    runs = []
    for fused, alone, clip in ((False, False, 100.0), (True, False, 100.0), (True, False, 0.05), (True, True, 0.05)):
        model = shard(make_mlp(), mesh=mesh) if alone else shard(make_mlp())
        opt = fusedopt.AdamW(
            model.parameters(), lr=1e-2, state_bits=32, fused=fused, max_grad_norm=clip, accumulation_steps=2
        )
        ranks = (0, 1) if alone else (rank, world_size)
        norms = []
        for step in range(3):
            train(model, opt, *ranks, steps=1, first_step=step, micro=2, no_sync=True)
            norms.append(full(opt.grad_norm).float())
        runs.append((params_of(model), torch.stack(norms)))
    assert_equal(runs[1][0], runs[0][0], "accumulated in FSDP2, nothing clipped, parameters")
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-6, atol=0)
    assert (runs[3][1] > 0.05).all()
    torch.testing.assert_close(runs[2][1], runs[3][1], rtol=1e-5, atol=0)
    for got, want in zip(runs[2][0], runs[3][0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # HSDP: the replicas hold the same reduced gradient, so the norm is not summed over them
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = shard(make_mlp(), mesh=hsdp)
    opt = fusedopt.AdamW(
        model.parameters(), lr=1e-2, state_bits=32, fused=True, max_grad_norm=0.05, release_clipping="adagc"
    )
    norms = torch.stack([train_step(model, opt, rank, world_size, step) for step in range(4)])
    torch.testing.assert_close(norms, one_norms, rtol=1e-5, atol=0)
    for got, want in zip(params_of(model), one):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


test_clipping_with_fused_true_under_fsdp2 = scenario((TWO, _release_clipping))


def poison_on_rank(p: torch.Tensor, rank: int, when: dict) -> None:
    """Make one element of ``rank``'s shard of ``p``'s gradient infinite while ``when["now"]``: a hook
    registered before the optimizer's runs first, as an overflow in one shard would look to it."""

    def hook(param):
        if when["now"] and dist.get_rank() == rank:
            local(param.grad).view(-1)[0] = float("inf")

    p.register_post_accumulate_grad_hook(hook)


def _release_loss_scaling(rank, world_size, out):
    """grad_scaler with fused=True on sharded parameters."""
    # a power-of-two scale: bit for bit the unscaled run
    for bits, dtype in ((32, torch.float32), (8, torch.bfloat16)):
        results = []
        for scaled in (False, True):
            model = shard(make_mlp(dtype))
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None
            opt = fusedopt.AdamW(
                model.parameters(), lr=1e-2, state_bits=bits, min_compress_numel=0, fused=True, grad_scaler=scaler
            )
            for step in range(3):
                train_step(model, opt, rank, world_size, step, dtype, scaler)
            results.append((params_of(model), state_of(opt)))
        assert_equal(results[1][0], results[0][0], f"scaled, state_bits={bits} {dtype}, parameters")
        assert_equal(results[1][1], results[0][1], f"scaled, state_bits={bits} {dtype}, state")
    # an overflow in rank 1's shard of one weight skips that weight on both ranks (clipping or a
    # scaler makes the verdict common), and the scaler backs off on both
    for scaled, clip in ((True, None), (False, 0.05), (True, 0.05)):
        model = shard(make_mlp())
        target, when = model[2].weight, {"now": False}
        poison_on_rank(target, 1, when)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, grad_scaler=scaler, max_grad_norm=clip)
        train_step(model, opt, rank, world_size, 0, scaler=scaler)
        before = params_of(model)
        when["now"] = True
        train_step(model, opt, rank, world_size, 1, scaler=scaler)
        after = params_of(model)
        what = f"overflow in one shard, scaler={scaled} max_grad_norm={clip}"
        index = next(i for i, p in enumerate(model.parameters()) if p is target)
        for i, (a, b) in enumerate(zip(after, before)):
            updated = "was" if i == index else "was not"
            assert torch.equal(a, b) == (i == index), f"{what}: parameter {i} {updated} updated"
        assert int(opt.num_skipped_updates) == 1, what
        assert all(int(opt.state[p]["step"]) == (1 if p is target else 2) for p in model.parameters()), what
        if scaled:
            assert scaler.get_scale() == 2.0**11, f"{what}: the scaler did not back off"
        assert same_on_every_rank(torch.stack([opt.state[p]["step"] for p in model.parameters()]))
        opt.state_dict()  # the step counts agree between ranks: it can be saved
    # without either, no rank knows of another's overflow: only the shard holding it skips, the
    # step counts differ, and saving says so
    model = shard(make_mlp())
    when = {"now": True}
    poison_on_rank(model[2].weight, 1, when)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True)
    train_step(model, opt, rank, world_size, 0)
    assert int(opt.state[model[2].weight]["step"]) == (0 if rank == 1 else 1)
    try:
        opt.state_dict()
    except RuntimeError as exc:
        assert "differ between ranks" in str(exc), exc
    else:
        raise AssertionError("state with step counts that differ between ranks was saved")


test_loss_scaling_with_fused_true_under_fsdp2 = scenario((TWO, _release_loss_scaling))


# --- DDP and replicate ---------------------------------------------------------------------


def _ddp(rank, world_size, out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_mlp())
    try:
        fusedopt.AdamW(model.parameters(), fused=True)
    except RuntimeError as exc:
        message = str(exc)
    else:
        raise AssertionError("fused=True under DDP was not refused")
    assert "DistributedDataParallel" in message and "fully_shard" in message, message
    results = []
    for cls in (torch.optim.AdamW, fusedopt.AdamW):
        model = DDP(make_mlp())
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1)
        train(model, opt, rank, world_size, steps=3)
        results.append(params_of(model))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


test_ddp_refuses_fused_and_trains_as_torch_without = scenario((TWO, _ddp))


def _replicate(rank, world_size, out):
    from torch.distributed._composable.replicate_with_fsdp import replicate

    results = []
    for bits, fused in ((8, False), (8, True), (32, True)):
        model = make_mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                replicate(layer)
        replicate(model)
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=bits, min_compress_numel=0, fused=fused)
        train(model, opt, rank, world_size, steps=3)
        if fused:
            assert all(p.grad is None for p in model.parameters())
        results.append((params_of(model), state_of(opt)))
    assert_equal(results[1][0], results[0][0], "replicate parameters")
    assert_equal(results[1][1], results[0][1], "replicate state")
    reference = make_mlp()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(reference, torch_opt, 0, 1, steps=3)
    for got, want in zip(results[2][0], params_of(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


test_replicate_with_fsdp_supports_release = scenario((TWO, _replicate))


def _held_updates_of_uneven_shards(rank, world_size, out):
    """Release holds kernel updates for buckets, by the local shard's size; clipping's all-reduce runs when
    they launch. Shards of unequal sizes (a head of 35 rows: 18 and 17) would fill buckets at different
    points on the two ranks, and their all-reduces would meet FSDP2's collectives out of order (a
    deadlock): a sharded parameter's update is not held where clipping or unscaling sums over the ranks."""
    saved = {k: os.environ.get(k) for k in ("FUSEDOPT_BACKEND", "FUSEDOPT_BUCKET_MB")}
    os.environ.update(
        FUSEDOPT_BACKEND="triton", FUSEDOPT_BUCKET_MB="0.001049"
    )  # kernels (interpreted), 1100-byte buckets
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 35)
        )
        model = shard(model)
        assert model[4].weight.to_local().shape[0] == (18, 17)[rank]
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=True, max_grad_norm=1.0)
        norms = []
        for step in range(3):  # the first step prepares the launches: holding starts at the second
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            norms.append(opt.grad_norm.clone())
        assert same_on_every_rank(torch.stack(norms))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


test_held_updates_of_uneven_shards_keep_the_ranks_in_step = scenario((TWO, _held_updates_of_uneven_shards))


def _hsdp(rank, world_size, out):
    """HSDP: a (replicate 2, shard 1) mesh; placements (Replicate(), Shard(0))."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    results = []
    for bits, fused in ((4, False), (4, True), (32, True)):
        model = shard(make_mlp(), mesh=mesh)
        opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=bits, min_compress_numel=0, fused=fused)
        train(model, opt, rank, world_size, steps=3)
        results.append((params_of(model), state_of(opt)))
    assert_equal(results[1][0], results[0][0], "HSDP parameters")
    assert_equal(results[1][1], results[0][1], "HSDP state")
    reference = make_mlp()
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), 0, 1, steps=3)
    for got, want in zip(results[2][0], params_of(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


test_hsdp_supports_release = scenario((TWO, _hsdp))


# --- unsupported layouts -------------------------------------------------------------------


def _unsupported(rank, world_size, out):
    from torch.distributed.tensor import Shard

    model = shard(make_mlp(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    for fused in (False, True):
        try:
            fusedopt.AdamW(model.parameters(), fused=fused)
        except ValueError as exc:
            assert "Shard(0)" in str(exc), exc
        else:
            raise AssertionError("a parameter sharded on its last dimension was not refused")
    model = shard(make_mlp())
    for fused in (False, True):
        try:
            fusedopt.Adafactor(model.parameters(), fused=fused)
        except ValueError as exc:
            assert "does not support sharded (FSDP2) parameters" in str(exc), exc
        else:
            raise AssertionError("Adafactor on sharded parameters was not refused")


test_unsupported_sharded_setups_are_refused = scenario((TWO, _unsupported))


def test_fsdp1_flat_parameters_are_refused_with_fused():
    p = torch.nn.Parameter(torch.zeros(4))
    p._is_flat_param = True
    with pytest.raises(RuntimeError, match="FSDP1"):
        fusedopt.AdamW([p], fused=True)
    fusedopt.AdamW([p])  # fused=False: the parameters FSDP1 reduced before step()


# --- checkpoints through torch.distributed.checkpoint -------------------------------------

CHECKPOINT_FORMATS = ((4, torch.bfloat16), (8, torch.float32), (32, torch.bfloat16))


def _checkpoint(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def save(model, opt, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_checkpoint(model, opt), checkpoint_id=str(path))


def load(model, opt, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _checkpoint(model, opt)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _new(bits, dtype, fused=True):
    model = shard(make_mlp(dtype, seed=1))  # other initial weights: loading must replace them
    return model, fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=bits, min_compress_numel=0, fused=fused)


def _save_on_one(rank, world_size, out):
    for bits, dtype in CHECKPOINT_FORMATS:
        model, opt = _new(bits, dtype)
        train(model, opt, rank, world_size, steps=2, dtype=dtype)
        save(model, opt, out / f"one-{bits}")
        torch.save((params_of(model), state_of(opt)), out / f"one-{bits}.pt")


def _checkpoints_on_two(rank, world_size, out):
    for bits, dtype in CHECKPOINT_FORMATS:
        what = f"state_bits={bits} {dtype}"
        # a checkpoint of one rank, loaded on two
        model, opt = _new(bits, dtype)
        load(model, opt, out / f"one-{bits}")
        params, state = torch.load(out / f"one-{bits}.pt")
        assert_equal(params_of(model), params, what + ": 1 -> 2 ranks, parameters")
        assert_equal(state_of(opt), state, what + ": 1 -> 2 ranks, state")
        # saved on two, resumed on two: bit for bit
        model, opt = _new(bits, dtype, fused=bits != 8)
        train(model, opt, rank, world_size, steps=2, dtype=dtype)
        save(model, opt, out / f"two-{bits}")
        torch.save((params_of(model), state_of(opt)), out / f"two-{bits}.pt")
        train(model, opt, rank, world_size, steps=2, first_step=2, dtype=dtype)
        expected = params_of(model), state_of(opt)
        model, opt = _new(bits, dtype, fused=bits != 8)
        load(model, opt, out / f"two-{bits}")
        train(model, opt, rank, world_size, steps=2, first_step=2, dtype=dtype)
        assert_equal(params_of(model), expected[0], what + ": resumed on 2 ranks, parameters")
        assert_equal(state_of(opt), expected[1], what + ": resumed on 2 ranks, state")
    # blocks split by another sharding: a (6, 12) weight shards at element 36 (not a multiple of 16)
    torch.manual_seed(3)
    model = shard(torch.nn.Sequential(torch.nn.Linear(12, 6)))
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=4, min_compress_numel=0)
    for step in range(2):
        model(batch(step)[:, :12]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    save(model, opt, out / "split")
    torch.save((params_of(model), state_of(opt)), out / "split.pt")


def _load_two_on_one(rank, world_size, out):
    import warnings

    for bits, dtype in CHECKPOINT_FORMATS:
        model, opt = _new(bits, dtype)
        load(model, opt, out / f"two-{bits}")
        params, state = torch.load(out / f"two-{bits}.pt")
        what = f"state_bits={bits} {dtype}: 2 -> 1 rank"
        assert_equal(params_of(model), params, what + ", parameters")
        assert_equal(state_of(opt), state, what + ", state")
    torch.manual_seed(4)
    model = shard(torch.nn.Sequential(torch.nn.Linear(12, 6)))
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=4, min_compress_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(model, opt, out / "split")
    params, state = torch.load(out / "split.pt")
    assert_equal(params_of(model), params, "split blocks, parameters")
    # the shard boundary split blocks: re-encoded on the new blocks (stochastic rounding), close
    ours = state_of(opt)
    assert len(ours) == len(state)
    for a, b in zip(ours, state):
        torch.testing.assert_close(a, b, rtol=0.3, atol=1e-6)
    assert any("converted" in str(w.message) for w in caught), [str(w.message) for w in caught]


test_checkpoints_through_dcp_between_one_and_two_ranks = scenario(
    (ONE_BEFORE, _save_on_one), (TWO, _checkpoints_on_two), (ONE_AFTER, _load_two_on_one)
)


def _new_norm2(fused=True):
    model = shard(make_mlp(torch.bfloat16, seed=1))
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_format="norm2-root4", min_compress_numel=0, fused=fused)
    return model, opt


def _norm2_root4_on_two(rank, world_size, out):
    """norm2-root4 keeps packed 2- and 4-bit codes and a scale per 64 and 128 elements: saved as a code
    and a scale per element, as the block formats, and resumed on two ranks bit for bit."""
    model, opt = _new_norm2()
    train(model, opt, rank, world_size, steps=2, dtype=torch.bfloat16)
    save(model, opt, out / "two-norm2")
    torch.save((params_of(model), state_of(opt)), out / "two-norm2.pt")
    train(model, opt, rank, world_size, steps=2, first_step=2, dtype=torch.bfloat16)
    expected = params_of(model), state_of(opt)
    model, opt = _new_norm2(fused=False)
    load(model, opt, out / "two-norm2")
    train(model, opt, rank, world_size, steps=2, first_step=2, dtype=torch.bfloat16)
    assert_equal(params_of(model), expected[0], "norm2-root4 resumed on 2 ranks, parameters")
    assert_equal(state_of(opt), expected[1], "norm2-root4 resumed on 2 ranks, state")


def _norm2_root4_on_one(rank, world_size, out):
    """On one rank the biases' and the head's blocks were split by the shards: those moments are decoded
    element by element (the second moment first, the first in its units) and encoded afresh."""
    import warnings

    model, opt = _new_norm2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(model, opt, out / "two-norm2")
    assert any("converted" in str(w.message) for w in caught), [str(w.message) for w in caught]
    params, state = torch.load(out / "two-norm2.pt")
    assert_equal(params_of(model), params, "norm2-root4 2 -> 1 rank, parameters")
    ours = state_of(opt)
    # the weights of (64, 16) and (32, 64) were split on block bounds: their m and v as saved, bit for bit
    assert_equal([ours[i] for i in (1, 2, 7, 8)], [state[i] for i in (1, 2, 7, 8)], "unsplit blocks")
    # the others: as the saved values (exactly decoded) load into an optimizer of one process, bit for bit
    ref = fusedopt.AdamW(
        [torch.nn.Parameter(t.clone()) for t in params], lr=1e-2, state_format="norm2-root4", min_compress_numel=0
    )
    plain = ref.state_dict()
    plain["state"] = {
        i: {"step": torch.tensor(2.0), "exp_avg": state[3 * i + 1], "exp_avg_sq": state[3 * i + 2]}
        for i in range(len(params))
    }
    plain["fusedopt"]["codecs"] = {}
    ref.load_state_dict(plain)
    expected = state_of(ref)
    split = [i for i in range(len(ours)) if i % 3 and i not in (1, 2, 7, 8)]
    assert_equal([ours[i] for i in split], [expected[i] for i in split], "split blocks, re-encoded")
    train(model, opt, 0, 1, steps=1, first_step=2, dtype=torch.bfloat16)


test_norm2_root4_checkpoints_through_dcp = scenario((TWO, _norm2_root4_on_two), (ONE_AFTER, _norm2_root4_on_one))


# --- DCP keeps fusedopt's optimizer-wide entry (seed, skipped updates, clipping history) ----


def _clipped(seed=0, when=None):
    model = shard(make_mlp(torch.bfloat16, seed=1))
    if when is not None:
        poison_on_rank(model[2].weight, 1, when)  # before the optimizer's hook
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = fusedopt.AdamW(
        model.parameters(),
        lr=1e-2,
        state_bits=8,
        min_compress_numel=0,
        fused=True,
        max_grad_norm=0.05,
        release_clipping="adagc",
        grad_scaler=scaler,
        seed=seed,  # stochastic rounding draws from it: a lost seed changes the bf16 weights
    )
    return model, opt, scaler


def wide_entry(opt) -> dict:
    """The optimizer-wide entry as ``opt.state_dict()`` keeps it (seed, counter, clipping history)."""
    meta = opt.state_dict()["fusedopt"]
    return {key: meta[key] for key in ("seed", "num_skipped_updates", "release_clipping")}


def assert_same_entry(got, want, what: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{what}: {got} != {want}"
        for key in want:
            assert_same_entry(got[key], want[key], f"{what}.{key}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got.cpu(), want.cpu()), f"{what}: {got} != {want}"
    else:
        assert got == want, f"{what}: {got} != {want}"


def _dcp_entry_on_two(rank, world_size, out):
    when = {"now": False}
    model, opt, scaler = _clipped(seed=7, when=when)
    for step in range(2):  # an overflow in one shard at step 1: one skipped update, the scale backs off
        when["now"] = step == 1
        train_step(model, opt, rank, world_size, step, torch.bfloat16, scaler)
    when["now"] = False
    save(model, opt, out / "clipped")
    torch.save((wide_entry(opt), scaler.state_dict()), out / f"clipped.rank{rank}.pt")
    norms = [train_step(model, opt, rank, world_size, step, torch.bfloat16, scaler) for step in (2, 3)]
    expected = params_of(model), state_of(opt), norms
    model, opt, scaler = _clipped()
    load(model, opt, out / "clipped")  # DCP's template comes from a zero-gradient step, with the scaler set
    entry, scaler_state = torch.load(out / f"clipped.rank{rank}.pt")
    scaler.load_state_dict(scaler_state)
    assert_same_entry(wide_entry(opt), entry, "2 -> 2 ranks")
    assert entry["seed"] == 7 and int(entry["num_skipped_updates"]) == 1
    norms = [train_step(model, opt, rank, world_size, step, torch.bfloat16, scaler) for step in (2, 3)]
    assert_equal(params_of(model), expected[0], "resumed with clipping history, parameters")
    assert_equal(state_of(opt), expected[1], "resumed with clipping history, state")
    assert_equal(norms, expected[2], "resumed with clipping history, grad_norm")


def _dcp_entry_on_one(rank, world_size, out):
    model, opt, _ = _clipped()
    load(model, opt, out / "clipped")
    entry, _ = torch.load(out / "clipped.rank0.pt")
    assert_same_entry(wide_entry(opt), entry, "2 -> 1 rank")
    # max_grad_norm turned off, then on again, at a resume: DCP finds every key its template asks for
    model = shard(make_mlp(torch.bfloat16, seed=1))
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, state_bits=8, min_compress_numel=0, fused=True)
    load(model, opt, out / "clipped")
    assert opt.seed == 7 and opt.grad_norm is None
    save(model, opt, out / "unclipped")
    model, opt, _ = _clipped()
    load(model, opt, out / "unclipped")
    assert opt.seed == 7 and opt.grad_norm is None  # no history: the next backward starts one


test_dcp_keeps_seed_counter_and_clipping_history = scenario((TWO, _dcp_entry_on_two), (ONE_AFTER, _dcp_entry_on_one))


# --- a backward that stops early (out of memory) on every rank ------------------------------


def _loss_failing_before_the_head(model, x) -> torch.Tensor:
    """``loss_of``, with the fault between the head and the layers below it (the head is updated first)."""
    return model[4](OutOfMemory.apply(model[3](model[2](model[1](model[0](x)))))).float().square().mean()


def _failed_backward(rank, world_size, out):
    """The failed step is closed at zero_grad() on every rank alike: the head's update (released before
    the fault) stays, the rest skip the step, and the next batches train exactly as a fresh optimizer
    loaded from the checkpoint (DCP) saved right after."""
    import warnings

    for (name, hyper), micro, clip in [(a, m, c) for a in ALGORITHMS.items() for m in (1, 2) for c in (None, 0.05)]:
        what = f"{name}, {micro} micro-batch(es), max_grad_norm={clip}"

        def build(name=name, hyper=hyper, micro=micro, clip=clip):
            model = shard(make_mlp(torch.bfloat16))
            opt = getattr(fusedopt, name)(
                model.parameters(), min_compress_numel=0, fused=True, accumulation_steps=micro, max_grad_norm=clip,
                **hyper,
            )  # fmt: skip
            return model, opt

        model, opt = build()
        train(model, opt, rank, world_size, steps=2, dtype=torch.bfloat16, micro=micro)
        before = params_of(model)
        parts = local_batch(5, rank, world_size, torch.bfloat16).chunk(micro)
        if micro == 2:
            (loss_of(model, parts[0]) / 2).backward()
        OutOfMemory.armed = True
        with pytest.raises(torch.OutOfMemoryError):
            (_loss_failing_before_the_head(model, parts[-1]) / micro).backward()
        with pytest.warns(UserWarning, match=r"stopped early.*; 2 parameter update\(s\)"):
            opt.zero_grad()
        fusedopt.reset_fsdp_backward_state(model)  # FSDP2's own end of backward, which never ran
        changed = [not torch.equal(a, b) for a, b in zip(params_of(model), before)]
        assert changed == [False, False, False, False, True, True], what  # the head's weight and bias
        assert opt.num_interrupted_steps == 1 and all(p.grad is None for p in model.parameters()), what
        path = out / f"failed-{name}-{micro}-{clip}"  # one checkpoint, saved by every rank
        save(model, opt, path)
        twin, twin_opt = build()
        load(twin, twin_opt, path)
        assert twin_opt.num_interrupted_steps == 1, what  # folded into the groups for DCP
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            train(model, opt, rank, world_size, steps=2, first_step=6, dtype=torch.bfloat16, micro=micro)
            train(twin, twin_opt, rank, world_size, steps=2, first_step=6, dtype=torch.bfloat16, micro=micro)
        assert_equal(params_of(model), params_of(twin), what + ", parameters")
        assert_equal(state_of(opt), state_of(twin_opt), what + ", state")


test_a_failed_backward_under_fsdp2_is_closed_on_every_rank = scenario((TWO, _failed_backward))


class _CheckpointedMLP(torch.nn.Sequential):
    """``make_mlp``'s layers, each linear layer a reentrant activation checkpoint (Hugging Face's gradient
    checkpointing by default); ``fault_in``: out of memory in that layer's recomputation."""

    fault_in = None

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        def layer(i, t):
            if i == self.fault_in:
                OutOfMemory.fail_in_recomputation()
            return self[i](t)

        x = x.detach().requires_grad_(True)
        for i in range(0, len(self), 2):
            x = checkpoint(layer, i, x, use_reentrant=True)
            if i + 1 < len(self):
                x = self[i + 1](x)
        return x


def _failed_recomputation(rank, world_size, out):
    """Out of memory in the recomputation of the middle layer under reentrant checkpointing, after the
    head's nested pass released its update: closed at zero_grad() on every rank alike, and the next steps
    train on. reset_fsdp_backward_state() also takes a model whose root never ran (layers called alone)."""
    import warnings

    model = shard(_CheckpointedMLP(*make_mlp(torch.bfloat16)))
    opt = fusedopt.AdamW(model.parameters(), min_compress_numel=0, fused=True)
    train(model, opt, rank, world_size, steps=2, dtype=torch.bfloat16)
    before = params_of(model)
    model.fault_in = 2
    OutOfMemory.armed = True
    with pytest.raises(torch.OutOfMemoryError):
        loss_of(model, local_batch(5, rank, world_size, torch.bfloat16)).backward()
    with pytest.warns(UserWarning, match=r"stopped early.*; 2 parameter update\(s\)"):
        opt.zero_grad()
    fusedopt.reset_fsdp_backward_state(model)
    assert [not torch.equal(a, b) for a, b in zip(params_of(model), before)] == [False] * 4 + [True] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        train(model, opt, rank, world_size, steps=2, first_step=6, dtype=torch.bfloat16)
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [4] * 4 + [5] * 2
    alone = shard(make_mlp())
    alone[0](local_batch(0, rank, world_size))  # its root never runs forward
    fusedopt.reset_fsdp_backward_state(alone)


test_a_failed_recomputation_under_reentrant_checkpointing_and_fsdp2_is_closed = scenario((TWO, _failed_recomputation))


# --- parameters swapped for their shards after the optimizer was built (accelerate's prepare) ----


def swap_for_shards(model, opt) -> None:
    """Shard ``model`` and put each sharded parameter in ``opt`` in place of the unsharded one, as
    accelerate's ``Accelerator.prepare()`` does with FSDP2 (``_prepare_fsdp2``): a placeholder keyed by
    the old parameter's data pointer drops the optimizer's reference before ``fully_shard``, then
    accelerate's own ``fsdp2_switch_optimizer_parameters`` puts the new parameters in."""
    try:
        from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters as switch
    except ImportError:  # accelerate's, in a few lines

        def switch(opt, mapping):
            for group in opt.param_groups:
                group["params"] = [mapping[p.data_ptr] for p in group["params"]]

    names = {name: p.data_ptr() for name, p in model.named_parameters()}
    for group in opt.param_groups:
        params = group["params"]
        for i in range(len(params)):
            key = params[i].data_ptr()
            params[i] = torch.empty(1, dtype=params[i].dtype, device=params[i].device)
            params[i].data_ptr = key
    shard(model)
    new = dict(model.named_parameters())
    switch(opt, {key: new[name] for name, key in names.items()})


def _decay_groups(model):
    """The Trainer's two groups: weights with weight decay, biases without."""
    params = list(model.parameters())
    return [{"params": params[0::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]


def _swapped_for_shards(rank, world_size, out):
    """An optimizer built on the unsharded model, whose parameters are then swapped for their shards:
    it trains bit for bit as one built after sharding, in both modes, and frees the unsharded
    parameters at the swap. fused=True on plain parameters in a process group is allowed only while
    accelerate's FSDP2 is to shard them (``_sharded_later``, patched here), and refused at the first
    hook if they were never swapped."""
    import weakref
    from unittest import mock

    import fusedopt.release

    for bits, dtype in ((32, torch.float32), (8, torch.bfloat16), (4, torch.bfloat16)):
        for fused in (False, True):
            what = f"state_bits={bits} {dtype} fused={fused}"
            model = make_mlp(dtype)
            options = dict(lr=1e-2, state_bits=bits, min_compress_numel=0, fused=fused, max_grad_norm=None)
            with mock.patch.object(fusedopt.release, "_sharded_later", return_value=True):
                opt = fusedopt.AdamW(_decay_groups(model), **options)
            unsharded = [weakref.ref(p) for p in model.parameters()]
            swap_for_shards(model, opt)
            assert all(ref() is None for ref in unsharded), what + ": an unsharded parameter was kept"
            reference = shard(make_mlp(dtype))
            reference_opt = fusedopt.AdamW(_decay_groups(reference), **options)
            train(model, opt, rank, world_size, steps=2, dtype=dtype)
            loss_of(model, local_batch(2, rank, world_size, dtype)).backward()
            if fused:  # hooked: updated inside backward, gradients released
                assert all(p.grad is None for p in model.parameters()), what
            opt.step()
            opt.zero_grad()
            train(reference, reference_opt, rank, world_size, steps=3, dtype=dtype)
            assert [opt.param_index(p) for p in model.parameters()] == [0, 3, 1, 4, 2, 5], what
            assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters()), what
            assert_equal(params_of(model), params_of(reference), what + ", parameters")
            assert_equal(state_of(opt), state_of(reference_opt), what + ", state")
    # swapped after a step: the state is laid out for the whole parameter, not the shard: refused
    model = make_mlp()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, max_grad_norm=None)
    train(model, opt, rank, world_size, steps=1)
    swap_for_shards(model, opt)
    with pytest.raises(ValueError, match=r"has optimizer state already.*\(whole, now a shard\)"):
        opt.step()
    # without accelerate's FSDP2, plain parameters in a process group are refused with fused=True (DDP)
    with pytest.raises(RuntimeError, match="plain"):
        fusedopt.AdamW(make_mlp().parameters(), fused=True, max_grad_norm=None)
    # allowed for accelerate's FSDP2 but never swapped: the first hook refuses, before any update
    model = make_mlp()
    with mock.patch.object(fusedopt.release, "_sharded_later", return_value=True):
        opt = fusedopt.AdamW(model.parameters(), fused=True, max_grad_norm=None)
    before = params_of(model)
    with pytest.raises(RuntimeError, match="plain"):
        loss_of(model, local_batch(0, rank, world_size)).backward()
    assert_equal(params_of(model), before, "never swapped: refused before any update")


test_parameters_swapped_for_their_shards_after_construction_are_taken_over = scenario((TWO, _swapped_for_shards))


def _fsdp2_trainer(trainer_cls, opt, out: Path, callbacks=(), **arguments):
    """A Hugging Face Trainer on a tiny Llama, its Accelerator's state set to FSDP2 by hand: accelerate enables
    FSDP only on accelerators (on CPU its state stays ``DistributedType.MULTI_CPU`` and drops the plugin), so
    the state is set as ``AcceleratorState`` sets it on GPUs; the rest is transformers' and accelerate's own
    code. Call within ``_trainer_environment``."""
    import transformers
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = tiny_llama()
    settings = dict(
        output_dir=str(out / "trainer"), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
        weight_decay=0.1, max_grad_norm=1e4, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        disable_tqdm=True, seed=0, fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )  # fmt: skip
    args = transformers.TrainingArguments(**{**settings, **arguments})
    callbacks = [callback(model) for callback in callbacks]
    trainer = trainer_cls(
        model=model, args=args, train_dataset=Tokens(), optimizer_cls_and_kwargs=opt, callbacks=callbacks
    )
    state = trainer.accelerator.state
    if not trainer.is_fsdp_enabled:
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
        state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        trainer.is_fsdp_enabled = True
    assert trainer.accelerator.is_fsdp2
    return model, trainer, callbacks


@contextlib.contextmanager
def _trainer_environment(rank, world_size):
    """The environment variables a Trainer reads in a spawned rank; accelerate's state reset after."""
    from accelerate.state import AcceleratorState

    environ = dict(os.environ)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)


def _released(model):
    """A Trainer callback recording, before each optimizer step, whether every gradient was released."""
    import transformers

    class Released(transformers.TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.seen.append(all(p.grad is None for p in model.parameters()))

    return Released()


def _trainer_with_fsdp2(rank, world_size, out):
    """The real flow: ``FusedOptTrainer`` builds the optimizer on the unsharded model, accelerate's
    ``Accelerator.prepare()`` shards it with FSDP2 and swaps the optimizer's parameters (``_fsdp2_trainer``).
    Both modes train bit for bit alike and as torch.optim.AdamW (to round-off) under the same Trainer."""
    try:
        import transformers

        from fusedopt.integrations.huggingface import FusedOptTrainer
    except ImportError:
        return  # the test skips
    from torch.distributed.tensor import DTensor

    runs = {}
    with _trainer_environment(rank, world_size):
        for name, trainer_cls, opt in (
            ("torch", transformers.Trainer, (torch.optim.AdamW, dict(lr=1e-2))),  # (the Trainer passes no lr)
            ("fused=False", FusedOptTrainer, (fusedopt.AdamW, dict(state_bits=32, fused=False))),
            ("fused=True", FusedOptTrainer, (fusedopt.AdamW, dict(state_bits=32, fused=True))),
        ):
            model, trainer, (released,) = _fsdp2_trainer(trainer_cls, opt, out, callbacks=[_released])
            trainer.train()
            held = [p for g in trainer.optimizer.optimizer.param_groups for p in g["params"]]
            assert {id(p) for p in held} == {id(p) for p in model.parameters()}, name
            assert all(isinstance(p, DTensor) for p in held), name
            if name != "torch":
                assert all(int(trainer.optimizer.optimizer.state[p]["step"]) == 4 for p in held), name
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            runs[name] = params_of(model), losses, released.seen
    (ours, losses, unreleased), (fused, fused_losses, seen) = runs["fused=False"], runs["fused=True"]
    assert not any(unreleased) and seen == [True] * 4, (unreleased, seen)  # taken over before the first backward
    assert_equal(fused, ours, "Trainer + FSDP2, fused=True against fused=False, parameters")
    assert fused_losses == losses
    before = [p.detach() for p in tiny_llama().parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(ours, before)), "nothing was trained"
    for got, want in zip(ours, runs["torch"][0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _trainer_with_fsdp2_accumulates(rank, world_size, out):
    """gradient_accumulation_steps=2 under FSDP2: accelerate skips all but the last micro-batch's
    reduce-scatter, where release would hold every gradient until step(): refused before any step, naming
    sync_each_batch; with it, every gradient is released and training equals fused=False."""
    try:
        from fusedopt.integrations.huggingface import FusedOptTrainer
    except ImportError:
        return  # the test skips
    runs = {}
    with _trainer_environment(rank, world_size):
        model, trainer, _ = _fsdp2_trainer(
            FusedOptTrainer, (fusedopt.AdamW, dict(state_bits=32, fused=True)), out, gradient_accumulation_steps=2
        )
        before = params_of(model)
        with pytest.raises(ValueError, match=r"under FSDP2.*'sync_each_batch': True"):
            trainer.train()
        assert_equal(params_of(model), before, "refused before any step")
    for fused in (False, True):
        with _trainer_environment(rank, world_size):
            sync = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}  # (the Trainer adds to it)
            opt = (fusedopt.AdamW, dict(state_bits=32, fused=fused))
            model, trainer, (released,) = _fsdp2_trainer(
                FusedOptTrainer, opt, out, [_released], gradient_accumulation_steps=2, accelerator_config=sync
            )
            trainer.train()
            runs[fused] = params_of(model), released.seen
    assert runs[True][1] == [True] * 4 and not any(runs[False][1]), (runs[True][1], runs[False][1])
    assert_equal(runs[True][0], runs[False][0], "Trainer + FSDP2 accumulating, fused=True against fused=False")


test_trainer_with_fsdp2_accumulation_releases_or_is_refused = scenario((TWO, _trainer_with_fsdp2_accumulates))


test_trainer_with_fsdp2_takes_over_the_sharded_parameters = scenario((TWO, _trainer_with_fsdp2))
