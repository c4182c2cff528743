"""Small models and loops shared by the tests."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys

import torch

from fusedopt import rng


@contextlib.contextmanager
def spawned_rank():
    """The work of a spawned rank in its process group. Raising: the group is destroyed and the error
    goes to mp.spawn. Finished: the group is destroyed and the process exits without the interpreter's
    teardown, where gloo on the CPU now and then aborts in a C++ destructor ("terminate called without
    an active exception", torch's own FSDP2 + SGD too) after the work has passed, which mp.spawn would
    report as a failed process."""
    import torch.distributed as dist

    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A model with 2-D weights, 1-D biases, an odd-shaped and a non-contiguous parameter."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    # non-contiguous leaf: a transposed view's storage, registered as a parameter
    model.extra = torch.nn.Parameter(torch.randn(5, 3, generator=gen).t())
    assert not model.extra.is_contiguous()
    return model.to(dtype)


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model[2](model[1](model[0](x)))  # (n, 5)
    return (out.float() ** 2).mean() + (model.extra.float() @ out.t().float()).sin().mean()


def inputs(n_steps: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 7, generator=gen).to(dtype) for _ in range(n_steps)]


def groups(model: torch.nn.Module, **second) -> list[dict]:
    """Three parameter groups: first layer, second layer with its own options, the extra param."""
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), **second},
        {"params": [model.extra]},
    ]


def train(model, opt, xs, *, micro_batches: int = 1, closure: bool = False) -> None:
    """Standard loop: ``micro_batches`` backward passes per ``step()``."""
    for i in range(0, len(xs), micro_batches):
        chunk = xs[i : i + micro_batches]
        if closure:

            def run(chunk=chunk):
                for x in chunk:
                    loss_fn(model, x).backward()
                return torch.tensor(0.0)

            opt.step(run)
        else:
            for x in chunk:
                loss_fn(model, x).backward()
            opt.step()
        opt.zero_grad()


def random_steps(opt, params, n: int, seed: int = 1) -> None:
    """``n`` optimizer steps, each on seeded random gradients set as ``.grad`` (cleared after each)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
        opt.zero_grad()


def step_with(opt, params, grads, fused: bool) -> None:
    """One optimizer step on these gradients: through backward under ``fused=True`` (the update runs in
    each parameter's hook), else set as ``.grad`` then ``opt.step()``; the gradients are cleared after."""
    if fused:
        sum((w * g).sum() for w, g in zip(params, grads)).backward()
    else:
        for w, g in zip(params, grads):
            w.grad = g
    opt.step()
    opt.zero_grad()


def launch_constexprs(opt) -> list[dict]:
    """The compile-time switches of every kernel launch ``opt`` has prepared."""
    return [c.constexprs for p in opt._dispatch._prepared.values() for c in p.launch.configs]


def moment_draws(key: int, step: int, shape, field: int = 0, whole: bool = False):
    """A codec's bits callback as the optimizer hands it (``rng.UpdateDraws.moment``), with the
    counter-based hash of ``key`` at ``step`` (a new step, new draws): moment ``field``'s 12 bits of the
    shared word, or (``whole``) its whole word: field 0 the shared word, field 1 the second one."""
    step_t, shape, cpu = torch.tensor(float(step)), torch.Size(shape), torch.device("cpu")
    if not whole:
        return lambda: rng.moment_word(rng.uniform_bits(key, step_t, shape, cpu), field)

    def shared():
        return rng.uniform_bits(key, step_t, shape, cpu)

    return (lambda: rng.second_word(shared())) if field else shared


def whole_draws(key: int, step: int, shape, field: int = 0):
    """``moment_draws`` of a codec that reads whole words (``MomentCodec.whole_word``)."""
    return moment_draws(key, step, shape, field, whole=True)


def second_moment(shape, seed: int) -> torch.Tensor:
    """Squared Gaussians, rows scaled over ~8 decades, a few exact zeros and one tiny value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) ** 2 * torch.exp(3 * torch.randn(shape[0], 1, generator=gen))
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 50)]] = 0.0
    flat[-1] = 1e-30
    return x


def twins(seed: int = 0, dtype=torch.float32):
    a = make_model(seed, dtype)
    return a, copy.deepcopy(a)


def assert_params_close(a, b, rtol=1e-5, atol=1e-7):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_params_equal(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"{name} differs: max {(pa.float() - pb.float()).abs().max()}"


def save_load(obj):
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)`` in memory, as a checkpoint."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# The parity bound of a kernel against the reference (tests/test_kernels.py, tests/gpu/): an fp32
# value within PARITY_ATOL + PARITY_RTOL * |ref|, a 16-bit one within one unit in the last place.
PARITY_RTOL, PARITY_ATOL = 1e-5, 1e-6


def ulp(x: torch.Tensor) -> torch.Tensor:
    """Per element of ``x``, one unit in the last place of its dtype (the distance to the next value
    towards +inf), as fp32."""
    return (torch.nextafter(x, torch.full_like(x, float("inf"))).float() - x.float()).abs()


def beyond_parity(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per element, whether ``got`` lies beyond the parity bound around ``ref``: fp32,
    ``PARITY_ATOL + PARITY_RTOL * |ref|``; 16-bit, one ulp of ``ref``."""
    if ref.dtype == torch.float32:
        return (got - ref).abs() > PARITY_ATOL + PARITY_RTOL * ref.abs()
    return (got.float() - ref.float()).abs() > ulp(ref)


def code_levels(codes: torch.Tensor, bits: int, signed: bool, numel: int) -> torch.Tensor:
    """Signed level index of each element of block-quantized codes (fusedopt/codecs/blockwise.py).

    4 bits: two codes a byte, element ``2i`` in the low nibble. Signed moments store sign and
    magnitude, the sign in the code's top bit: -q for a set sign (so -0 and +0 are both level 0).
    Neighbouring indices are neighbouring levels of one block, whatever the level map.
    """
    c = codes.reshape(-1).to(torch.int32)
    if bits == 4:
        c = torch.stack((c & 0xF, c >> 4), dim=1).reshape(-1)
    c = c[:numel]
    if not signed:
        return c
    sign = 1 << (bits - 1)
    return torch.where((c & sign) != 0, -(c & (sign - 1)), c & (sign - 1))


def tracked_step(model: torch.nn.Module, opt, x: torch.Tensor):
    """One training step of ``model`` (loss: the squared output) under fusedopt's MemoryTracker; its result."""
    from fusedopt.profile import MemoryTracker

    tracker = MemoryTracker(model, opt)
    tracker.register_inputs(x)
    with tracker:
        with tracker.phase("forward"):
            loss = model(x).float().pow(2).sum()
        with tracker.phase("backward"):
            loss.backward()
            del loss
        with tracker.phase("update"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.result()


class OutOfMemory(torch.autograd.Function):
    """Identity; its backward raises the allocator's error once when ``armed`` (a failed backward at the
    point where it is applied; the message is the one accelerate's find_executable_batch_size looks for)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        OutOfMemory.fail()
        return grad

    @staticmethod
    def fail():
        """Raise the allocator's error here, once, when ``armed``."""
        if OutOfMemory.armed:
            OutOfMemory.armed = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    @staticmethod
    def fail_in_recomputation():
        """``fail()`` where autograd records (reentrant checkpointing's first forward runs without gradients,
        its recomputation with them)."""
        if torch.is_grad_enabled():
            OutOfMemory.fail()


def tiny_llama(dtype=torch.float32, **config):
    """A two-layer ``LlamaForCausalLM`` of width 32 over a 64-token vocabulary, built from a config
    (nothing downloaded) after ``torch.manual_seed(0)``; ``config`` overrides LlamaConfig fields."""
    import pytest

    transformers = pytest.importorskip("transformers")
    shape = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**shape, **config})).to(dtype)
