"""conftest.py's interpreter shim: a helper inside a launch skips re-patching triton.language, and a launch
that fails half-way leaves the language as Triton's own restore leaves it, so the next launch is right."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter only")


@triton.jit
def _twice(x, FAIL: tl.constexpr):
    tl.static_assert(not FAIL, "failing on purpose")
    return tl.where(x > 0, x * 2, x)


@triton.jit
def _kernel(x_ptr, out_ptr, n, FAIL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _twice(_twice(x, False), FAIL), mask=offs < n)


def test_a_launch_failing_in_a_helper_leaves_the_language_restored_and_the_next_launch_right():
    x = torch.tensor([1.0, -2.0, 3.0])
    out = torch.zeros_like(x)
    with pytest.raises(Exception, match="failing on purpose"):
        _kernel[(1,)](x, out, 3, FAIL=True, BLOCK=4)
    assert tl.core.is_builtin(tl.where) and tl.core.is_builtin(tl.load)  # unpatched again
    _kernel[(1,)](x, out, 3, FAIL=False, BLOCK=4)
    assert torch.equal(out, torch.tensor([4.0, -2.0, 12.0]))
    assert tl.core.is_builtin(tl.where)
