"""Llama-3-8B in the profiler and the planner: the preset, tied heads, the chunked loss as a planner candidate.

The 8B model cannot be built on this CPU: its preset is checked by its parameter count and on the meta
device, the planner by its arithmetic, and the profiler's code paths on small shapes.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import types

import pytest
import torch

import fusedopt
from fusedopt.dispatch import bucket_budget
from fusedopt.profile import ModelSpec, UserError, main, parse_config, plan, recommend, run_profile
from fusedopt.profile import models as profile_models
from fusedopt.profile.models import PRESETS, TinyLM, hf_model_shape, load_hf_config, parse_shape
from fusedopt.profile.planner import GIB, activation_estimate, loss_head_bytes

LLAMA3 = PRESETS["llama3-8b"]
N_LLAMA3 = 8_030_261_248
VOCAB, HIDDEN = 128256, 4096
CHUNK = 128  # fusedopt.losses.default_chunk_size(128256)
LEANEST = parse_config("fusedopt:state_format='norm2-root4',master_weight_bits=None,fused=True")


def _meta_model(shape, **kwargs) -> TinyLM:
    return TinyLM(shape, device="meta", dtype=torch.bfloat16, **kwargs)


def _plan_output(capsys, *argv) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


# --- the preset ----------------------------------------------------------------------------------------


def test_llama3_8b_preset_has_8_03e9_parameters():
    assert LLAMA3.num_params() == N_LLAMA3 and f"{LLAMA3.num_params() / 1e9:.2f}e9" == "8.03e9"
    model = _meta_model(LLAMA3)
    assert [tuple(p.shape) for p in model.parameters()] == LLAMA3.param_shapes()
    assert sum(p.numel() for p in model.parameters()) == N_LLAMA3
    # grouped KV heads: 8 of 128 dimensions; an untied head as large as the embedding
    assert tuple(model.layers[0].self_attn.k_proj.weight.shape) == (8 * 128, HIDDEN)
    assert tuple(model.layers[0].mlp.up_proj.weight.shape) == (14336, HIDDEN)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert tuple(model.lm_head.weight.shape) == tuple(model.embed_tokens.weight.shape) == (VOCAB, HIDDEN)
    spec = ModelSpec.from_args("llama3-8b", None, None)
    assert spec.num_params() == N_LLAMA3 and "kv_heads=8" in spec.describe()


@pytest.mark.parametrize("base", ["tiny", "llama3-8b"])
def test_a_tied_head_is_one_matrix_in_the_count_and_in_the_model(base):
    untied = PRESETS[base]
    tied = parse_shape("tie_embeddings=true", untied)
    assert tied.tie_embeddings and not untied.tie_embeddings
    assert untied.num_params() - tied.num_params() == untied.vocab * untied.d_model
    model = _meta_model(tied)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == tied.num_params()
    assert "tied embeddings" in tied.describe() and "tied" not in untied.describe()
    assert parse_shape("tie_word_embeddings=0", tied).tie_embeddings is False
    with pytest.raises(UserError, match="tie_embeddings must be true or false"):
        parse_shape("tie_embeddings=maybe", untied)


def test_a_tied_hf_config_gives_a_tied_shape(tmp_path):
    pytest.importorskip("transformers")
    fields = dict(
        model_type="llama",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    for tie in (False, True):
        path = tmp_path / f"{tie}.json"
        path.write_text(json.dumps({**fields, "tie_word_embeddings": tie}))
        shape, caveat = hf_model_shape(load_hf_config(str(path)))
        assert shape.tie_embeddings is tie and caveat == ""


def test_specs_without_the_new_options_keep_their_results_key():
    """The planner matches measured activations by the spec's JSON: a spec without the chunked loss or a
    tied head must give the key it gave before those options existed."""
    spec = ModelSpec.from_args("tiny", None, None)
    fields = dict(vocab=256, d_model=128, layers=8, heads=4, kv_heads=4, ffn=384)
    assert spec.to_dict() == dict(kind="preset", preset="tiny", shape=fields, hf_config=None, checkpointing=True)
    chunked = ModelSpec.from_args("tiny", None, None, chunked_loss=16)
    assert chunked.to_dict()["chunked_loss"] == 16
    tied = ModelSpec.from_args("tiny", "tie_embeddings=1", None)
    assert tied.to_dict()["shape"]["tie_embeddings"] is True
    for s in (spec, chunked, tied):  # what a worker process rebuilds from the job
        again = ModelSpec.from_dict(s.to_dict())
        assert again.to_dict() == s.to_dict() and again.model_shape() == s.model_shape()
        assert again.chunked_loss == s.chunked_loss
    assert ModelSpec.from_args("llama3-8b", None, None, chunked_loss=0).chunked_loss == CHUNK  # the default chunk


# --- the planner ------------------------------------------------------------------------------------------


def _leanest_rows(rec):
    rows = [r for r in rec.rows if r.config == LEANEST and not r.vocab_pieces]
    return next(r for r in rows if r.chunked_loss is None), next(r for r in rows if r.chunked_loss is not None)


def test_llama3_8b_fits_in_24_gb_with_the_vocabulary_in_pieces(capsys):
    """24 GB = 22.35 GiB. bf16 weights 14.96 GiB + norm2-root4 without correction (0.8127 B/param)
    6.08 GiB = 21.04 GiB persistent, leaving 1.31 GiB; release holds up to the bucket (0.125 GiB) plus
    the largest gradient, the LM head's 128256 x 4096 in bf16 (0.98 GiB); the checkpointed block inputs
    (32 x 1024 x 4096 x 2 B) are 0.25 GiB, one block's recomputation 0.22 GiB more, and the loss head
    1.47 GiB with the full logits (1024 x 128256 fp32 x 3) or 0.12 GiB with the chunked loss (128 tokens
    x 128256 x 8 B). Peaks: 24.08 GiB full (margin -1.73), 22.73 GiB chunked (margin -0.38). With the
    embedding and head in 8 row pieces the largest gradient is one piece's, 16032 x 4096: 21.88 GiB
    (margin +0.47), the planner's choice (measured on the H200: 21.73 GiB allocated at the peak)."""
    rec = recommend(None, 22.35, model="llama3-8b")
    full, chunked = _leanest_rows(rec)
    assert not full.fits and not chunked.fits
    assert round(N_LLAMA3 * 2 / GIB, 2) == 14.96 and round(chunked.per_param.state * N_LLAMA3 / GIB, 2) == 6.08
    assert chunked.persistent == full.persistent and round(full.persistent / GIB, 2) == 21.04
    assert full.grads == chunked.grads == bucket_budget() + 2 * VOCAB * HIDDEN
    assert full.activations - chunked.activations == loss_head_bytes(VOCAB, 1024) - loss_head_bytes(VOCAB, 1024, CHUNK)
    assert (round(full.peak / GIB, 2), round(chunked.peak / GIB, 2)) == (24.08, 22.73)
    assert (round(full.margin / GIB, 2), round(chunked.margin / GIB, 2)) == (-1.73, -0.38)
    pieces = rec.choice
    assert (pieces.config, pieces.chunked_loss, pieces.vocab_pieces) == (LEANEST, CHUNK, 8)
    assert rec.fitting == [pieces]
    assert pieces.grads == bucket_budget() + 2 * 16032 * HIDDEN and pieces.persistent == chunked.persistent
    assert (round(pieces.peak / GIB, 2), round(pieces.margin / GIB, 2)) == (21.88, 0.47)

    text = _plan_output(capsys, "--model", "llama3-8b", "--gpu-memory", "22.35")
    assert "8,030,261,248 parameters; memory 22.35 GiB" in text
    use = next(line for line in text.splitlines() if line.startswith("Use: "))
    assert f"--chunked-loss {CHUNK} --vocab-pieces 8)" in use and "margin 0.47 GiB" in use
    assert "fusedopt.split_rows(model.lm_head, 8)" in text
    assert f"fusedopt.chunked_cross_entropy(hidden, lm_head.pieces, labels, chunk_size={CHUNK})" in text
    assert pieces.description == chunked.description + ", vocabulary in 8 pieces"


