"""Training quality on real text: fusedopt's defaults against fp32 torch.optim.AdamW (CPU, small).

A byte-level model (embeddings of the previous 12 bytes -> MLP -> next byte) trained on
Python's own standard-library source, which every machine has. fusedopt runs its defaults
(8-bit moments, bf16 parameters + int8 correction) and with 4-bit moments; the reference
is fp32 parameters with torch.optim.AdamW. Same data, same initial weights, same schedule.
"""

import math

import torch

import fusedopt
from fusedopt.profile.models import stdlib_source_bytes

CONTEXT, STEPS, BATCH = 12, 250, 32


def _corpus(n_bytes: int = 400_000) -> torch.Tensor:
    return stdlib_source_bytes(n_bytes).long()


class ByteModel(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(CONTEXT * dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU()
        )
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, x):
        return self.head(self.mlp(self.embed(x).flatten(1)))


def _batches(data: torch.Tensor, seed: int, n: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, data.numel() - CONTEXT - 1, (BATCH,), generator=gen)
        window = data[idx[:, None] + torch.arange(CONTEXT + 1)]
        yield window[:, :-1], window[:, -1]


def _train(make_opt, dtype, data, fused=False):
    torch.manual_seed(0)
    model = ByteModel().to(dtype)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, STEPS) / STEPS))
    )
    for x, y in _batches(data[:-20_000], 1, STEPS):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    with torch.no_grad():
        held_out = [torch.nn.functional.cross_entropy(model(x).float(), y) for x, y in _batches(data[-20_000:], 2, 8)]
    return torch.stack(held_out).mean().item()


def test_defaults_train_within_a_few_percent_of_fp32_adamw():
    data = _corpus()
    fp32 = _train(lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01), torch.float32, data)
    default = _train(lambda p: fusedopt.AdamW(p, lr=3e-3, weight_decay=0.01), torch.bfloat16, data)
    four_bit = _train(lambda p: fusedopt.AdamW(p, lr=3e-3, weight_decay=0.01, state_bits=4), torch.bfloat16, data)
    assert fp32 < 0.8 * math.log(256)  # it learned something (uniform guessing is ln 256 = 5.55)
    print(f"held-out loss: fp32 AdamW {fp32:.4f}, fusedopt default {default:.4f}, 4-bit {four_bit:.4f}")
    assert default <= fp32 * 1.03, (default, fp32)
    assert four_bit <= fp32 * 1.06, (four_bit, fp32)
