"""The examples run end to end at their tiny CPU size (the GPU size is the same code, larger)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import fusedopt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def _standin_args() -> list[str]:
    """Nothing while fusedopt's defaults work; a 16-bit stand-in while they are not implemented."""
    param = torch.nn.Parameter(torch.zeros(64, 128, dtype=torch.bfloat16))
    try:
        opt = fusedopt.AdamW([param])
        param.grad = torch.ones_like(param)
        opt.step()
        return []
    except NotImplementedError:
        return ["--state-bits", "16", "--master-weight-bits", "none"]


def _run(script: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(EXAMPLES, script), "--device", "cpu", *_standin_args(), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_finetune_lowvram_trains_saves_resumes_and_reports_memory(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "3", "--seq-len", "32"]
    proc = _run(
        "finetune_lowvram.py", [*common, "--save-every", "2", "--out", str(a), "--summary-json", "a.json"], tmp_path
    )
    assert "memory of the last step" in proc.stdout and "bytes per parameter" in proc.stdout
    summary = json.loads((tmp_path / "a.json").read_text())
    assert len(summary["losses"]) == 3 and all(x == x and x < 10 for x in summary["losses"])
    memory = summary["memory"]
    assert memory["peak_phase"] == "backward"  # fused=True: the update runs inside backward
    assert sum(memory["peak_breakdown"]["categories"].values()) == memory["peak"]
    assert (a / "checkpoint.pt").exists() and (a / "checkpoint-2.pt").exists()

    # resume from step 2 and reach step 3: the same trajectory, bit for bit
    resume = ["--resume", str(a / "checkpoint-2.pt"), "--out", str(b), "--no-profile", "--summary-json", "b.json"]
    _run("finetune_lowvram.py", [*common, *resume], tmp_path)
    resumed = json.loads((tmp_path / "b.json").read_text())
    assert resumed["losses"] == summary["losses"][2:]
    final_a = torch.load(a / "checkpoint.pt", weights_only=True)
    final_b = torch.load(b / "checkpoint.pt", weights_only=True)
    assert final_a["step"] == final_b["step"] == 3
    for name, tensor in final_a["model"].items():
        assert torch.equal(tensor, final_b["model"][name]), name


def test_finetune_lowvram_rejects_bad_input(capsys):
    spec = importlib.util.spec_from_file_location("finetune_lowvram", os.path.join(EXAMPLES, "finetune_lowvram.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--device", "cpu", "--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        example.main(["--device", "cpu", "--accum", "0"])
    assert exc.value.code == 2 and "--accum must be at least 1" in capsys.readouterr().err


def test_finetune_hf(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    proc = _run(
        "finetune_hf.py", ["--steps", "2", "--out", str(out), "--summary-json", str(tmp_path / "s.json")], tmp_path
    )
    assert "memory of the last step" in proc.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert len(summary["losses"]) == 2
    assert sum(summary["memory"]["peak_breakdown"]["categories"].values()) == summary["memory"]["peak"]
    assert (out / "config.json").exists() and (out / "optimizer.pt").exists()
