"""The issue-6 comparison harness on CPU: competitor configurations in the profiler, the torch
"optimizer in backward" pattern, and the benchmark scripts' pure logic (line-up, search,
quality summary). None of this needs the competitor libraries installed."""

import argparse
import json
import os
import sys

import pytest
import torch

import fusedopt
import fusedopt.profile
from fusedopt.profile import parse_config
from fusedopt.profile.competitors import COMPETITORS, Competitor, torch_adamw_in_backward
from fusedopt.profile.memory import state_storages, state_tensors
from fusedopt.profile.models import UserError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import compare_fit  # noqa: E402
import compare_quality  # noqa: E402
import competitors  # noqa: E402


def test_competitor_configs_parse_with_loop_options():
    config = parse_config("flashoptim.flashadamw:release=True,lr=1e-4")
    assert config.optimizer == "flashoptim.FlashAdamW" and config.release
    assert config.constructor_kwargs == {"lr": 1e-4}
    a = parse_config("torch:fused=True,autocast='bf16'")
    assert a.autocast == "bf16" and not a.release and a.param_dtype(torch.bfloat16) == torch.float32
    for bad, words in [
        ("fusedopt:release=True", "fused=True"),
        ("turboadam.TurboAdam:release=True", "no gradient release"),
        ("torch:autocast='fp8'", "autocast must be"),
        ("nosuch.Adam", "unknown optimizer"),
    ]:
        with pytest.raises(UserError, match=words):
            parse_config(bad)


def test_missing_library_is_reported_not_raised(monkeypatch):
    ghost = Competitor("ghost.AdamW", "no_such_module_fusedopt_test", "ghost-optim", None, "test entry")
    monkeypatch.setitem(COMPETITORS, "ghost.AdamW", ghost)
    monkeypatch.setattr("fusedopt.profile.competitors._BY_LOWER", {**{k.lower(): k for k in COMPETITORS}})
    assert ghost.missing("cpu") == "not installed: pip install ghost-optim"
    report = fusedopt.profile.run_profile(
        "tiny", ["ghost.AdamW"], device="cpu", seq_len=8, steps=1, isolate=False, progress=False
    )
    (result,) = report.results
    assert not result["ok"] and result["error_kind"] == "unavailable" and "pip install ghost-optim" in result["error"]
    flash = COMPETITORS["flashoptim.FlashAdamW"]
    assert flash.missing("cpu") in ("flashoptim needs a CUDA device", "not installed: pip install flashoptim")


