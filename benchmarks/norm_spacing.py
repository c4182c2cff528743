"""How far the normalised first moment (``fusedopt/codecs/normalised.py``) drifts from fp32's, by level spacing.

A simulated AdamW gradient stream (a persistent component plus noise, rows scaled over decades) is
run through exact fp32 moments and, side by side, through a first moment stored with the codec
(``decode -> EMA -> encode`` every step, in units of the exact ``sqrt(v)``, so only the first
moment's format differs). Reported: the rms error of the stored ``m / sqrt(v)`` against fp32's,
relative to fp32's rms, averaged over the second half of the steps. The levels' half-range is
either the block's absmax (``clip=None``) or at most ``clip`` times the block's rms.

    python benchmarks/norm_spacing.py            # CPU, about a minute
"""

from __future__ import annotations

import argparse

import torch

from fusedopt import rng
from fusedopt.codecs.normalised import NormalisedCodec


def drift(bits: int, clip: float | None, steps: int, shape=(64, 256), beta1: float = 0.9) -> float:
    codec = NormalisedCodec(bits, clip, torch.Size(shape), f"norm{bits}")
    gen = torch.Generator().manual_seed(1)
    rows = torch.exp(1.5 * torch.randn(shape[0], 1, generator=gen))
    signal = 0.3 * torch.randn(shape, generator=gen)
    m, v = torch.zeros(shape), torch.zeros(shape)
    stored = codec.zeros(torch.Size(shape), torch.device("cpu"))
    frame = torch.zeros(shape)  # the v the stored m is in units of (the previous step's)
    key = rng.host_key(0, 0, rng.STREAM_SHARED)
    errors = []
    for step in range(1, steps + 1):
        g = (torch.randn(shape, generator=gen) + signal) * rows
        v = 0.999 * v + 0.001 * g * g
        quantised = beta1 * codec.decode(stored, frame=frame) + (1 - beta1) * g
        m = beta1 * m + (1 - beta1) * g
        words = rng.moment_word(rng.uniform_bits(key, torch.tensor(float(step)), torch.Size(shape), "cpu"), 0)
        stored = codec.encode(quantised, lambda w=words: w, frame=v)
        frame = v
        if step > steps // 2:
            r = v.sqrt()
            err = (codec.decode(stored, frame=v) - m) / r
            errors.append((err.pow(2).mean() / (m / r).pow(2).mean()).sqrt().item())
    return sum(errors) / len(errors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'bits':>4} {'half-range':<16} rms error of m / sqrt(v), relative")
    for bits, clips in ((2, (None, 0.75, 1.2, 1.65, 2.25)), (4, (None, 2.6))):
        for clip in clips:
            label = "block absmax" if clip is None else f"{clip} x block rms"
            print(f"{bits:>4} {label:<16} {drift(bits, clip, args.steps):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
