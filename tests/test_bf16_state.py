"""bf16 moments (state_bits=16) follow the EMA thanks to stochastic rounding."""

import torch

import fusedopt
from fusedopt import rng
from fusedopt.rounding import round_stochastic


def _decay_run(opt_cls, slot, beta, steps, **kwargs):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 96, generator=gen))
    opt = opt_cls([w], lr=0.0, state_bits=16, **kwargs)
    w.grad = torch.randn(w.shape, generator=gen) * 3
    opt.step()
    start = opt.state[w][slot].float().clone()
    assert opt.state[w][slot].dtype == torch.bfloat16
    for _ in range(steps):  # the gradient stops: the moment must decay as beta^k
        w.grad = torch.zeros_like(w)
        opt.step()
    return start, opt.state[w][slot].float()


def test_second_moment_decays_as_beta2_power():
    start, end = _decay_run(fusedopt.AdamW, "exp_avg_sq", 0.999, 2000, betas=(0.9, 0.999), weight_decay=0.0)
    ratio = end.mean().item() / (start.mean().item() * 0.999**2000)
    assert abs(ratio - 1) < 0.05, ratio
    # per element too: most elements stay near their own expectation
    per_element = end / (start * 0.999**2000)
    assert (per_element - 1).abs().median().item() < 0.1


def test_nearest_rounding_would_freeze_the_second_moment():
    """Why stochastic rounding: v * 0.999 rounds back to v in bf16."""
    v = torch.rand(4096).bfloat16() + 0.5
    frozen = v.clone()
    for _ in range(100):
        frozen = (frozen.float() * 0.999).bfloat16()
    assert torch.equal(frozen, v)


def test_first_moment_decays_as_beta1_power():
    start, end = _decay_run(fusedopt.AdamW, "exp_avg", 0.9, 20, betas=(0.9, 0.999), weight_decay=0.0)
    ratio = (end.abs().mean() / (start.abs().mean() * 0.9**20)).item()
    assert abs(ratio - 1) < 0.05, ratio


def test_momentum_buffer_decays_for_sgd_and_lion():
    start, end = _decay_run(fusedopt.SGD, "momentum_buffer", 0.99, 300, momentum=0.99)
    assert abs(end.abs().mean().item() / (start.abs().mean().item() * 0.99**300) - 1) < 0.05
    start, end = _decay_run(fusedopt.Lion, "exp_avg", 0.99, 300, betas=(0.9, 0.99))
    assert abs(end.abs().mean().item() / (start.abs().mean().item() * 0.99**300) - 1) < 0.05


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    gen = torch.Generator().manual_seed(1)
    n = 1 << 14
    x = torch.randn(n, generator=gen) * 10 ** torch.randint(-6, 4, (n,), generator=gen).float()
    x[:3] = torch.tensor([1.0, -0.0, 2.5])  # exactly representable: must come back unchanged
    for dtype in (torch.bfloat16, torch.float16):
        nearest = x.to(dtype)
        up = torch.nextafter(nearest, torch.full_like(nearest, float("inf")))
        down = torch.nextafter(nearest, torch.full_like(nearest, float("-inf")))
        below = torch.where(nearest.float() <= x, nearest, down).float()
        above = torch.where(nearest.float() >= x, nearest, up).float()
        draws = torch.stack(
            [
                round_stochastic(x, rng.uniform_bits(rng.host_key(0, 0, s), torch.tensor(1.0), x.shape, "cpu"), dtype)
                for s in range(64)
            ]
        ).float()
        assert ((draws == below) | (draws == above)).all(), dtype
        # unbiased: the mean rounding error, in units of the gap, averages out to ~0
        gap = (above - below).clamp_min(torch.finfo(torch.float32).tiny)
        bias = ((draws.mean(0) - x) / gap)[above != below].mean().item()
        assert abs(bias) < 0.01, (dtype, bias)
        # and the probability of rounding up follows the position in the gap
        frac = ((x - below) / gap)[above != below]
        p_up = (draws == above).double().mean(0)[above != below]
        assert torch.corrcoef(torch.stack([frac.double(), p_up]))[0, 1] > 0.9
        assert torch.equal(draws[:, :3], x[:3].expand(64, 3))
