"""``fused=True`` on a ``torch.compile``d model: the release hooks run inside the compiled backward
and training is bit-identical to compiled ``fused=False`` (bf16 MLP, 8-bit state, bf16 weights with
their correction, clipping configured).

On CPU the model compiles with ``backend="aot_eager"`` (dynamo and AOT autograd, eager kernels):
the inductor CPU backend took about two minutes to compile this MLP on two busy cores. The inductor
backend runs on the GPU: ``tests/gpu/test_compile_cuda.py``.
"""

import pytest
import torch

import fusedopt

torch_dynamo = pytest.importorskip("torch._dynamo")


def train_compiled(fused: bool, backend, device: str = "cpu", width: int = 32, steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
    model = model.to(device, torch.bfloat16)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=fused, min_compress_numel=0, max_grad_norm=1e4)
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator(device).manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, width, generator=gen, device=device, dtype=torch.bfloat16)
        loss = (compiled(x).float() - x.float()).pow(2).mean()
        before = [p.detach().clone() for p in model.parameters()]
        loss.backward()
        if fused:  # updated and freed inside the compiled graph's backward
            assert all(p.grad is None for p in model.parameters())
            assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def assert_same_training(a, b):
    (params_a, state_a), (params_b, state_b) = a, b
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
    for index, state in state_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, state_b["state"][index][key]), (index, key)


def test_release_on_a_compiled_model_is_bit_identical_to_compiled_fused_false():
    torch_dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):  # aot_eager, counting the graphs it compiles
        graphs.append(gm)
        return torch_dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    unfused = train_compiled(False, backend)
    assert graphs  # the model was compiled, not run eagerly
    assert_same_training(train_compiled(True, backend), unfused)
