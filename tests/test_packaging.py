"""fusedopt.kernels ships from the repo's kernels/ directory, never as a top-level `kernels`."""

import importlib
import pkgutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import fusedopt
import fusedopt.kernels

REPO = Path(__file__).resolve().parent.parent


def _kernel_modules() -> list[str]:
    return [f"fusedopt.kernels.{m.name}" for m in pkgutil.iter_modules(fusedopt.kernels.__path__)]


def test_kernels_import_under_the_fusedopt_name_only():
    assert fusedopt.kernels.__name__ == "fusedopt.kernels"
    top_level = sys.modules.get("kernels")  # Hugging Face's package of that name may be loaded; never kernels/
    assert top_level is None or Path(top_level.__file__).parent != REPO / "kernels"
    assert _kernel_modules(), "kernels/ has no modules"
    for name in _kernel_modules():
        assert importlib.import_module(name).__name__ == name


def test_every_kernels_subpackage_is_listed_in_pyproject():
    """A sub-package missing from [tool.setuptools] packages vanishes from the wheel silently."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for init in (REPO / "kernels").rglob("__init__.py"):
        rel = init.parent.relative_to(REPO / "kernels").parts
        assert ".".join(("fusedopt", "kernels", *rel)) in listed, init
    for init in (REPO / "fusedopt").rglob("__init__.py"):
        rel = init.parent.relative_to(REPO / "fusedopt").parts
        assert ".".join(("fusedopt", *rel)) in listed, init


def test_built_wheel_installs_in_a_fresh_venv_and_imports_every_kernel_module(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        check=True,
    )
    (wheel,) = dist.glob("fusedopt-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # torch and triton come from this environment's site-packages, appended after the venv's own
    site = [p for p in sys.path if p.endswith("site-packages")]
    venv_site = next((env_dir / "lib").glob("python*/site-packages"))
    (venv_site / "zz_deps.pth").write_text("\n".join(site) + "\n")
    script = (
        "import importlib, sys, fusedopt, fusedopt.kernels;"
        f"assert fusedopt.__file__.startswith({str(venv_site)!r}), fusedopt.__file__;"
        f"[importlib.import_module(m) for m in {_kernel_modules()!r}];"
        "assert 'kernels' not in sys.modules;"
        "print(fusedopt.kernels.__file__)"
    )
    out = subprocess.run([python, "-c", script], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip().startswith(str(venv_site / "fusedopt" / "kernels"))
    top_level = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.distribution('fusedopt').read_text('top_level.txt'))"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    )
    assert top_level.stdout.split() == ["fusedopt"]
