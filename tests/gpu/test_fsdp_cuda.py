"""FSDP2 on CUDA (nccl): the fused kernel runs in the hooks FSDP2 calls on its post-reduce stream.

``fused=True`` (updates inside backward, on FSDP2's post-reduce stream) equals ``fused=False``
(updates in ``step()``, on the default stream) bit for bit, with the kernel forced
(``FUSEDOPT_BACKEND=triton``): any update reading a gradient before its reduce-scatter finished, or
an all-gather of the next forward reading a shard before its update finished, would differ. World
size 1 on one GPU; world size 2 when two GPUs are visible (one process each). The same with
``max_grad_norm`` (never reached: the hooks all-reduce each shard's squared norm over the ranks on
that stream, and ``grad_norm`` must equal ``fused=False``'s) and with a GradScaler at a power-of-two
scale (bit for bit the unscaled run).
"""

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist

import fusedopt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_long,  # the long tier (tests/gpu/README.md): a process per rank, NCCL, 26 short trainings
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WIDTH = 1024  # weights of 1024 x 1024: kernels long enough for a missing wait to show
CASES = [(8, torch.bfloat16), (4, torch.bfloat16), (32, torch.bfloat16), (8, torch.float32), (16, torch.float32)]


def _model(dtype, device):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 8)).to(device, dtype)


def _run(rank, world_size, bits, dtype, fused, algorithm="AdamW", max_grad_norm=None, scale=None):
    from torch.distributed.fsdp import fully_shard

    device = torch.device("cuda", rank)
    model = _model(dtype, device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    scaler = None if scale is None else torch.amp.GradScaler("cuda", init_scale=scale)
    opt = getattr(fusedopt, algorithm)(
        model.parameters(), lr=1e-3, state_bits=bits, fused=fused, max_grad_norm=max_grad_norm, grad_scaler=scaler
    )
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    norms = []
    for _ in range(4):
        for micro in range(2):  # two micro-batches, the first without reduce-scatter
            x = torch.randn(64, WIDTH, device=device, dtype=dtype, generator=gen)
            model.set_requires_gradient_sync(micro == 1)
            loss = model(x).float().square().mean()
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        if max_grad_norm is not None:
            norm = opt.grad_norm  # fused=False: a DTensor (torch's clip_grad_norm_ on sharded gradients)
            norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().cpu())
        if fused:
            assert all(p.grad is None for p in model.parameters())
    params = [p.detach().full_tensor().cpu() for p in model.parameters()]
    return params, [int(opt.state[p]["step"]) for p in model.parameters()], norms


def _compare(rank, world_size):
    os.environ["FUSEDOPT_BACKEND"] = "triton"  # the kernel or an error, never the reference
    torch.cuda.set_device(rank)
    for algorithm in ("AdamW", "SGD", "Lion"):
        for bits, dtype in CASES if algorithm == "AdamW" else CASES[:2]:
            unfused, steps, _ = _run(rank, world_size, bits, dtype, False, algorithm)
            fused, fused_steps, _ = _run(rank, world_size, bits, dtype, True, algorithm)
            assert steps == fused_steps == [4] * len(steps)
            for i, (a, b) in enumerate(zip(fused, unfused)):
                assert torch.equal(a, b), (algorithm, bits, dtype, i, (a.float() - b.float()).abs().max().item())
    for bits, dtype in ((8, torch.bfloat16), (8, torch.float32)):
        unfused, _, unfused_norms = _run(rank, world_size, bits, dtype, False, max_grad_norm=1e6)
        fused, _, norms = _run(rank, world_size, bits, dtype, True, max_grad_norm=1e6)
        for i, (a, b) in enumerate(zip(fused, unfused)):
            assert torch.equal(a, b), ("max_grad_norm", bits, dtype, i, (a.float() - b.float()).abs().max().item())
        if dtype == torch.float32:  # (fused=False's norm is in the gradients' dtype)
            torch.testing.assert_close(torch.stack(norms), torch.stack(unfused_norms), rtol=1e-5, atol=0)
        scaled, _, _ = _run(rank, world_size, bits, dtype, True, scale=2.0**12)
        plain, _, _ = _run(rank, world_size, bits, dtype, True)
        for i, (a, b) in enumerate(zip(scaled, plain)):
            assert torch.equal(a, b), ("grad_scaler", bits, dtype, i, (a.float() - b.float()).abs().max().item())


def _worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        _compare(rank, world_size)
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _spawn(world_size, tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_worker, args=(world_size, port, str(tmp_path)), nprocs=world_size, join=True)
    except Exception:
        errors = [p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))]
        pytest.fail("\n".join(errors) or "a rank failed", pytrace=False)


def test_fsdp2_fused_equals_unfused_on_one_gpu(tmp_path):
    _spawn(1, tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fsdp2_fused_equals_unfused_on_two_gpus(tmp_path):
    _spawn(2, tmp_path)
