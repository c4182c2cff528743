"""Clipping and fp16 loss scaling under gradient release on CUDA, through the kernel and its buckets:
``grad_norm`` exact after backward, bit-identity with ``fused=False`` when nothing clips, a
GradScaler run with ``fused=True`` equal to ``fused=False``, and an overflow that backs off."""

import pytest
import torch

import fusedopt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_long,  # the long tier (tests/gpu/README.md): recipes, 6-step trainings
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(dtype):
    gen = torch.Generator().manual_seed(0)
    layers = []
    for d_in, d_out in [(96, 256), (256, 256), (256, 96)]:
        layer = torch.nn.Linear(d_in, d_out)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.1)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen) * 0.1)
        layers += [layer, torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1]).cuda().to(dtype)


def _train(fused, dtype, *, steps=6, scaler=None, overflow_at=None, **options):
    model = _model(dtype)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, fused=fused, grad_scaler=scaler if fused else None, **options)
    gen = torch.Generator(device="cuda").manual_seed(1)
    norms = []
    for step in range(steps):
        x = torch.randn(64, 96, device="cuda", generator=gen, dtype=dtype)
        loss = (model(x).float() ** 2).mean() * (30.0 if step % 2 else 1.0)
        if scaler is None:
            loss.backward()
        else:
            if step == overflow_at:
                handle = model[2].weight.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([3], device="cuda"), float("inf"))
                )
            scaler.scale(loss).backward()
            if step == overflow_at:
                handle.remove()
        if fused and opt.max_grad_norm is not None:
            norms.append(opt.grad_norm.clone())
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if not fused and opt.max_grad_norm is not None:
            norms.append(opt.grad_norm.clone())
        opt.zero_grad()
    return model, opt, norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state_bits", [32, 8, 4])
def test_release_with_clipping_on_cuda(dtype, state_bits):
    a, opt_a, norms_a = _train(False, dtype, state_bits=state_bits, max_grad_norm=1e6)
    b, opt_b, norms_b = _train(True, dtype, state_bits=state_bits, max_grad_norm=1e6)
    for p, q in zip(a.parameters(), b.parameters()):  # nothing clipped: bit-identical
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key
    for x, y in zip(norms_a, norms_b):  # torch's norm of bf16 gradients is a bf16 number; release's is fp32
        torch.testing.assert_close(y, x.float(), rtol=1e-5 if dtype == torch.float32 else 2**-8, atol=0)
    clipped, _, norms = _train(True, dtype, state_bits=state_bits, max_grad_norm=0.5)
    assert any(float(n) > 0.5 for n in norms)
    assert any(not torch.equal(p, q) for p, q in zip(clipped.parameters(), b.parameters()))
    assert all(torch.isfinite(p).all() for p in clipped.parameters())


@pytest.mark.parametrize("state_bits", [32, 8])
def test_grad_scaler_with_release_on_cuda(state_bits):
    a, opt_a, _ = _train(False, torch.float32, scaler=torch.amp.GradScaler("cuda"), state_bits=state_bits)
    b, opt_b, _ = _train(True, torch.float32, scaler=torch.amp.GradScaler("cuda"), state_bits=state_bits)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    c, opt_c, _ = _train(True, torch.float32, scaler=scaler, overflow_at=5, state_bits=state_bits)
    assert scaler.get_scale() == 2.0**9  # backed off once (growth_interval is 2000)
    assert int(opt_c.num_skipped_updates) == 1