def test_below_the_pieces_peak_the_plan_says_by_how_much(capsys):
    text = _plan_output(capsys, "--model", "llama3-8b", "--gpu-memory", "21.5")
    verdict = text.splitlines()[-1]
    assert verdict.startswith("No fusedopt AdamW configuration fits in 21.50 GiB: the leanest, ")
    assert "vocabulary in 8 pieces, needs 21.88 GiB (margin -0.38 GiB)" in verdict
    assert "with the full logits the leanest" in verdict and "needs 24.08 GiB (margin -2.58 GiB)" in verdict
    text = _plan_output(capsys, "--model", "llama3-8b", "--gpu-memory", "24GB")  # 24e9 bytes
    assert "memory 22.35 GiB" in text and "--vocab-pieces 8" in text


def test_vocab_pieces_are_a_model_option():
    spec = ModelSpec.from_args("llama3-8b", None, None).with_vocab_pieces(8)
    shapes = spec.param_shapes()
    assert sum(math.prod(s) for s in shapes) == N_LLAMA3
    assert shapes.count((16032, HIDDEN)) == 16 and (VOCAB, HIDDEN) not in shapes
    assert "embedding and head in 8 pieces" in spec.describe() and spec.to_dict()["vocab_pieces"] == 8
    assert "vocab_pieces" not in ModelSpec.from_args("llama3-8b", None, None).to_dict()  # old results' keys
    small = "vocab=50,d_model=8,layers=1,heads=2,kv_heads=2,ffn=16"
    tiny = ModelSpec.from_args(None, small, None).with_vocab_pieces(3)
    model = tiny.build("cpu", torch.float32)
    assert [tuple(p.shape) for p in model.parameters()] == tiny.param_shapes()
    assert len(model.lm_head.pieces) == 3 and len(model.embed_tokens.pieces) == 3
    with pytest.raises(UserError, match="untied head"):
        tied = "vocab=50,d_model=8,layers=1,heads=2,kv_heads=2,ffn=16,tie_embeddings=true"
        ModelSpec.from_args(None, tied, None).with_vocab_pieces(2)
    with pytest.raises(UserError, match="positive number of pieces"):
        spec.with_vocab_pieces(0)
    with pytest.raises(UserError, match="needs a model"):
        plan(8e9, 22.35, ["fusedopt:fused=True"], vocab_pieces=8)


