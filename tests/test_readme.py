"""The README's code runs as written: the quick start trains and round-trips a checkpoint, the options
block builds an optimizer, the test command is the one CI runs, and the planner command works. The
README stays a two-minute read (at most 200 lines) that links every document in docs/; the code moved
to docs/ (Adafactor, FSDP2, the Hugging Face Trainer) runs or at least compiles there."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import torch

import fusedopt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
README = open(os.path.join(REPO, "README.md")).read()
README_MAX_LINES = 200


def _doc(name: str) -> str:
    return open(os.path.join(DOCS, name)).read()


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    quick_start, options = _blocks("python")
    (adafactor,) = _blocks("python", _doc("adafactor.md"))
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(quick_start, "README quick start", "exec"), ns)
    model, opt, ckpt = ns["model"], ns["opt"], ns["ckpt"]
    assert isinstance(opt, fusedopt.AdamW) and opt.fused is True
    assert (tmp_path / "checkpoint.pt").exists()

    # it trained: the loss on a fixed batch is below the same model's before training
    fresh_ns: dict = {}
    exec(quick_start[: quick_start.index("opt = ")], fresh_ns)
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        before = (fresh_ns["model"](x) - x).pow(2).mean().item()
        after = (model(x) - x).pow(2).mean().item()
    assert after < 0.9 * before, (before, after)

    # the checkpoint round trip is exact
    again = opt.state_dict()
    assert len(ckpt["opt"]["state"]) == len(list(model.parameters()))
    assert again["param_groups"] == ckpt["opt"]["param_groups"]
    for key, state in ckpt["opt"]["state"].items():
        for name, value in state.items():
            other = again["state"][key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (key, name)

    exec(compile(options, "README options", "exec"), ns)
    opt = ns["opt"]
    assert opt.defaults["state_bits"] == 8 and opt.defaults["master_weight_bits"] == 24
    assert opt.fused is False and opt.accumulation_steps == 1 and opt.seed == 0

    exec(compile(adafactor, "docs/adafactor.md", "exec"), ns)
    opt = ns["opt"]
    assert isinstance(opt, fusedopt.Adafactor) and opt.defaults["beta1"] is None
    assert opt.defaults["state_bits"] == 8 and opt.defaults["master_weight_bits"] == 24


def test_readme_test_command_is_what_ci_runs():
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    commands = "\n".join(_blocks("bash"))
    for command in ('pip install -e ".[dev,plot,integrations]"', 'pytest -m "not gpu" -n auto'):
        assert command in commands, command
        assert command.replace("pip install", "install") in ci or command in ci, command
    # the CPU note comes before the install commands
    assert README.index("CPU build of torch") < README.index('pip install -e ".[dev,plot,integrations]"')


def test_readme_cites_nothing_outside_the_repository():
    for name in re.findall(r"`((?:docs|benchmarks|examples|tests)/[\w./-]+)`", README):
        assert os.path.exists(os.path.join(REPO, name)), name
    for name in re.findall(r"[\w./-]+\.md\b", README):  # every document it names is in the repository
        assert os.path.exists(os.path.join(REPO, name)), name
    assert "../" not in README
    # results carry their method in benchmarks/RESULTS.md; the README holds no dated history
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README)


def test_readme_planner_command_runs():
    line = next(c for c in "\n".join(_blocks("bash")).splitlines() if c.startswith("fusedopt-profile plan --params"))
    args = shlex.split(line.split("#")[0])[1:]
    proc = subprocess.run(
        [sys.executable, "-m", "fusedopt.profile", *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the README's 7B-in-24-GB command: the planner names the configuration that fits
    assert "Use: fusedopt AdamW, norm2-root4 state, no correction, fused=True" in proc.stdout


def test_moved_code_blocks_compile():
    # the FSDP2 block needs torchrun: examples/finetune_fsdp.py runs the same code (tests/test_examples.py);
    # the Trainer block needs a model and a dataset: examples/finetune_trainer.py (tests/test_examples.py)
    for name in ("distributed.md", "huggingface.md"):
        blocks = _blocks("python", _doc(name))
        assert blocks, name
        for block in blocks:
            compile(block, f"docs/{name}", "exec")


def test_readme_is_short_and_links_every_document():
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/"
    for name in sorted(os.listdir(DOCS)):
        if name.endswith(".md"):
            assert f"(docs/{name})" in README, f"README.md does not link docs/{name}"
    assert "(tests/gpu/README.md)" in README or "`tests/gpu/README.md`" in README  # how to run the GPU tiers


def test_docs_cite_nothing_outside_the_repository():
    for name in sorted(os.listdir(DOCS)):
        if not name.endswith(".md"):
            continue
        text = _doc(name)
        for path in re.findall(r"`((?:docs|benchmarks|examples|tests|fusedopt|kernels)/[\w./-]+)`", text):
            assert os.path.exists(os.path.join(REPO, path)), (name, path)
        for link, anchor in re.findall(r"\]\(([^)#]+)(?:#([^)]*))?\)", text):  # markdown links, relative to docs/
            target = os.path.normpath(os.path.join(DOCS, link))
            assert os.path.exists(target), (name, link)
            if anchor:  # a link into a section: the section is there (sections move between documents)
                assert anchor in _anchors(open(target).read()), (name, link, anchor)


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a document's headings (lower case, punctuation dropped, spaces as dashes)."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_results_is_one_current_page():
    """benchmarks/RESULTS.md holds the current figures, each with its command and commit; superseded
    studies live in git history, so the page stays short enough to read."""
    with open(os.path.join(REPO, "benchmarks", "RESULTS.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 400, len(lines)


def test_the_readme_figure_is_drawn_from_results_md(tmp_path):
    """benchmarks/plot_memory_time.py finds every point it plots in RESULTS.md's tables (an edit of those
    tables that loses a row fails here, not in the next redraw), and draws the figure the README shows."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plot_memory_time", os.path.join(REPO, "benchmarks", "plot_memory_time.py")
    )
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    points = plot.points(open(os.path.join(REPO, "benchmarks", "RESULTS.md")).read())
    assert len(points) == len(plot.POINTS) and all(ratio > 0.5 and peak > 1 for _, ratio, peak in points)
    assert dict((label, ratio) for label, ratio, _ in points)["torch AdamW, pure bf16"] == 1  # the reference
    plot.main(["--out", str(tmp_path / "figure.png")])
    assert (tmp_path / "figure.png").stat().st_size > 10_000
    assert "](docs/memory_vs_step.png)" in README and os.path.exists(os.path.join(DOCS, "memory_vs_step.png"))
