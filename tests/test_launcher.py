"""The direct launcher's bookkeeping (kernels/launcher.py), with a stand-in for a Triton kernel.

On CPU there is no compiled kernel to call, so a fake JIT function records what reaches it:
which launches go through Triton, which go straight to the compiled launcher, and with which
arguments. That the compiled launcher updates exactly as Triton's own launch does is checked
on the GPU (tests/gpu/test_direct_launch.py).
"""

from types import SimpleNamespace

import pytest
import torch

from fusedopt.kernels import launcher as launcher_module
from fusedopt.kernels.launcher import DirectLauncher, LaunchConfig


class FakeCompiled:
    """A compiled kernel: records the direct launches."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "function", "metadata"

    @property
    def run(self):
        return lambda *args: self.log.append(("direct", args))


class FakeJIT:
    """A @triton.jit function with parameters (x_ptr, n, scale, A: constexpr, B: constexpr)."""

    def __init__(self, names=("x_ptr", "n", "scale", "A", "B"), constexprs=("A", "B")):
        self.params = [SimpleNamespace(name=name, is_constexpr=name in constexprs) for name in names]
        self.device_caches = {}
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log)

        return launch


class CpuDirectLauncher(DirectLauncher):
    """Takes CPU tensors as if they were on CUDA device 0."""

    def _device(self, first):
        return 0 if self.usable else None

    @staticmethod
    def _stream(device):
        return 7


@pytest.fixture
def on_device_zero(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def kinds(log):
    return [entry[0] for entry in log]


def test_first_launch_goes_through_triton_later_ones_direct(on_device_zero):
    fn = FakeJIT()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    x = torch.randn(32)
    config = LaunchConfig({"B": 2, "A": 1}, {"num_warps": 4})  # given out of signature order
    launch(3, (x, 32, 0.5), config)
    assert fn.log == [("triton", (3,), (x, 32, 0.5), {"B": 2, "A": 1, "num_warps": 4})]
    launch(5, (x, 48, 0.25), config)  # same classes: 48 is, like 32, a multiple of 16
    hooks = launch._hooks()
    assert fn.log[1] == ("direct", (5, 1, 1, 7, "function", "metadata", None, *hooks, x, 48, 0.25, 1, 2))


def test_every_specialisation_triton_makes_is_a_separate_entry(on_device_zero):
    fn = FakeJIT()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    config = LaunchConfig({"A": 1, "B": 2}, {})
    x = torch.randn(40)
    launch(1, (x, 32, 0.5), config)
    launch(1, (x[1:], 32, 0.5), config)  # a pointer off 16-byte alignment
    launch(1, (x.double(), 32, 0.5), config)  # another dtype
    launch(1, (x, 33, 0.5), config)  # not a multiple of 16
    launch(1, (x, 1, 0.5), config)  # Triton specialises the value 1
    launch(1, (x, 2**40, 0.5), config)  # a 64-bit integer
    launch(1, (x, 32, 0.5), LaunchConfig({"A": 1, "B": 3}, {}))  # another constexpr
    launch(1, (x, 32, 0.5), LaunchConfig({"A": 1, "B": 2}, {"num_warps": 8}))  # another option
    assert kinds(fn.log) == ["triton"] * 8
    launch(1, (x[1:], 17, 0.5), config)  # misaligned and not a multiple of 16: not seen yet
    launch(1, (x[1:], 32, 0.5), config)  # seen above: direct
    assert kinds(fn.log)[8:] == ["triton", "direct"]


def test_launch_hooks_send_every_launch_through_triton(on_device_zero, monkeypatch):
    fn = FakeJIT()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    config = LaunchConfig({"A": 1, "B": 2}, {})
    x = torch.randn(16)
    launch(1, (x, 16, 0.5), config)
    monkeypatch.setattr(launch, "_knobs", SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None))
    launch(1, (x, 16, 0.5), config)
    chain = SimpleNamespace(calls=[print])  # Triton 3.9's HookChain with a hook in it
    monkeypatch.setattr(launch, "_knobs", SimpleNamespace(launch_enter_hook=None, launch_exit_hook=chain))
    launch(1, (x, 16, 0.5), config)
    monkeypatch.setattr(launch, "_knobs", SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    launch(1, (x, 16, 0.5), config)
    assert kinds(fn.log) == ["triton", "triton", "triton", "direct"]


def test_a_kernel_without_the_compiled_interface_disables_direct_launches(on_device_zero):
    config = LaunchConfig({"A": 1, "B": 2}, {})
    x = torch.randn(16)

    class Bare(FakeJIT):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.log.append(("triton", grid)) or object()

    fn = Bare()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    launch(1, (x, 16, 0.5), config)
    launch(1, (x, 16, 0.5), config)
    assert not launch.usable
    assert kinds(fn.log) == ["triton", "triton"]


def test_constexprs_before_runtime_arguments_are_launched_through_triton(on_device_zero):
    fn = FakeJIT(names=("x_ptr", "A", "n", "scale", "B"))
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    assert not launch.usable
    config = LaunchConfig({"A": 1, "B": 2}, {})
    x = torch.randn(16)
    launch(1, (x, 16, 0.5), config)
    launch(1, (x, 16, 0.5), config)
    assert kinds(fn.log) == ["triton", "triton"]


def test_environment_switch_turns_direct_launches_off(monkeypatch, on_device_zero):
    monkeypatch.setattr(launcher_module, "DIRECT_LAUNCH", False)
    assert not CpuDirectLauncher(FakeJIT(), tensors=1, ints=1).usable


def test_arguments_off_the_declared_layout_are_launched_through_triton(on_device_zero):
    fn = FakeJIT()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    config = LaunchConfig({"A": 1, "B": 2}, {})
    x = torch.randn(16)
    launch(1, (x, 16, 1), config)  # an int where a float belongs: Triton would type it i32
    launch(1, (x, 16, 1), config)
    assert not launch.usable
    assert kinds(fn.log) == ["triton", "triton"]


def test_a_resolved_launch_goes_direct_with_new_values(on_device_zero):
    fn = FakeJIT()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    config = LaunchConfig({"A": 1, "B": 2}, {})
    x, y = torch.randn(32), torch.randn(48)
    assert launch.resolve((x, 32, 0.5), config) is None  # not compiled yet
    launch(3, (x, 32, 0.5), config)
    resolved = launch.resolve((x, 32, 0.5), config)
    assert resolved is not None
    assert launch.launch_resolved(resolved, 4, (y, 48, 0.25))
    assert fn.log[1] == ("direct", (4, 1, 1, 7, "function", "metadata", None, *launch._hooks(), y, 48, 0.25, 1, 2))
    # another specialisation has its own entry, not yet compiled
    assert launch.resolve((x[1:], 32, 0.5), config) is None


def test_a_resolved_launch_declines_whenever_a_plain_launch_would_not_go_direct(on_device_zero, monkeypatch):
    fn = FakeJIT()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    config = LaunchConfig({"A": 1, "B": 2}, {})
    x = torch.randn(16)
    launch(1, (x, 16, 0.5), config)
    resolved = launch.resolve((x, 16, 0.5), config)
    other = CpuDirectLauncher(FakeJIT(), tensors=1, ints=1)
    assert not other.launch_resolved(resolved, 1, (x, 16, 0.5))  # another launcher's (kernel's) entry
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not launch.launch_resolved(resolved, 1, (x, 16, 0.5))  # another current device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_knobs", SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None))
    assert not launch.launch_resolved(resolved, 1, (x, 16, 0.5))  # a launch hook wants to see it
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launch.usable = False  # FUSEDOPT_DIRECT_LAUNCH=0 or a test's switch
    assert not launch.launch_resolved(resolved, 1, (x, 16, 0.5))
    assert kinds(fn.log) == ["triton"]  # none of the declined ones launched anything


def test_launch_remembered_builds_the_key_once_per_variant(on_device_zero, monkeypatch):
    fn = FakeJIT()
    launch = CpuDirectLauncher(fn, tensors=1, ints=1)
    config = LaunchConfig({"A": 1, "B": 2}, {})
    keys = []
    real_key = launch._key
    monkeypatch.setattr(launch, "_key", lambda *args: keys.append(args) or real_key(*args))
    remembered = {}
    x = torch.randn(64)
    for i in range(4):
        launcher_module.launch_remembered(launch, remembered, "aligned", 2, (x, 16, float(i)), config)
    assert kinds(fn.log) == ["triton"] + ["direct"] * 3
    assert fn.log[-1][1][-3:] == (3.0, 1, 2)
    assert len(keys) == 2  # the first launch's, and resolving it: none for the direct ones
    launcher_module.launch_remembered(launch, remembered, "misaligned", 2, (x[1:], 16, 0.0), config)
    assert kinds(fn.log)[-1] == "triton" and len(remembered) == 2
    launch.usable = False  # declined: through Triton again, and nothing to remember
    launcher_module.launch_remembered(launch, remembered, "aligned", 2, (x, 16, 0.0), config)
    assert kinds(fn.log)[-1] == "triton" and remembered["aligned"] is None