def _tiny_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def test_optimizer_in_backward_equals_torch_adamw_and_follows_the_schedule():
    ref, hooked = _tiny_model(), _tiny_model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
    opt = torch_adamw_in_backward(hooked.parameters(), {**kw, "fused": False})
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt_ref, opt)]
    x = torch.randn(5, 8)
    for _ in range(4):
        ref(x).square().mean().backward()
        opt_ref.step()
        opt_ref.zero_grad()
        hooked(x).square().mean().backward()
        assert all(p.grad is None for p in hooked.parameters())  # released inside backward
        opt.step()
        for s in scheds:
            s.step()
    for a, b in zip(ref.parameters(), hooked.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(opt.state) == 4 and all("exp_avg" in s for s in opt.state.values())
    opt.remove_hooks()


def test_profiler_runs_autocast_and_release_configs():
    report = fusedopt.profile.run_profile(
        "tiny",
        ["torch:autocast='bf16'", "torch:release=True,foreach=False"],
        device="cpu",
        dtype="bf16",
        seq_len=16,
        steps=2,
        isolate=False,
        allocator_pass=False,
        timeline=False,
        progress=False,
    )
    autocast, release = report.results
    assert autocast["ok"] and release["ok"], report.results
    assert autocast["dtype"] == "fp32" and autocast["autocast"] == "bf16"
    assert release["release"] and release["memory"]["persistent_breakdown"]["categories"]["gradients"] == 0
    n = release["num_params"]
    assert release["state_bytes"] == pytest.approx(4 * n, rel=0.01)  # bf16 moments
    assert autocast["state_bytes"] == pytest.approx(8 * n, rel=0.01)  # fp32 moments


def test_state_tensors_reach_nested_and_skip_parameters():
    p = torch.nn.Parameter(torch.zeros(4))

    class FakeOpt:
        state = {p: {"ustate": {"codes": torch.zeros(8, dtype=torch.uint8)}, "group": {"params": [p]}, "step": 3}}

    names = [(k, t.numel()) for k, t in state_tensors(FakeOpt)]
    assert names == [("ustate", 8)]
    assert sum(n for _, n in state_storages(FakeOpt, torch.device("cpu"))) == 8


def test_state_tensors_reach_the_tensors_of_holder_objects():
    """FlashOptim keeps each quantized moment in a plain object (codes and scales as attributes):
    on the H200 its moments were missing from the state column until the profiler looked inside."""
    p = torch.nn.Parameter(torch.zeros(32))

    class Holder:
        def __init__(self):
            self._data, self._quantized, self._scales = None, torch.zeros(32, dtype=torch.int8), torch.zeros(2)

    class FakeOpt:
        state = {p: {"exp_avg": Holder(), "exp_avg_sq": Holder(), "error_bits": torch.zeros(32, dtype=torch.int8)}}

    names = sorted((k, t.numel()) for k, t in state_tensors(FakeOpt))
    assert names == [("error_bits", 32), ("exp_avg", 2), ("exp_avg", 32), ("exp_avg_sq", 2), ("exp_avg_sq", 32)]


def test_lineup_parses_and_parts_are_consistent():
    assert len({e.key for e in competitors.LINEUP}) == len(competitors.LINEUP)
    for entry in competitors.LINEUP:
        config = entry.optimizer_config()
        if entry.hparams is None:
            assert config.kwargs["lr"] == competitors.HPARAMS["lr"]
        else:  # its own (Adafactor: torch's defaults), none of AdamW's
            assert not set(competitors.HPARAMS) - set(entry.hparams) & set(config.kwargs)
            with pytest.raises(SystemExit, match="its own hyperparameters"):
                entry.optimizer_config(competitors.HPARAMS)
        assert entry.step_bytes is None or not config.release  # release configs have no separate step
    for part, keys in competitors.PARTS.items():
        assert set(keys) <= set(competitors.BY_KEY), part
    assert competitors.BY_KEY["FO"].step_bytes == 12.25  # 2 grad + 4 param + 2 corr + 4 moments + 0.25 scales
    with pytest.raises(SystemExit):
        competitors.select("A,NOPE", "memory")


@pytest.mark.parametrize("limit", [0, 1, 7, 40, 97, 300])
def test_fit_search_finds_the_largest_depth(limit):
    trials = []

    def fits(layers):
        trials.append(layers)
        return layers <= limit

    assert compare_fit.largest(fits, guess=50, resolution=1, max_trials=40) == limit
    assert len(trials) <= 25


@pytest.mark.parametrize("key", ["AFR", "AFM8R", "AFM4R", "AFNR"])
def test_adafactor_entries_build_the_configuration_they_name(key):
    param = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    opt = competitors.BY_KEY[key].optimizer_config().build([param], model=torch.nn.Linear(1, 1))
    group = opt.param_groups[0]
    expected = {"AFR": (None, 8, 24), "AFM8R": (0.9, 8, 24), "AFM4R": (0.9, 4, 24), "AFNR": (None, 8, None)}
    assert isinstance(opt, fusedopt.Adafactor) and opt.fused
    assert (group["beta1"], group["state_bits"], group["master_weight_bits"]) == expected[key]
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.0  # torch.optim.Adafactor's defaults
    opt.remove_hooks()


def test_fit_reports_peak_and_step_time_and_searches_other_widths():
    assert compare_fit.family(32, None, "7b").num_params() == 6_738_415_616  # Llama-2-7B
    assert compare_fit.family(22).num_params() == 1_100_048_384  # TinyLlama 1.1B, the default family
    assert compare_fit._median_step_ms({"step_ms": [900.0, 10.0, 30.0, 20.0]}) == 20.0  # the first left out
    assert compare_fit._median_step_ms({"step_ms": [5.0]}) == 5.0 and compare_fit._median_step_ms({}) is None
    gib = compare_fit.GIB
    fits = {"layers": 32, "params": 6_738_415_616, "peak_at_largest": 21 * gib, "step_ms_at_largest": 812.4}
    assert compare_fit._cell(fits, gib) == "32 layers, 6.74B (peak 21.00 GiB, 812 ms/step)"
    assert compare_fit._cell({"layers": 0, "params": 0}, gib) == "not even 1 layer"
    # the planner's guess for the 7B width: 3 bytes per parameter (bf16 + 8-bit correction, no moment)
    config = competitors.BY_KEY["AFR"].optimizer_config()
    guess = compare_fit.predicted_layers(config, 24 * gib, None, gib, "7b")
    per_layer = compare_fit.family(2, None, "7b").num_params() - compare_fit.family(1, None, "7b").num_params()
    assert guess == int((23 * gib - 3 * (compare_fit.family(1, None, "7b").num_params() - per_layer)) / (3 * per_layer))
    assert 32 < guess < 40


def test_format_quality_keys_take_their_own_peak_lr_and_pair_with_more_references():
    import format_quality as fq

    assert fq.config_of("fp32", 3e-3)[3] == 3e-3
    assert fq.config_of("adafactor", 3e-3)[3] == fq.PEAK_LR["adafactor"]
    assert fq.config_of("adafactor-m4@0.05", 3e-3)[3] == 0.05
    for bad, message in (
        ("nope", "unknown configuration"),
        ("adafactor@x", "must be a number"),
        ("fp32@-1", "positive"),
    ):
        with pytest.raises(ValueError, match=message):
            fq.config_of(bad, 3e-3)
    # the decoupled weight decay per step, lr * weight_decay, is the AdamW configurations'
    param = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
    group = fq.CONFIGS["adafactor"][1]([param], 0.3).param_groups[0]
    assert group["lr"] * group["weight_decay"] == pytest.approx(fq.GPU["lr"] * fq.HPARAMS["weight_decay"])
    losses = {"fp32": [1.0, 2.0], "default": [1.1, 2.2], "adafactor-fp32": [1.2, 2.0], "adafactor-m4": [1.32, 2.1]}
    losses["adafactor-m32"] = [1.1, 2.1]
    runs = [{"key": k, "seed": s, "label": k, "final_eval": v} for k, vs in losses.items() for s, v in enumerate(vs)]
    also = fq.also_against(runs, [0, 1])
    assert set(also) == {"default", "adafactor-fp32", "adafactor-m32"}
    assert [r["key"] for r in also["adafactor-fp32"]] == ["adafactor-m4", "adafactor-m32"]
    assert also["adafactor-fp32"][0]["diff_pct"] == pytest.approx([10.0, 5.0])
    assert [r["key"] for r in also["adafactor-m32"]] == ["adafactor-m4"]  # compressed momentum against fp32's
    assert [r["key"] for r in also["default"]] == ["adafactor-fp32", "adafactor-m4", "adafactor-m32"]
    assert "paired against adafactor-fp32" in fq.report(fq.summarise(runs, [0, 1]), {"lr": 3e-3}, also)


def test_format_quality_reports_the_held_out_samples_part_of_a_paired_difference():
    import format_quality as fq

    gen = torch.Generator().manual_seed(0)
    ref = torch.rand(400, generator=gen) + 1.0
    noise = torch.randn(400, generator=gen) * 0.02
    runs = [
        {"key": "fp32", "seed": 0, "label": "fp32", "final_eval": float(ref.mean()), "eval_windows": ref.tolist()},
        {
            "key": "A",
            "seed": 0,
            "label": "A",
            "final_eval": float((ref + noise).mean()),
            "eval_windows": (ref + noise).tolist(),
        },
        {"key": "B", "seed": 0, "label": "B", "final_eval": 1.5},  # no windows: no figure rather than a wrong one
    ]
    rows = {r["key"]: r for r in fq.summarise(runs, [0])}
    expected = 100 * float(noise.std()) / 20 / float(ref.mean())
    assert rows["A"]["eval_se_pct"] == pytest.approx(expected, rel=1e-5)
    assert "eval_se_pct" not in rows["B"] and "eval_se_pct" not in rows["fp32"]
    # a constant shift of every window is a real difference, not sampling noise
    assert fq._eval_error((ref + 0.1).tolist(), ref.tolist()) == pytest.approx(0.0, abs=1e-5)
    assert fq._eval_error([1.0], [1.0]) is None and fq._eval_error([1.0, 2.0], [1.0]) is None
    assert "held-out sample's part" in fq.report(list(rows.values()), {"lr": 3e-3, "eval_seqs": 400})


def test_format_frontier_takes_measured_peaks_and_predicts_the_rest(tmp_path):
    import format_frontier as ff

    losses = {"fp32": [1.0, 2.0], "default": [1.01, 2.0], "block4": [1.02, 2.04], "rot4-log4": [1.0, 2.02]}
    losses["mystery"] = [1.0, 2.0]  # neither measured nor predictable: left out
    runs = [{"key": k, "seed": s, "label": k, "final_eval": v} for k, vs in losses.items() for s, v in enumerate(vs)]
    memory = tmp_path / "memory.json"
    rows = {"FOR": {"ok": True, "peak": 6 << 30}, "FO4R": {"ok": True, "peak": 5 << 30}, "A": {"ok": False}}
    memory.write_text(json.dumps({"rows": rows}))
    pts = {p["key"]: p for p in ff.points({"runs": runs}, ff.measured_peaks([str(memory)]))}
    assert set(pts) == {"default", "block4", "rot4-log4"}  # fp32's run (A) failed: no peak, no point
    assert pts["block4"]["peak_gib"] == 5 and pts["block4"]["peak_from"] == "measured"
    assert pts["block4"]["diff_pct"] == pytest.approx((100 * 0.01 / 1.01 + 2.0) / 2)
    assert pts["block4"]["low"] == pytest.approx(100 * 0.01 / 1.01) and pts["block4"]["high"] == pytest.approx(2.0)
    assert pts["default"]["diff_pct"] == 0 and pts["default"]["peak_gib"] == 6
    assert pts["rot4-log4"]["peak_from"] == "predicted" and 3 < pts["rot4-log4"]["peak_gib"] < 6
    assert "(predicted)" in ff.table(list(pts.values()))


def test_quality_summary_gap_and_spread():
    runs = {
        "A/0": {"key": "A", "seed": 0, "ok": True, "final_eval": 1.00},
        "A/1": {"key": "A", "seed": 1, "ok": True, "final_eval": 1.02},
        "FO/0": {"key": "FO", "seed": 0, "ok": True, "final_eval": 1.015},
        "B/0": {"key": "B", "seed": 0, "ok": True, "final_eval": 1.05},
    }
    s = compare_quality.summary({"runs": runs})
    assert s["A"]["mean"] == pytest.approx(1.01) and s["A"]["std"] is not None
    assert s["FO"]["gap"] == pytest.approx(0.005) and s["FO"]["within_ref_spread"]
    assert s["B"]["gap_pct"] == pytest.approx(100 * 0.04 / 1.01) and not s["B"]["within_ref_spread"]


def test_frontier_gives_release_configs_the_loss_of_their_plain_twin():
    import compare_report

    memory = {"rows": {k: {"ok": True, "peak": p} for k, p in {"A": 16, "G": 6, "FOR": 5, "FO": 7}.items()}}
    runs = {f"{k}/0": {"key": k, "seed": 0, "ok": True, "final_eval": x} for k, x in {"A": 1.0, "F": 1.01}.items()}
    runs["FO/0"] = {"key": "FO", "seed": 0, "ok": True, "final_eval": 1.005}
    points = compare_report.frontier_points(memory, {"runs": runs})
    assert points == {"A": (16, 1.0), "G": (6, 1.01), "FOR": (5, 1.005), "FO": (7, 1.005)}
    lines = compare_report.check_targets(memory, {"runs": runs}, None)
    assert any(line.startswith("frontier: G") and "dominated by FOR" in line for line in lines)


def test_fit_search_stops_when_a_failed_trial_keeps_its_memory():
    gib = compare_fit.GIB
    assert compare_fit.leak_error({"ok": True, "layers": 9, "left_allocated": 20 * gib}) is None
    assert compare_fit.leak_error({"ok": False, "layers": 9, "left_allocated": 0}) is None
    error = compare_fit.leak_error({"ok": False, "layers": 106, "left_allocated": int(9.7 * gib)})
    assert "106 layers left 9.7 GiB allocated" in error
    # a trial in its own process took its memory with it: the search goes on
    assert compare_fit.leak_error({"ok": False, "layers": 106, "left_allocated": int(9.7 * gib)}, True) is None


def test_a_trial_in_its_own_process_measures_what_it_measures_in_this_one():
    shape = "vocab=256,d_model=32,heads=2,kv_heads=2,ffn=64"
    args = argparse.Namespace(
        device="cpu", shape=shape, seq_len=8, steps=1, max_trials=4, activations_gib=0.0, resolution=None,
        process_per_trial="release", budgets_mib="4", budgets=None, _baseline=0, base="1b",
    )  # fmt: skip
    entry = competitors.BY_KEY["FOR"]
    budget = 4 * compare_fit.MIB
    compare_fit._cap_memory(args, budget, "cpu")
    here = compare_fit.trial(entry, 3, args, "cpu")
    there = compare_fit.trial_in_own_process(entry, 3, args, budget)
    assert len(here.pop("step_ms")) == len(there.pop("step_ms")) == 1  # timed, not compared
    assert here == there and here["ok"] and here["peak"] > 0


def test_fit_results_of_two_gpus_merge_budget_by_budget():
    a = {"rows": {"A": {"key": "A", "label": "a", "ok": True, "budgets": {"24": {"layers": 32}}},
                  "G": {"key": "G", "label": "g", "ok": False, "error": "leak"}}}  # fmt: skip
    b = {"rows": {"A": {"key": "A", "label": "a", "ok": True, "budgets": {"80": {"layers": 120}}},
                  "G": {"key": "G", "label": "g", "ok": True, "budgets": {"24": {"layers": 99}}},
                  "H": {"key": "H", "label": "h", "ok": False, "error": "not started"}}}  # fmt: skip
    merged = compare_fit.merge(a, b)["rows"]
    assert merged["A"]["budgets"] == {"24": {"layers": 32}, "80": {"layers": 120}}
    assert merged["G"]["ok"] and "error" not in merged["G"] and merged["G"]["budgets"] == {"24": {"layers": 99}}
    assert merged["H"] == {"key": "H", "label": "h", "ok": False, "error": "not started"}


def test_quality_settings_compare_equal_after_the_results_file_round_trip():
    import compare_quality

    args = argparse.Namespace(steps=20, warmup=2, lr=1e-3, shape="d_model=32", batch=2, seq=8, eval_seqs=4)
    shape = compare_quality.parse_shape("d_model=32", compare_quality.PRESETS["tiny"])
    settings = compare_quality.run_settings(args, shape, torch.zeros(100), torch.zeros(10), "digest")
    assert isinstance(settings["hparams"]["betas"], list)  # HPARAMS holds a tuple
    assert json.loads(json.dumps(settings)) == settings


def test_fit_redo_searches_measured_budgets_again():
    row = {"budgets": {"24": {"layers": 32}}}
    assert compare_fit.budgets_to_measure(row, [24, 80], redo=False) == [80]
    assert compare_fit.budgets_to_measure(row, [24, 80], redo=True) == [24, 80]
    assert compare_fit.budgets_to_measure({}, [24], redo=False) == [24]


def test_every_kernel_ablation_variant_applies_to_the_current_kernels(tmp_path):
    import kernel_ablation

    sys.path.insert(0, str(tmp_path))
    try:
        for name in ["base", *kernel_ablation.EDITS]:
            variant = kernel_ablation.build_variant(str(tmp_path), name)
            assert hasattr(variant, "_update_kernel") and hasattr(variant, "_check_kernel"), name
    finally:
        sys.path.remove(str(tmp_path))
