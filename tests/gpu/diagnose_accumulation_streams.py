"""Do the accumulation-buffer stream scenarios of test_release_streams.py catch the bug? (CUDA only.)

    python tests/gpu/diagnose_accumulation_streams.py

Runs each scenario of ``test_accumulation_buffers_across_streams`` as it is, and again with
``ready_on_current_stream`` replaced by the identity (no wait for the buffer's writer, no
``record_stream``: the code without the stream fix), and prints per scenario how many
parameter elements differ from the all-default-stream run. The test is meaningful only if the
second run differs.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import test_release_streams as t  # noqa: E402

import fusedopt.release as release  # noqa: E402


def _differing(expected, got) -> int:
    return sum(int((a != b).sum()) for a, b in zip(expected, got))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    expected, _ = t._accumulate(None)
    fixed = release.ready_on_current_stream
    for scenario in ("freed_buffer", "caller_streams"):
        for label, function in (("with the fix", fixed), ("without it", lambda buffer, writer: buffer)):
            release.ready_on_current_stream = function
            try:
                got, _ = t._accumulate(scenario)
            finally:
                release.ready_on_current_stream = fixed
            n = sum(p.numel() for p in got)
            print(f"{scenario:15s} {label:13s} {_differing(expected, got):9d} of {n} elements differ", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