def test_the_chunked_loss_is_what_makes_llama3_8b_fit_in_23_gib(capsys):
    rec = recommend(None, 23.0, model="llama3-8b")
    full, chunked = _leanest_rows(rec)
    assert not full.fits and chunked.fits and rec.choice is chunked and rec.fitting == [chunked]
    text = _plan_output(capsys, "--model", "llama3-8b", "--gpu-memory", "23")
    use = next(line for line in text.splitlines() if line.startswith("Use: "))
    assert f"--chunked-loss {CHUNK})" in use and "margin 0.27 GiB" in use
    assert f"fusedopt.chunked_cross_entropy(hidden, lm_head.weight, labels, chunk_size={CHUNK})" in text


def test_a_format_with_the_chunked_loss_comes_before_a_leaner_format():
    """40.5 GiB: the default format with release fits with the chunked loss only; it is chosen over the
    leaner formats that fit with the full logits (the chunked loss changes no update)."""
    rec = recommend(None, 40.5, model="llama3-8b")
    default_fused = parse_config("fusedopt:state_bits=8,master_weight_bits=24,fused=True")
    assert rec.choice.config == default_fused and rec.choice.chunked_loss == CHUNK
    leaner = parse_config("fusedopt:state_bits=8,master_weight_bits=None,fused=True")
    assert any(r.config == leaner and r.chunked_loss is None for r in rec.fitting)
    order = [(r.config, r.chunked_loss) for r in rec.rows]
    assert order.index((default_fused, None)) + 2 == order.index((default_fused, CHUNK))  # after the full logits


def test_a_model_with_the_chunked_loss_is_planned_with_it_only(capsys):
    rec = recommend(None, 22.35, model=ModelSpec.from_args("llama3-8b", None, None, chunked_loss=512))
    assert {r.chunked_loss for r in rec.rows} == {512}
    text = _plan_output(capsys, "--model", "llama3-8b", "--gpu-memory", "22.35", "--chunked-loss")
    assert f"chunked loss ({CHUNK} tokens per chunk)" in text.splitlines()[0]
    table = text.split("\n\n")[0].splitlines()  # the table of the given configurations, before the recommendation
    rows = [line for line in table if line.startswith(("torch AdamW", "fusedopt AdamW"))]
    assert len(rows) == 4 and all(", chunked loss " in line for line in rows)
    blocks = activation_estimate(LLAMA3, batch=1, seq_len=1024, dtype=torch.bfloat16, chunked_loss=CHUNK)
    assert f"activations: {blocks / GIB:.2f} GiB, estimate" in text
    # a bare parameter count takes the nearest preset's vocabulary for the default chunk
    (row,) = plan(8e9, 22.35, ["fusedopt:fused=True"], chunked_loss=0)
    assert row.chunked_loss == CHUNK and row.activation_source.startswith("estimate for the llama3-8b preset")


def test_given_activations_hold_the_runs_own_loss():
    rec = recommend(None, 22.35, model="llama3-8b", activations_gib=0.5)
    assert {r.chunked_loss for r in rec.rows} == {None}


