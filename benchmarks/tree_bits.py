"""Fingerprint of training results through the public API, to compare two source trees bit for bit.

Usage (repo root, CUDA machine): ``PYTHONPATH=<tree> python benchmarks/tree_bits.py --out bits.json``
with ``<tree>`` a checkout whose ``fusedopt/kernels`` points at its ``kernels/``. Each configuration
(algorithm x state_bits x master_weight_bits x dtype x fused) trains a small model of odd and
bucketable shapes for a few steps; the SHA-256 of every parameter and state tensor is recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json

import torch

import fusedopt

ALGORITHMS = {"adamw": (fusedopt.AdamW, {}), "sgd": (fusedopt.SGD, dict(momentum=0.9)), "lion": (fusedopt.Lion, {})}
SHAPES = [(256, 512), (512, 256), (1000, 37), (4096,), (64, 64), (300, 300)]


def fingerprint(name, state_bits, master_bits, dtype, fused, device) -> str:
    cls, kwargs = ALGORITHMS[name]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SHAPES]
    options = dict(state_bits=state_bits, master_weight_bits=master_bits, fused=fused, max_grad_norm=None)
    opt = cls(params, lr=1e-3, **options, **kwargs)
    for _ in range(4):
        grads = [torch.randn(s, generator=gen).to(device, dtype) for s in SHAPES]
        loss = sum((p * g).sum() for p, g in zip(params, grads))
        loss.backward()
        opt.step()
        opt.zero_grad()
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().view(torch.uint8 if p.dtype != torch.float32 else torch.int32).numpy().tobytes())
        for key in sorted(opt.state[p]):
            t = opt.state[p][key].detach().cpu().contiguous()
            h.update(key.encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = {}
    grid = itertools.product(ALGORITHMS, (32, 16, 8, 4), (24, None), (torch.bfloat16, torch.float32), (False, True))
    for name, bits, master, dtype, fused in grid:
        if dtype == torch.float32 and master is None:
            continue  # master_weight_bits is ignored for fp32 parameters
        key = f"{name} bits={bits} master={master} {str(dtype)[6:]} fused={fused}"
        out[key] = fingerprint(name, bits, master, dtype, fused, args.device)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{len(out)} configurations fingerprinted")


if __name__ == "__main__":
    main()
