"""Does test_check_streams.py's late-gradient case catch a side stream that does not wait? (CUDA only.)

    python tests/gpu/diagnose_check_streams.py

Runs ``_train(ahead=True, late_gradients=True)`` as it is, and again with ``CheckStreams.stream``
returning the side stream without its wait for the current stream, and prints how many
parameter elements differ from the run with every check on the current stream, and the skip
counter. The test is meaningful only if the second run differs.
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))

import test_check_streams as t  # noqa: E402

from fusedopt.streams import CheckStreams  # noqa: E402


def _unjoined(self, device):
    side = self._streams.get(device.index)
    if side is None:
        side = self._streams[device.index] = torch.cuda.Stream(device, priority=-1)
    return side


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    _, _, base = t._train(ahead=False)
    expected = base[-1][0]
    for label, context in (("with the wait", mock.patch.object(CheckStreams, "stream", CheckStreams.stream)),
                           ("without it", mock.patch.object(CheckStreams, "stream", _unjoined))):  # fmt: skip
        with context:
            opt, params, _ = t._train(ahead=True, late_gradients=True)
        differ = sum(int((a != b).sum()) for a, b in zip(expected, params))
        nonfinite = sum(int((~torch.isfinite(p)).sum()) for p in params)
        n = sum(p.numel() for p in params)
        print(f"{label:14s} {differ:9d} of {n} elements differ, {nonfinite} non-finite, "
              f"skipped {int(opt.num_skipped_updates)} (expected 2)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
