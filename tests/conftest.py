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


def _patch_the_language_once_per_launch() -> None:
    """The Triton interpreter patches ``triton.language`` at every launch and again at every call of a
    ``@triton.jit`` helper inside it (``inspect.getmembers`` over the module each time: about a quarter of an
    interpreted update's time). Inside a launch, a helper whose language modules the launch has patched
    skips the repeat; the launch's own patch applies and is restored as before. A Triton without these
    internals is left as it is."""
    import inspect

    try:
        from triton.runtime import interpreter
        from triton.runtime.interpreter import GridExecutor, _LangPatchScope, _patch_lang, tl
    except ImportError:
        return
    launches: list[set[int]] = []  # per launch under way, the language modules it has patched
    run_launch = GridExecutor.__call__

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if launches and langs and langs <= launches[-1]:
            return _LangPatchScope()
        scope = _patch_lang(fn)
        if launches:
            launches[-1].update(langs)
        return scope

    GridExecutor.__call__ = launch
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()

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
