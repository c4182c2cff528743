"""Accuracy of Adafactor in fp32 against the same algorithm in fp64, on the CPU, by matrix size.

fusedopt's PyTorch reference (``FUSEDOPT_BACKEND=reference``, ``state_bits=32``) and
``torch.optim.Adafactor`` in fp32 are run for 3 steps beside ``torch.optim.Adafactor`` on float64
copies; printed: the fraction of elements further than 1e-6 + 1e-5 |p| from the fp64 result (the
GPU parity test's tolerance) and the largest difference. torch's fp32 ``norm`` on the CPU (which both
use for RMS(p) and RMS(u)) loses accuracy on large tensors, so both drift from fp64 at 4096 x 4096.

    python benchmarks/adafactor_norm_accuracy.py 1000x999 4096x4096
"""

import os
import sys

import torch

import fusedopt


def main(argv: list[str]) -> None:
    os.environ["FUSEDOPT_BACKEND"] = "reference"
    for text in argv or ["1000x999", "4096x4096"]:
        shape = tuple(int(x) for x in text.split("x"))
        gen = torch.Generator().manual_seed(0)
        p0 = torch.randn(shape, generator=gen)
        exact_norm = p0.double().norm().item()
        print(f"{text:>10} torch fp32 norm of p: relative error {abs(p0.norm().item() - exact_norm) / exact_norm:.1e}")
        grads = [torch.randn(shape, generator=gen) * 1e-2 for _ in range(3)]
        ours, torch32, exact = (p0.clone().requires_grad_(), p0.clone().requires_grad_(), p0.double().requires_grad_())
        opts = [fusedopt.Adafactor([ours], state_bits=32), torch.optim.Adafactor([torch32])]
        opts.append(torch.optim.Adafactor([exact]))
        for g in grads:
            ours.grad, torch32.grad, exact.grad = g.clone(), g.clone(), g.double()
            for opt in opts:
                opt.step()
        for name, x in (("fusedopt reference", ours), ("torch.optim.Adafactor fp32", torch32)):
            d = (x.detach().double() - exact.detach()).abs()
            bad = (d > 1e-6 + 1e-5 * exact.detach().abs()).double().mean().item()
            print(f"{text:>10} {name:<28} beyond tolerance {bad:.4f}, largest {d.max().item():.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
