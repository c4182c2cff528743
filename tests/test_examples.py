"""The examples run end to end at their tiny CPU size (the GPU size is the same code, larger)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import fusedopt
from fusedopt import release_notices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
# fusedopt's warning for a fused=True optimizer built without max_grad_norm: the examples say whether they clip
RELEASE_WARNING = "fusedopt: fused=True (gradient release)"


@pytest.fixture(autouse=True)
def _examples_say_whether_they_clip(monkeypatch):
    monkeypatch.setattr(release_notices, "_release_warned", False)
    yield
    assert not release_notices._release_warned, "an example built a fused=True optimizer without max_grad_norm"


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


def _run(script: str, args: list[str], cwd, returncode: int = 0) -> subprocess.CompletedProcess:
    # fusedopt is installed; the repository root on PYTHONPATH would make kernels/ shadow Hugging Face's
    # ``kernels`` package, which transformers >= 5.25 imports
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(EXAMPLES, script), "--device", "cpu", *_standin_args(), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == returncode, proc.stdout + proc.stderr
    assert RELEASE_WARNING not in proc.stderr, proc.stderr
    return proc


def _load_example(name: str, monkeypatch):
    """Import an example as a module (its directory on sys.path, as when it runs as a script)."""
    monkeypatch.syspath_prepend(EXAMPLES)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(path) -> dict:
    return json.loads(path.read_text())


def _assert_small_sizes_readable(stdout: str):
    """A tiny model's memory summary prints KiB/MiB figures on a few lines, never '0.003 GiB'."""
    block = stdout[stdout.index("memory of the last step") :].splitlines()[:4]
    assert re.fullmatch(r"  peak +\d+(\.\d+)? (KiB|MiB) in backward .*", block[1]), block
    assert block[2].startswith("  at the peak ") and block[3].startswith("  persistent "), block
    assert all(len(line) <= 160 for line in block), block
    assert "GiB" not in "\n".join(block), block


def test_finetune_lowvram_trains_saves_resumes_and_reports_memory(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "3", "--seq-len", "32"]
    proc = _run(
        "finetune_lowvram.py", [*common, "--save-every", "2", "--out", str(a), "--summary-json", "a.json"], tmp_path
    )
    assert "memory of the last step" in proc.stdout and "bytes per parameter" in proc.stdout
    assert re.search(r"step 1/3  loss \d+\.\d+  grad norm \d+\.\d+", proc.stdout)  # clipped in the optimizer
    _assert_small_sizes_readable(proc.stdout)
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


def test_finetune_lowvram_resume_follows_the_saved_schedule(tmp_path, monkeypatch, capsys):
    """N steps then a resume to M > N steps: the LR (and loss) of every step is the uninterrupted run's."""
    example = _load_example("finetune_lowvram", monkeypatch)
    monkeypatch.chdir(tmp_path)
    base = ["--device", "cpu", *_standin_args(), "--shape", "layers=2", "--seq-len", "16", "--micro-batch", "1"]
    base += ["--no-profile"]
    schedule = ["--lr", "1e-3", "--warmup", "2", "--min-lr-ratio", "0.2"]

    def run(name, *args):
        assert example.main([*base, *args, "--out", name, "--summary-json", f"{name}.json"]) == 0
        return _summary(tmp_path / f"{name}.json")

    # The schedule defaults to the first run's --steps (3); resuming to 6 must not stretch it to 6.
    a = run("a", *schedule, "--steps", "3")
    b = run("b", "--resume", "a/checkpoint.pt", "--steps", "6")
    assert "cosine to 0.2 x peak at step 3" in capsys.readouterr().out
    c = run("c", *schedule, "--steps", "6", "--total-steps", "3")
    assert len(c["lrs"]) == 6 and len(set(c["lrs"])) >= 3  # warm-up, decay, the floor: a real schedule
    assert a["lrs"] + b["lrs"] == c["lrs"]
    assert a["losses"] + b["losses"] == c["losses"]

    # Planned ahead: --total-steps 6 from the start, resumed to 6 = one 6-step run.
    d = run("d", *schedule, "--steps", "3", "--total-steps", "6")
    e = run("e", "--resume", "d/checkpoint.pt", "--steps", "6")
    f = run("f", *schedule, "--steps", "6")
    assert d["lrs"] + e["lrs"] == f["lrs"] and d["losses"] + e["losses"] == f["losses"]
    assert f["lrs"][3:] != c["lrs"][3:]  # the two schedules differ where the runs were resumed

    # A schedule option on resume that contradicts the checkpoint is refused, naming both values.
    for option, value, shown in (
        ("--total-steps", "6", "6"),
        ("--warmup", "1", "1"),
        ("--lr", "3e-4", "0.0003"),
        ("--min-lr-ratio", "0.1", "0.1"),
    ):
        capsys.readouterr()
        assert example.main([*base, "--resume", "a/checkpoint.pt", "--steps", "6", option, value]) == 2
        err = capsys.readouterr().err
        assert f"{option} {shown} (the checkpoint's schedule has " in err, err
    # the saved value itself is no conflict; --steps not past the checkpoint is refused
    assert example.main([*base, "--resume", "a/checkpoint.pt", "--steps", "3", "--total-steps", "3"]) == 2
    assert "the checkpoint is at step 3" in capsys.readouterr().err


