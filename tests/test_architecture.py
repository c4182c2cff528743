"""The package's shape: no import cycles, codecs and algorithms as plug-ins, one decision of the path.

A state format that exists only for the tests (``plugins/linear_codec.py``) and an algorithm
without a kernel branch (``plugins/sign_sgd.py``) are each one file plus one registration; both
train through the public API on the reference path, are named in checkpoints, and are refused
clearly where the fused kernel is forced.
"""

from __future__ import annotations

import ast
import copy
import pathlib

import pytest
import torch
from plugins.linear_codec import NAME as LINEAR8
from plugins.sign_sgd import SignSGD

import fusedopt
from fusedopt.codecs import codec_for

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"fusedopt": ROOT / "fusedopt", "fusedopt.kernels": ROOT / "kernels"}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (function bodies included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `from a.b import c`: c may be a name, not a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package imports its own modules (its __init__ re-exports them): that edge is not a cycle
    graph = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in graph.items()}
    assert "fusedopt.dispatch" in graph and "fusedopt.codecs.blockwise" in graph  # the walk sees the package
    assert "fusedopt.codecs.base" in graph["fusedopt.codecs.blockwise"]  # and its relative imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_optimizer_never_imports_the_kernel_layer():
    modules = _modules()
    names = ("optimizer", "state_store", "gradients", "release", "checkpoint", "adamw", "sgd")
    for name in (f"fusedopt.{name}" for name in names):
        imported = _imports(name, modules[name], modules)
        assert not {m for m in imported if m.startswith("fusedopt.kernels")}, name


# --- a codec that exists only for the tests ------------------------------------------------


def _train(opt_cls, steps=10, seed=0, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(48, 80, generator=gen))
    b = torch.nn.Parameter(torch.randn(80, generator=gen))
    opt = opt_cls([w, b], lr=kwargs.pop("lr", 5e-2), min_compress_numel=0, **kwargs)
    target = torch.randn(48, 80, generator=gen)
    losses = []
    for _ in range(steps):
        loss = ((w + b - target) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w, b, opt, losses


def test_a_registered_codec_trains_through_the_public_api(monkeypatch):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "auto")
    w, b, opt, losses = _train(fusedopt.AdamW, state_format=LINEAR8)
    codec = codec_for(8, w.shape, 0, state_format=LINEAR8)
    assert codec.name == LINEAR8 and codec.kernel_format is None
    assert opt.state[w]["exp_avg.codes"].dtype == torch.int8  # the format's own layout
    assert "exp_avg" in opt.state[b]  # 1-D: exact fp32 moments whatever the format
    assert losses[-1] < 0.6 * losses[0]
    w32, _, _, _ = _train(fusedopt.AdamW, state_bits=32)
    assert (w - w32).abs().max() > 0  # not by accident the fp32 path


def test_a_registered_codec_is_named_in_checkpoints_and_resumes_bit_for_bit():
    w, b, opt, _ = _train(fusedopt.AdamW, steps=3, state_format=LINEAR8)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["fusedopt"]["codecs"][0] == {"exp_avg": LINEAR8, "exp_avg_sq": LINEAR8}
    assert saved["param_groups"][0]["state_format"] == LINEAR8
    w2 = torch.nn.Parameter(w.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = fusedopt.AdamW([w2, b2], lr=1e-2, min_compress_numel=0)  # the saved group's format wins
    opt2.load_state_dict(saved)
    for p, q in ((w, w2), (b, b2)):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(w, w2) and torch.equal(b, b2)
    assert all(torch.equal(opt.state[w][k], opt2.state[w2][k]) for k in opt.state[w])


def test_a_checkpoint_of_an_unknown_format_is_refused_by_name():
    w, b, opt, _ = _train(fusedopt.AdamW, steps=2, state_format=LINEAR8)
    saved = copy.deepcopy(opt.state_dict())
    saved["fusedopt"]["codecs"][0]["exp_avg"] = "no-such-format"
    del saved["param_groups"][0]["state_format"]
    fresh = fusedopt.AdamW([torch.nn.Parameter(w.detach().clone()), b], min_compress_numel=0)
    with pytest.raises(ValueError, match="'no-such-format', which this fusedopt does not know"):
        fresh.load_state_dict(saved)


def test_a_registered_codec_converts_to_and_from_the_block_formats():
    w, b, opt, _ = _train(fusedopt.AdamW, steps=3, state_format=LINEAR8)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["state_format"] = None  # continue in the 8-bit block format
    fresh = fusedopt.AdamW([torch.nn.Parameter(w.detach().clone()), b], min_compress_numel=0)
    with pytest.warns(UserWarning, match="test-linear8"):
        fresh.load_state_dict(saved)
    (p, _) = fresh.param_groups[0]["params"]
    assert fresh.state[p]["exp_avg.codes"].dtype == torch.uint8
    source = codec_for(8, w.shape, 0, state_format=LINEAR8)
    target = codec_for(8, w.shape, 0)
    before = source.decode({s: opt.state[w]["exp_avg" + s] for s in source.suffixes})
    after = target.decode({s: fresh.state[p]["exp_avg" + s] for s in target.suffixes})
    assert (after - before).abs().max() <= 0.07 * before.abs().max()


def test_an_unknown_state_format_is_refused():
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="Invalid state_format: 'block9'"):
        fusedopt.AdamW([w], state_format="block9")


