"""Shared test setup.

Without a GPU the Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be set
before triton compiles anything, so it is set here, before any test module imports them.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Small tensors: one intra-op thread is faster than two, and far faster on a busy 2-core host
# (pointwise ops on a few thousand elements were seen taking milliseconds with two threads).
torch.set_num_threads(1)


@pytest.fixture
def device() -> str:
    """The device kernel tests run on: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"