def test_format_bytes(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    from memory_summary import format_bytes

    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.00 KiB"
    assert format_bytes(3072) == "3.00 KiB"
    assert format_bytes(2.5 * 2**20) == "2.50 MiB"
    assert format_bytes(15.5 * 2**20) == "15.5 MiB"
    assert format_bytes(123.4 * 2**20) == "123 MiB"
    assert format_bytes(1.2 * 2**30) == "1.20 GiB"
    assert format_bytes(62.76 * 2**30) == "62.8 GiB"
    assert format_bytes(-3 * 2**20) == "-3.00 MiB"


def test_finetune_lowvram_rejects_bad_input(capsys, monkeypatch):
    example = _load_example("finetune_lowvram", monkeypatch)
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
    assert re.search(r"step 1/2  loss \d+\.\d+  grad norm \d+\.\d+", proc.stdout)  # clipped in the optimizer
    _assert_small_sizes_readable(proc.stdout)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert len(summary["losses"]) == 2
    assert sum(summary["memory"]["peak_breakdown"]["categories"].values()) == summary["memory"]["peak"]
    assert (out / "config.json").exists() and (out / "optimizer.pt").exists()


def test_finetune_hf_with_the_vocabulary_in_pieces_saves_the_unsplit_model(tmp_path):
    """The 24 GB recipe's flags at the tiny size: the embedding and head in pieces, the chunked loss,
    norm2-root4 without correction; save_pretrained writes the model's own keys and shapes, which load
    back into the unsplit model."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    recipe = ["--state-format", "norm2-root4", "--master-weight-bits", "none", "--vocab-pieces", "3", "--chunked-loss"]
    proc = _run("finetune_hf.py", ["--steps", "2", "--accum", "1", *recipe, "--out", str(out)], tmp_path)
    assert re.search(r"step 2/2  loss \d+\.\d+  grad norm \d+\.\d+", proc.stdout)
    load = transformers.AutoModelForCausalLM.from_pretrained
    model, info = load(out, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert tuple(model.lm_head.weight.shape) == tuple(model.model.embed_tokens.weight.shape) == (vocab, hidden)
    optimizer = torch.load(out / "optimizer.pt", weights_only=True)["optimizer"]
    assert len(optimizer["param_groups"][0]["params"]) == len(list(model.parameters())) + 2 * (3 - 1)


def test_finetune_hf_memory_cap_and_no_save(tmp_path, monkeypatch, capsys):
    """``--memory-cap-gib`` caps a CUDA allocator and is refused on the CPU before any model is built;
    ``--no-save`` trains and writes nothing."""
    pytest.importorskip("transformers")
    example = _load_example("finetune_hf", monkeypatch)
    monkeypatch.chdir(tmp_path)
    base = ["--device", "cpu", *_standin_args(), "--seq-len", "16", "--micro-batch", "1", "--steps", "1"]
    assert example.main([*base, "--memory-cap-gib", "1", "--out", "capped"]) == 2
    assert "--memory-cap-gib caps a CUDA device's allocator" in capsys.readouterr().err
    assert example.main([*base, "--no-save", "--out", "unsaved"]) == 0
    assert "step 1/1" in capsys.readouterr().out and not (tmp_path / "unsaved").exists()


def test_finetune_hf_resume_follows_the_saved_schedule(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    example = _load_example("finetune_hf", monkeypatch)
    monkeypatch.chdir(tmp_path)
    base = ["--device", "cpu", *_standin_args(), "--seq-len", "16", "--micro-batch", "1"]
    schedule = ["--lr", "1e-3", "--min-lr-ratio", "0.3", "--total-steps", "3"]

    def run(name, *args):
        assert example.main([*base, *args, "--out", name, "--summary-json", f"{name}.json"]) == 0
        return _summary(tmp_path / f"{name}.json")

    a = run("a", *schedule, "--steps", "2")
    b = run("b", "--resume", "a", "--steps", "4")
    assert "resumed from a at step 2" in capsys.readouterr().out
    c = run("c", *schedule, "--steps", "4")
    assert len(c["lrs"]) == 4 and len(set(c["lrs"])) >= 3
    assert a["lrs"] + b["lrs"] == c["lrs"]
    assert a["losses"] + b["losses"] == c["losses"]

    assert example.main([*base, "--resume", "a", "--steps", "4", "--total-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "--total-steps 4 (the checkpoint's schedule has 3)" in err, err


def test_finetune_hf_init_checks_the_config_of_the_directory_it_loads(tmp_path, monkeypatch, capsys):
    """``--init DIR`` checks DIR's config, not the built-in Llama one: a tied model with ``--vocab-pieces``
    and a vocabulary under 256 are refused before any training (they trained: the tied embedding was
    silently untied); an untied model trains in pieces and reports its own size and type."""
    transformers = pytest.importorskip("transformers")
    example = _load_example("finetune_hf", monkeypatch)
    monkeypatch.chdir(tmp_path)

    def save(name, vocab_size=259, tied=False):
        shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        config = transformers.LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=tied, **shape)
        model = transformers.LlamaForCausalLM(config)
        model.save_pretrained(tmp_path / name)
        return sum(p.numel() for p in model.parameters())

    save("tied", tied=True)
    save("small", vocab_size=100)
    untied_params = save("untied")
    base = ["--device", "cpu", *_standin_args(), "--seq-len", "16", "--micro-batch", "1", "--accum", "1"]
    base += ["--steps", "2", "--no-save"]

    capsys.readouterr()
    assert example.main([*base, "--init", "tied", "--vocab-pieces", "2"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "error: --vocab-pieces needs an untied LM head (tie_word_embeddings is true)", err
    assert "step 1/" not in out and "parameters," not in out, out
    assert example.main([*base, "--init", "small"]) == 2
    out, err = capsys.readouterr()
    assert "error: byte-level data needs a vocabulary of at least 256" in err, err
    assert "step 1/" not in out, out

    assert example.main([*base, "--init", "untied", "--vocab-pieces", "2"]) == 0
    out = capsys.readouterr().out
    assert f"llama: {untied_params:,} parameters," in out, out  # the directory's model, split but not grown
    assert re.search(r"step 2/2  loss \d+\.\d+  grad norm \d+\.\d+", out), out


def test_finetune_fsdp_trains_saves_and_resumes_on_two_cpu_ranks(tmp_path):
    """torchrun with 2 processes on CPU (gloo): trains, saves a DCP checkpoint, resumes from it."""
    import socket

    def torchrun(*args):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(port), os.path.join(EXAMPLES, "finetune_fsdp.py"), "--device", "cpu"]
        cmd += ["--seq-len", "32", "--out", str(tmp_path / "out"), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1")  # fusedopt is installed (see _run)
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert RELEASE_WARNING not in proc.stderr, proc.stderr
        return proc.stdout

    out = torchrun("--steps", "2")
    assert "step 2/2  loss" in out and "(step 2, 2 ranks)" in out
    assert (tmp_path / "out" / "checkpoint" / ".metadata").exists()
    out = torchrun("--steps", "3", "--resume", str(tmp_path / "out" / "checkpoint"))
    assert "at step 2" in out and "step 3/3  loss" in out and "step 1/" not in out


def test_finetune_trainer_clips_in_the_optimizer_and_resumes_exactly(tmp_path, monkeypatch):
    """The Trainer example: the logged grad norms are the optimizer's (it clips: they exceed
    --max-grad-norm), and a resume from the step-2 checkpoint ends on the same weights and logs."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    example = _load_example("finetune_trainer", monkeypatch)
    monkeypatch.chdir(tmp_path)
    base = ["--device", "cpu", "--steps", "4", "--save-steps", "2", "--seq-len", "16", "--max-grad-norm", "0.5"]
    assert example.main([*base, "--out", "a", "--summary-json", "a.json"]) == 0
    assert example.main([*base, "--out", "b", "--resume", "a/checkpoint-2", "--summary-json", "b.json"]) == 0
    a, b = _summary(tmp_path / "a.json"), _summary(tmp_path / "b.json")
    assert len(a["losses"]) == 4 and all(n > 0.5 for n in a["grad_norms"])
    assert a == b  # the resumed log starts with the checkpoint's two steps
    assert not (tmp_path / "b" / "checkpoint-2").exists()  # b trained steps 3-4 only
    weights_a = load_file(tmp_path / "a" / "checkpoint-4" / "model.safetensors")
    weights_b = load_file(tmp_path / "b" / "checkpoint-4" / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name, tensor in weights_a.items():
        assert torch.equal(tensor, weights_b[name]), name