def test_the_loss_head_model():
    assert loss_head_bytes(VOCAB, 1024) == 1024 * VOCAB * 12
    assert loss_head_bytes(VOCAB, 1024, CHUNK) == CHUNK * VOCAB * 8
    assert loss_head_bytes(VOCAB, 100, CHUNK) == 100 * VOCAB * 8  # a chunk is at most the tokens
    full = activation_estimate(LLAMA3, batch=1, seq_len=1024, dtype=torch.bfloat16)
    chunked = activation_estimate(LLAMA3, batch=1, seq_len=1024, dtype=torch.bfloat16, chunked_loss=CHUNK)
    assert full - chunked == (1024 * 12 - CHUNK * 8) * VOCAB


# --- the profiler's run ----------------------------------------------------------------------------------

LOGIT_HEAVY = "layers=1,d_model=32,heads=2,ffn=64,vocab=8192"


def test_the_profiler_measures_the_chunked_loss():
    """Full logits against the chunked loss on a shape whose logits dominate (SGD: no optimizer temporaries).
    What the profiler measures beyond parameters, state and gradients (the planner's "activations") is at
    most the planner's estimate for each loss; with the full logits at least their 12 bytes per logit."""
    shape = parse_shape(LOGIT_HEAVY)
    measured = {}
    for chunk in (None, 16):
        spec = ModelSpec.from_args(None, LOGIT_HEAVY, None, chunked_loss=chunk)
        report = run_profile(
            spec, ["torch.SGD:lr=0.01"], device="cpu", seq_len=256, steps=2, isolate=False, allocator_pass=False
        )
        (result,) = report.results
        assert result["ok"] and all(math.isfinite(x) for x in result["losses"]), result
        assert json.loads(result["model_key"]).get("chunked_loss") == chunk
        assert ("chunked loss (16 tokens per chunk)" in report.settings["model"]) == (chunk == 16)
        cats = result["memory"]["peak_breakdown"]["categories"]
        measured[chunk] = cats["activations"] + cats["rest"]
        estimate = activation_estimate(shape, batch=1, seq_len=256, dtype=torch.bfloat16, chunked_loss=chunk)
        assert measured[chunk] <= estimate, (chunk, measured[chunk], estimate)
    assert measured[None] >= loss_head_bytes(8192, 255)  # 255 next-token targets of 256 tokens
    assert measured[16] * 10 < measured[None]


def test_the_run_command_takes_the_chunked_loss_and_the_llama3_preset(tmp_path, monkeypatch, capsys):
    argv = ["--model", "tiny", "--chunked-loss", "16", "--seq-len", "32", "--steps", "2", "--device", "cpu"]
    argv += ["--in-process", "--quiet", "--no-plot", "--no-allocator-pass", "--output-dir", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv + ["--config", "fusedopt:fused=True"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["model_spec"]["chunked_loss"] == 16 and data["results"][0]["ok"]
    # the 8B preset reaches the run, which checks it against this machine's memory before building it
    from fusedopt.profile import run as profile_run

    monkeypatch.setattr(profile_run.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=16 * GIB))
    assert main(["--model", "llama3-8b", "--chunked-loss", "--device", "cpu", "--output-dir", str(tmp_path)]) == 2
    assert "8,030,261,248 parameters need about" in capsys.readouterr().err


def test_hf_llama_with_the_chunked_loss_is_the_models_own_loss(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=503,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config.save_pretrained(tmp_path / "llama")
    spec = ModelSpec.from_args(None, None, str(tmp_path / "llama"), chunked_loss=7)
    torch.manual_seed(0)
    wrapper = spec.build("cpu", torch.float32)
    ids = torch.randint(0, 503, (2, 21), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100
    calls = []
    original = profile_models.chunked_cross_entropy
    monkeypatch.setattr(profile_models, "chunked_cross_entropy", lambda *a, **k: calls.append(k) or original(*a, **k))
    chunked = wrapper(ids, labels)
    assert calls == [dict(chunk_size=7)]  # the wrapper's loss is the chunked one
    own = wrapper.model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(chunked, own, rtol=1e-5, atol=0)
    chunked.backward()
    head = wrapper.model.get_output_embeddings().weight
    grad, head.grad = head.grad, None
    wrapper.model(input_ids=ids, labels=labels).loss.backward()
    torch.testing.assert_close(grad, head.grad, rtol=1e-5, atol=1e-5 * head.grad.abs().max().item())
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}))
    with pytest.raises(UserError, match="--chunked-loss with a Hugging Face config"):
        ModelSpec.from_args(None, None, str(tmp_path / "gpt2.json"), chunked_loss=0)


def test_chunked_cross_entropy_is_exported():
    assert fusedopt.chunked_cross_entropy is fusedopt.losses.chunked_cross_entropy
    assert "chunked_cross_entropy" in fusedopt.__all__
