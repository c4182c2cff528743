"""Where do released updates with a side-stream forward differ from fused=False? (CUDA only.)

    python tests/gpu/diagnose_release_streams.py

Runs test_release_streams.py's side-stream case with several budgets, with and without a
synchronisation after each backward, and prints per parameter the stream its hook ran on and the
largest difference from the fused=False baseline.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import test_release_streams as t  # noqa: E402

import fusedopt  # noqa: E402
import fusedopt.release as release  # noqa: E402


class _Env:
    def __init__(self, mb):
        self.mb = mb

    def setenv(self, name, value):
        os.environ[name] = self.mb if name == "FUSEDOPT_BUCKET_MB" else value


def _run(fused, mb, side_forward=True, sync=False):
    seen_streams = {}
    original = release.GradientRelease.on_gradient

    def on_gradient(self, p):
        stream = torch.cuda.current_stream(p.device)
        seen_streams[tuple(p.shape)] = "default" if stream == torch.cuda.default_stream(p.device) else "side"
        original(self, p)
        if sync:
            torch.cuda.synchronize()

    release.GradientRelease.on_gradient = on_gradient
    try:
        final, _ = t._train(fused, _Env(mb), side_forward=side_forward)
    finally:
        release.GradientRelease.on_gradient = original
    return final, seen_streams


def main() -> int:
    print("torch", torch.__version__, "fusedopt", fusedopt.__file__)
    base, _ = _run(False, "1")
    for mb, side, sync in (("1", True, False), ("0", True, False), ("1", True, True), ("1", False, False)):
        final, streams = _run(True, mb, side_forward=side, sync=sync)
        diffs = [
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(final, base if side else _run(False, "1", False)[0])
        ]
        print(f"budget {mb} MiB, side forward {side}, sync in hooks {sync}: hook streams {streams}; max |diff| {diffs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
