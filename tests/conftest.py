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


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPO_KERNELS = os.path.join(_REPO, "kernels")

# ``python -m pytest`` puts the repository root on sys.path, where the repo's kernels/ folder would
# shadow Hugging Face's ``kernels`` package (a dependency of transformers >= 5.25, imported with its
# Trainer). fusedopt itself is installed (the README's test command), so the root is not needed.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO]


@pytest.fixture(autouse=True)
def _no_top_level_kernels():
    """Should the repo's kernels/ folder still be imported under the name ``kernels``, forget it after
    the test: fusedopt's is ``fusedopt.kernels`` (tests/test_packaging.py checks it)."""
    yield
    stray = sys.modules.get("kernels")
    if stray is not None and os.path.dirname(getattr(stray, "__file__", None) or "") == _REPO_KERNELS:
        del sys.modules["kernels"]
