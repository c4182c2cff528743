"""How often the log grid refits a block: the share of blocks (and of 8-block kernel programs) that
leave their decayed grid at each step of Adam's second moment (CPU, the PyTorch reference).

    python benchmarks/loggrid_refits.py [--elements 524288] [--steps 60] [--beta2 0.999]

Gradients are standard normal, either the same every step (as ``step_ab.py``'s timing loop) or
drawn afresh. A refitted block is one whose stored top or spacing is not the decayed one; the
fused kernel's program holds 8 blocks (1024 elements), so a program refits if any of its blocks does.
"""

from __future__ import annotations

import argparse

import torch

from fusedopt.codecs.loggrid import BLOCK, LogGridCodec

BLOCKS_PER_PROGRAM = 1024 // BLOCK


def refit_shares(n: int, steps: int, beta2: float, constant: bool, seed: int = 0) -> list[tuple[float, float]]:
    """(share of blocks, share of programs) refitted at each step 1..steps."""
    generator = torch.Generator().manual_seed(seed)
    codec = LogGridCodec(torch.Size([n]), "v")

    def bits():
        return torch.randint(-(2**31), 2**31 - 1, (n,), generator=generator, dtype=torch.int64).to(torch.int32)

    g = torch.randn(n, generator=generator)
    stored = codec.encode(torch.zeros(n), bits)
    shares = []
    for _ in range(steps):
        if not constant:
            g = torch.randn(n, generator=generator)
        x = beta2 * codec.decode(stored) + (1 - beta2) * g * g
        new = codec.encode_decayed(x, bits, stored, beta2)
        refit = (new[".scales"] != stored[".scales"] * beta2) | (new[".steps"] != stored[".steps"])
        programs = refit[: refit.numel() // BLOCKS_PER_PROGRAM * BLOCKS_PER_PROGRAM].view(-1, BLOCKS_PER_PROGRAM)
        shares.append((refit.float().mean().item(), programs.any(dim=1).float().mean().item()))
        stored = new
    return shares


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=128 * 4096)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--beta2", type=float, default=0.999)
    args = parser.parse_args(argv)
    for constant in (True, False):
        shares = refit_shares(args.elements, args.steps, args.beta2, constant)
        print("constant gradients" if constant else "fresh gradients each step")
        for step in (*range(1, 7), *range(args.steps - 5, args.steps + 1)):
            blocks, programs = shares[step - 1]
            print(f"  step {step:4d}: blocks refitted {100 * blocks:5.1f}%, programs {100 * programs:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