@pytest.mark.parametrize("name", ["rot8", "rot4", "rot2", "rot4-log4", "norm2-log4", "norm4-log4", "block8-square"])
def test_a_removed_state_format_is_refused_saying_so(name):
    """A format earlier versions offered: the error says it was removed, why, and which formats exist."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError) as error:
        fusedopt.AdamW([w], state_format=name)
    message = str(error.value)
    assert message.startswith(f"Invalid state_format: '{name}' was removed from fusedopt (")
    assert "the state formats now are fp32, bf16, block8, block4, norm2-root4" in message


def test_the_built_in_formats_and_the_names_a_checkpoint_may_record():
    """Five state formats; a checkpoint may also name norm2-root4's moments and Adafactor's statistics.
    In a fresh process: this module registers a plugin format."""
    import subprocess
    import sys

    code = "from fusedopt.codecs import known_formats, registered_formats; print(registered_formats(), known_formats())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    registered, known = out.split(") (")
    assert registered == "('fp32', 'bf16', 'block8', 'block4', 'norm2-root4'"
    internal = "'root4', 'norm2', 'norm2-root4', 'fp32-rows', 'fp32-cols', 'fp32-scalar')\n"
    assert known == "'fp32', 'bf16', 'block8', 'block4', " + internal


def test_a_removed_formats_name_is_not_reused():
    from fusedopt.codecs import REMOVED_FORMATS, register_codec

    assert {"rot4", "log4", "norm4", "block8-square"} <= set(REMOVED_FORMATS)
    with pytest.raises(ValueError, match="'rot4' belonged to a removed format"):
        register_codec("rot4", lambda signed, shape: codec_for(8, shape, 0))


def test_forcing_the_kernel_on_a_format_without_a_kernel_branch_is_a_clear_error(monkeypatch, device):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    w = torch.nn.Parameter(torch.randn(48, 80, device=device))
    opt = fusedopt.AdamW([w], min_compress_numel=0, state_format=LINEAR8)
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match="no branch for the state format 'test-linear8'"):
        opt.step()
    assert torch.equal(w, before)


# --- an algorithm without a kernel branch --------------------------------------------------


def test_an_algorithm_in_one_file_trains_on_the_reference_path(monkeypatch):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "auto")
    w, b, opt, losses = _train(SignSGD, steps=8, state_bits=8)
    assert losses[-1] < 0.75 * losses[0]
    assert opt.state[w]["momentum.codes"].dtype == torch.uint8  # compressed through the codecs
    saved = copy.deepcopy(opt.state_dict())
    assert saved["fusedopt"]["algorithm"] == "test-sign-sgd"
    with pytest.raises(ValueError, match="'test-sign-sgd' state"):
        fusedopt.AdamW([torch.nn.Parameter(w.detach().clone()), b], min_compress_numel=0).load_state_dict(saved)


def test_an_algorithm_in_one_file_matches_its_math_exactly():
    """fp32 state: the reference applies the file's math and nothing else."""
    w, _, opt, _ = _train(SignSGD, steps=1, lr=1e-2, state_bits=32)
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(48, 80, generator=gen)
    b0 = torch.randn(80, generator=gen)
    target = torch.randn(48, 80, generator=gen)
    g = 2 * (w0 + b0 - target) / target.numel()
    assert torch.equal(w.detach(), w0 - 1e-2 * (g * 0.1).sign())


def test_forcing_the_kernel_on_an_algorithm_without_a_kernel_branch_is_a_clear_error(monkeypatch, device):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    w = torch.nn.Parameter(torch.randn(48, 80, device=device))
    opt = SignSGD([w], min_compress_numel=0)
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match="no branch for fusedopt.SignSGD"):
        opt.step()
    assert torch.equal(w, before)
    assert not opt.state[w] or float(opt.state[w]["step"]) == 0


def test_an_algorithms_internal_formats_are_not_state_formats():
    """Adafactor's row and column statistics are registered for its checkpoints, not for users."""
    from fusedopt.codecs import known_formats, registered_formats

    assert "fp32-rows" in known_formats() and "fp32-rows" not in registered_formats()
    with pytest.raises(ValueError, match="Invalid state_format: 'fp32-rows'"):
        fusedopt.AdamW([torch.nn.Parameter(torch.zeros(64, 64))], state_format="fp32-rows")


# --- narrow interfaces between modules -----------------------------------------------------


def _private_names(tree: ast.Module) -> set[str]:
    """Underscore names a module's classes define: attributes set on ``self``/``cls``, names bound
    in a class body (methods, class attributes, ``__slots__`` entries)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                for target in targets:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        names.update(ast.literal_eval(item.value))
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def _private_reads(sources: dict[str, str]) -> list[str]:
    """``X._name`` in one module (X not ``self`` or ``cls``) where ``_name`` is private to a class of
    another module: one module reaching into another's state instead of asking through a method.
    (Underscore attributes of torch's objects, ``scaler._scale``, are not fusedopt's to narrow.)"""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    defined = {name: _private_names(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != name)) - defined[name]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in elsewhere):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_the_private_state_of_another_modules_class():
    sources = {name: path.read_text() for name, path in _modules().items()}  # the kernels and codecs too
    assert "fusedopt.optimizer" in sources and "fusedopt.kernels.update" in sources
    assert "_window" in _private_names(ast.parse(sources["fusedopt.dispatch"]))  # the scan sees the classes' state
    found = _private_reads(sources)
    assert not found, "\n".join(found)


def test_the_private_read_finder_finds_one():
    owner = "class Owner:\n    __slots__ = ('_slot',)\n    def __init__(self):\n        self._state = {}\n"
    reader = "def peek(owner):\n    return owner._state, owner._slot, owner._missing\n"
    assert _private_reads({"owner.py": owner, "reader.py": reader}) == [
        "reader.py:2: owner._state",
        "reader.py:2: owner._slot",
    ]
    # a module's own class, and self, are its own business
    assert _private_reads({"owner.py": owner + "def peek(o):\n    return o._state\n"}) == []
