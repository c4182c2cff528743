"""Shared test setup.

Without a GPU the Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be set
before triton compiles anything, so it is set here, before any test module imports them.
"""

import os
import sys

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


_REPO_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


@pytest.fixture(autouse=True)
def _no_top_level_kernels():
    """``python -m pytest`` puts the repository root on sys.path, where transformers' probe for its
    optional ``kernels`` package (run once, when its Trainer is imported) imports the repo's kernels/
    folder under that name. Forget it again: fusedopt's is ``fusedopt.kernels``, and
    tests/test_packaging.py checks that no top-level ``kernels`` exists."""
    yield
    stray = sys.modules.get("kernels")
    if stray is not None and os.path.dirname(getattr(stray, "__file__", None) or "") == _REPO_KERNELS:
        del sys.modules["kernels"]
