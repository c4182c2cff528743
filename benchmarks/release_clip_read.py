"""The read of one released gradient by clipping's kernel (``kernels/clipping.py``, ``from_gradients``:
its squared norm and the coefficient in one launch) at the Llama-3-8B recipe's gradient sizes, by
warps per program, against ``torch.linalg.vector_norm`` of the same gradient, as a share of a
device-to-device copy's bandwidth measured in the same process. CUDA events, median of 5 rounds of
20 calls; a call below ~25 us is the host's launch time, not the GPU's.

    python benchmarks/release_clip_read.py                 # warps 1 2 4 8
    python benchmarks/release_clip_read.py --warps 1 4
"""

from __future__ import annotations

import argparse

import torch

import fusedopt.kernels.clipping as kernel
from fusedopt import dispatch
from fusedopt.clipping import ReleaseClipping

SIZES = {"mlp 14336x4096": 14336 * 4096, "attention 4096x4096": 4096 * 4096, "kv 1024x4096": 1024 * 4096,
         "vocabulary piece 16032x4096": 16032 * 4096}  # fmt: skip


def timed(fn, rounds: int = 5, reps: int = 20) -> float:
    """Median over rounds of the mean time of ``reps`` calls, in us."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    device = torch.device("cuda")
    src = torch.empty(1 << 28, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 2 / timed(lambda: dst.copy_(src)) / 1e3  # GB/s
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy:.0f} GB/s")
    print("| gradient | " + " | ".join(f"{w} warps" for w in args.warps) + " | vector_norm |")
    print("|---" * (len(args.warps) + 2) + "|")
    default = kernel.GRADIENT_WARPS
    for name, n in SIZES.items():
        grad = torch.randn(n, dtype=torch.bfloat16, device=device)
        cells = []
        for warps in args.warps:
            kernel.GRADIENT_WARPS = warps
            kernel._CONFIGS.clear()
            clipping = ReleaseClipping(1.0, "scaled", kernel_for=dispatch.release_clip_kernel)
            us = timed(lambda c=clipping, g=grad: c.clip([0], [[g]]))
            cells.append(f"{us:.1f} us ({n * 2 / us / 1e3 / copy:.0%})")
        us = timed(lambda g=grad: torch.linalg.vector_norm(g))
        cells.append(f"{us:.1f} us ({n * 2 / us / 1e3 / copy:.0%})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    kernel.GRADIENT_WARPS = default
    kernel._CONFIGS.clear()


if __name__ == "__main__":
    main()
