"""The comparison with other libraries on CPU: competitor configurations in the profiler, the torch
"optimizer in backward" pattern, the line-up (fusedopt/profile/lineup.py), and the benchmark
harness's pure logic (benchmarks/harness.py: timing as ratios, the paired-seed quality runner and its
report, fingerprints) and scripts (fit search, quality studies, step speed). None of this needs the
competitor libraries installed."""

import argparse
import collections
import inspect
import json
import os
import sys

import pytest
import torch

import fusedopt
import fusedopt.profile
from fusedopt.kernels import moments
from fusedopt.profile import parse_config
from fusedopt.profile.competitors import COMPETITORS, Competitor, torch_adamw_in_backward
from fusedopt.profile.lineup import BY_KEY, HPARAMS, LINEUP, fusedopt_step_bytes
from fusedopt.profile.memory import state_storages, state_tensors
from fusedopt.profile.models import UserError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import compare_fit  # noqa: E402
import fit_7b  # noqa: E402
import harness  # noqa: E402
import kernel_counters  # noqa: E402
import kernel_instructions  # noqa: E402
import quality  # noqa: E402
import step_speed  # noqa: E402
import stream_ceiling  # noqa: E402


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
    assert len({e.key for e in LINEUP}) == len(LINEUP) == len(BY_KEY)
    for entry in LINEUP:
        config = entry.optimizer_config()
        if entry.hparams is None:
            assert config.kwargs["lr"] == HPARAMS["lr"]
        else:  # its own (Adafactor: torch's defaults), none of AdamW's
            assert not set(HPARAMS) - set(entry.hparams) & set(config.kwargs)
            with pytest.raises(UserError, match="its own hyperparameters"):
                entry.optimizer_config(HPARAMS)
        assert entry.step_bytes is None or not config.release  # release configs have no separate step
    for part, keys in harness.PARTS.items():
        assert keys is None or set(keys) <= set(BY_KEY), part
        assert all(e.step_bytes is not None for e in harness.select(None, "step")) if part == "step" else True
    assert [e.key for e in harness.select(None, "memory")] == list(BY_KEY)
    assert BY_KEY["FO"].step_bytes == fusedopt_step_bytes(8, 24) == 12.25  # 2 grad + 4 param + 2 corr + 4 + 0.25
    assert fusedopt_step_bytes(4, None) == 2 + 4 + 2 + 0.25
    with pytest.raises(SystemExit, match="unknown line-up key 'NOPE'"):
        harness.select("A,NOPE", "memory")


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
    opt = BY_KEY[key].optimizer_config().build([param], model=torch.nn.Linear(1, 1))
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
    config = BY_KEY["AFR"].optimizer_config()
    guess = compare_fit.predicted_layers(config, 24 * gib, None, gib, "7b")
    per_layer = compare_fit.family(2, None, "7b").num_params() - compare_fit.family(1, None, "7b").num_params()
    assert guess == int((23 * gib - 3 * (compare_fit.family(1, None, "7b").num_params() - per_layer)) / (3 * per_layer))
    assert 32 < guess < 40


def _runs(losses: dict, **extra) -> list[dict]:
    return [
        {"key": k, "seed": s, "label": k, "final_eval": v, **extra}
        for k, vs in losses.items()
        for s, v in enumerate(vs)
    ]


def test_quality_keys_take_their_own_peak_lr_and_pair_with_more_references():
    assert quality.config_of("fp32", 3e-3)[2] == 3e-3
    assert quality.config_of("adafactor", 3e-3)[2] == quality.PEAK_LR["adafactor"]
    assert quality.config_of("adafactor-m4@0.05", 3e-3)[2] == 0.05
    assert quality.config_of("FO@0.01", 3e-3)[1].kwargs["lr"] == 0.01  # a line-up key, its hyperparameters
    for bad, message in (
        ("nope", "unknown configuration"),
        ("adafactor@x", "must be a number"),
        ("fp32@-1", "positive"),
    ):
        with pytest.raises(ValueError, match=message):
            quality.config_of(bad, 3e-3)
    # the decoupled weight decay per step, lr * weight_decay, is the AdamW configurations'
    param = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
    group = quality.config_of("adafactor@0.3", 3e-3)[1].build([param]).param_groups[0]
    formats = quality.STUDIES["formats"]["gpu"]
    assert group["lr"] * group["weight_decay"] == pytest.approx(formats["lr"] * quality.ADAMW["weight_decay"])
    assert "betas" not in group  # torch.optim.Adafactor's arguments, not AdamW's
    runs = _runs({"fp32": [1.0, 2.0], "default": [1.1, 2.2], "adafactor-fp32": [1.2, 2.0], "adafactor-m4": [1.32, 2.1]})
    runs += _runs({"adafactor-m32": [1.1, 2.1]})
    also = quality.also_against(runs, [0, 1])
    assert set(also) == {"default", "adafactor-fp32", "adafactor-m32"}
    assert [r["key"] for r in also["adafactor-fp32"]] == ["adafactor-m4", "adafactor-m32"]
    assert also["adafactor-fp32"][0]["diff_pct"] == pytest.approx([10.0, 5.0])
    assert [r["key"] for r in also["adafactor-m32"]] == ["adafactor-m4"]  # compressed momentum against fp32's
    assert [r["key"] for r in also["default"]] == ["adafactor-fp32", "adafactor-m4", "adafactor-m32"]
    text = quality.report(runs, {"lr": 3e-3}, "fp32", [0, 1])
    assert "paired against adafactor-fp32" in text and "own peak lr (the others: 0.003)" in text


def test_every_quality_configuration_builds_what_it_names():
    """The quality keys are profiler configurations: each builds (on bf16 parameters) with the
    study's hyperparameters, and the clipping keys clip as they say."""
    for key in quality.CONFIGS:
        if key == "turboadam":
            continue  # another library: not installed here
        label, config, lr = quality.config_of(key, 1e-3)
        param = torch.nn.Parameter(torch.zeros(32, 16, dtype=torch.bfloat16))
        opt = config.build([param], model=torch.nn.Linear(1, 1), device_type="cpu")
        group = opt.param_groups[0]
        assert group["lr"] == lr and label
        if key in ("exact", "none", *quality.CLIP_METHODS):
            assert opt.fused == (key != "exact") and opt.max_grad_norm == (None if key == "none" else 1.0)
            assert key not in quality.CLIP_METHODS or opt.release_clipping == key
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
    assert quality.config_of("default~", 1e-3)[1].kwargs["seed"] == 1  # the control: other rounding draws
    assert quality.config_of("bf16-rtn", 1e-3)[1].optimizer == "torch.AdamW"


def test_paired_differences_per_seed_and_the_held_out_samples_part():
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
    rows = {r["key"]: r for r in harness.paired(runs, "fp32", [0])}
    expected = 100 * float(noise.std()) / 20 / float(ref.mean())
    assert rows["A"]["eval_se_pct"] == pytest.approx(expected, rel=1e-5)
    assert "eval_se_pct" not in rows["B"] and "eval_se_pct" not in rows["fp32"]
    # a constant shift of every window is a real difference, not sampling noise
    assert harness._eval_error((ref + 0.1).tolist(), ref.tolist()) == pytest.approx(0.0, abs=1e-5)
    assert harness._eval_error([1.0], [1.0]) is None and harness._eval_error([1.0, 2.0], [1.0]) is None
    assert "held-out sample's part" in quality.report(runs, {"lr": 3e-3, "eval_seqs": 400}, "fp32", [0])


def test_paired_summary_verdicts_gaps_and_seed_counts():
    runs = _runs({"A": [1.00, 1.02], "FO": [1.015, 1.03], "B": [1.05]})
    rows = {r["key"]: r for r in harness.paired(runs, "A")}
    assert rows["A"]["verdict"] == "reference" and rows["A"]["seeds"] == [0, 1]
    assert rows["FO"]["diff"] == pytest.approx([0.015, 0.01])
    assert rows["FO"]["diff_pct"] == pytest.approx([1.5, 100 * 0.01 / 1.02])
    assert rows["FO"]["verdict"] == "worse on every seed" and rows["FO"]["t"] > 0
    assert rows["FO"]["gap_pct"] == pytest.approx(100 * (1.0225 - 1.01) / 1.01)  # what unpaired means see
    assert rows["B"]["verdict"] == "one seed" and rows["B"]["diff_pct"] == pytest.approx([5.0])
    assert rows["B"]["gap_pct"] == pytest.approx(100 * 0.04 / 1.01)
    runs += _runs({"C": [0.9, float("nan")]})
    assert {r["key"]: r for r in harness.paired(runs, "A")}["C"]["verdict"] == "not finite"
    table = harness.paired_table(list(rows.values()), "A", "abs")
    assert "| FO | FO | 2 | 1.0225 | +0.0150 +0.0100 |" in table and "| A | A | 2 | 1.0100 | - | - | - |" in table


def test_recovery_after_spikes_is_against_the_same_configuration_without_them():
    calm = [0.5] * 120
    spiky = list(calm)
    spiky[11:61] = [0.7] * 50  # 50 steps after the spike at step 10: +0.2 each
    runs = [
        {"key": "exact", "seed": 0, "label": "exact", "final_eval": 1.0, "train_loss": calm, "spiky": False},
        {
            "key": "exact",
            "seed": 0,
            "label": "exact",
            "final_eval": 1.1,
            "spiky": True,
            "spikes": [10],
            "train_loss": spiky,
        },
    ]
    (quiet,) = harness.paired(runs, "exact", spiky=False)
    (loud,) = harness.paired(runs, "exact", spiky=True)
    assert "recovery" not in quiet and loud["recovery"] == pytest.approx(0.2)
    assert loud["loss"] == [1.1]  # each condition pairs with the reference of the same condition
    # the same spikes for every configuration of a seed, after warm-up, early enough to measure recovery
    steps = harness.spike_steps(3, 800, 50)
    assert steps == harness.spike_steps(3, 800, 50) and len(steps) == 8
    assert all(50 <= t < 800 - harness.RECOVERY for t in steps)
    # the results files of clipping_quality.py name the key "config" and mark spikes by their steps only
    old = quality.normalised([{"config": "scaled", "seed": 0, "spikes": [5], "final_eval": 1.0}])
    assert old[0]["key"] == "scaled" and old[0]["spiky"] and old[0]["label"] == "scaled"


def test_quality_runs_resume_and_refuse_other_settings(tmp_path, capsys):
    out = str(tmp_path / "q.json")
    argv = ["--study", "clipping", "--only", "none", "--seeds", "0", "--spikes", "no", "--device", "cpu"]
    argv += ["--shape", "vocab=256,d_model=16,layers=1,heads=2,kv_heads=2,ffn=32", "--steps", "3", "--warmup", "1"]
    argv += ["--batch", "2", "--seq", "8", "--eval-seqs", "4", "--corpus-limit", "200000", "--out", out]
    assert quality.main(argv) == 0
    data = json.load(open(out))
    assert sorted((r["key"], r["seed"], r["spiky"]) for r in data["runs"]) == [("exact", 0, False), ("none", 0, False)]
    assert data["settings"] == json.loads(json.dumps(data["settings"]))  # compares equal after the round trip
    assert all(len(r["train_loss"]) == 3 and len(r["eval_windows"]) == 4 for r in data["runs"])
    assert len(data["runs"][0]["grad_norm"]) == 3  # exact clips: the global norm of every step
    capsys.readouterr()
    assert quality.main(argv) == 0  # resumed: nothing left to train
    assert "held-out" not in capsys.readouterr().out.split("settings:")[0]
    assert len(json.load(open(out))["runs"]) == 2
    assert quality.main([*argv, "--lr", "1e-2"]) == 2  # other settings: refused, not mixed
    assert quality.main(["--study", "clipping", "--report-only", "--out", out]) == 0
    assert "| none | fused=True, no clipping | 1 |" in capsys.readouterr().out


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
    entry = BY_KEY["FOR"]
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


def test_fit_redo_searches_measured_budgets_again():
    row = {"budgets": {"24": {"layers": 32}}}
    assert compare_fit.budgets_to_measure(row, [24, 80], redo=False) == [80]
    assert compare_fit.budgets_to_measure(row, [24, 80], redo=True) == [24, 80]
    assert compare_fit.budgets_to_measure({}, [24], redo=False) == [24]


def test_interleaved_rounds_and_ratios_in_the_same_round():
    assert harness.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert harness.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]  # drift hits all alike
    assert harness.round_order(["a", "b", "c"], 1, "rotate") == ["b", "c", "a"]
    calls = []
    times = harness.interleave({n: (lambda n=n: calls.append(n)) for n in "ab"}, 2, 3, "cpu")
    assert calls == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3 and all(len(t) == 2 for t in times.values())
    summary = harness.ratios({"base": [2.0, 4.0, 3.0], "x": [1.0, 4.0, 6.0]}, "base")
    assert summary["x"]["ratios"] == [0.5, 1.0, 2.0] and summary["x"]["ratio"] == 1.0  # per round, then median
    assert (summary["x"]["min"], summary["x"]["max"], summary["x"]["ms"]) == (0.5, 2.0, 4.0)
    assert summary["base"]["ratio"] == 1.0


def test_step_speed_times_every_configuration_against_the_baseline(tmp_path):
    out = tmp_path / "step.json"
    argv = ["--device", "cpu", "--shape", "32x64", "--tensors", "2", "--rounds", "2", "--reps", "1"]
    argv += ["--configs", "fusedopt:state_bits=4,master_weight_bits=None", "--lineup", "B", "--out", str(out)]
    assert step_speed.main(argv) == 0
    results = json.load(open(out))["results"]
    assert list(results)[0] == "torch.AdamW(fused=True)" and results["torch.AdamW(fused=True)"]["ratio"] == 1.0
    assert set(results) >= {"fusedopt.AdamW", "torch AdamW fused, pure bf16 (bf16 state) [B]"}
    assert all(len(r["ratios"]) == 2 for r in results.values())
    assert results["fusedopt.AdamW(state_bits=4, master_weight_bits=None)"]["bytes_per_element"] == 8.25
    assert results["fusedopt.AdamW"]["bytes_per_element"] == 12.25
    with pytest.raises(SystemExit, match="no optimizer step"):
        step_speed.main(["--device", "cpu", "--shape", "8x8", "--tensors", "1", "--lineup", "FOR"])
    assert step_speed.layer_shapes(1, True)[0] == (32000, 2048) and len(step_speed.layer_shapes(4, False)) == 37


@pytest.mark.parametrize("name", list(stream_ceiling.STREAMS))
def test_a_format_s_skeleton_moves_the_bytes_its_step_does_and_touches_every_item(name):
    """stream_ceiling's skeleton: the bytes of its streams are those of the step it stands for (the
    gradient, the parameter and every state tensor, per element), and one launch over a tensor that ends
    inside a tile flips every item of every stream once (the parameter takes the gradient's bits)."""
    streams = stream_ceiling.STREAMS[name]
    config = parse_config(stream_ceiling.STEPS[name])
    (param,) = harness.params_with_grads([(64, 1024)], "cpu")
    opt = config.build([param], device_type="cpu")
    opt.step()
    state = sum(t.numel() * t.element_size() for _, t in state_tensors(opt)) / param.numel()
    state -= 4 / param.numel() * (name == "torch fused AdamW, bf16 state")  # torch's step count (fp32)
    assert stream_ceiling.bytes_per_element(streams) == pytest.approx(2 + 2 * (2 + state), abs=0.02)
    n = 2 * 2048 + 128 * 3  # items of every stream, a tile and a half
    torch.manual_seed(0)
    skeleton = stream_ceiling.Skeleton(streams, n, "cpu", tile=2048, warps=4)
    for t in skeleton.tensors:
        t.copy_(torch.randint(0, 100, t.shape).to(t.dtype))
    before = [t.clone() for t in skeleton.tensors]
    skeleton.step()
    assert torch.equal(skeleton.tensors[0], before[0] ^ skeleton.grad)
    for t, b in zip(skeleton.tensors[1:], before[1:]):
        assert torch.equal(t, b ^ 1)


def test_fingerprints_compare_two_trees_bit_for_bit(tmp_path, capsys):
    grid = {
        key: (name, options)
        for key, name, options, _, _ in harness.fingerprint_grid(("adamw", "adafactor"), ("block8", "norm2-root4"))
    }
    assert "adamw bits=8 master=24 bfloat16 fused=True" in grid  # the keys of the first bits files
    assert "adamw format=block8 master=24 bfloat16 fused=False" not in grid  # state_bits=8 covers it
    assert "adafactor format=block8 master=None bfloat16 fused=True" in grid
    assert "adamw format=norm2-root4 master=None bfloat16 fused=True" in grid
    assert not any("float32" in k and "master=None" in k for k in grid)  # fp32 parameters: no correction
    one = harness.fingerprint(
        "adamw", dict(state_format="norm2-root4", master_weight_bits=24), torch.bfloat16, False, "cpu"
    )
    assert one == harness.fingerprint(
        "adamw", dict(state_format="norm2-root4", master_weight_bits=24), torch.bfloat16, True, "cpu"
    )
    assert one != harness.fingerprint("adamw", dict(state_bits=8, master_weight_bits=24), torch.bfloat16, False, "cpu")
    a = {"x": "1", "y": "2", "z": "refused: ValueError", "old": "3", "w": "4"}
    b = {"x": "1", "y": "9", "z": "refused: ValueError", "w": "refused: ValueError", "new": "5"}
    verdict = harness.same_bits(a, b)
    assert verdict == {
        "identical": ["x"],
        "differ": ["y"],
        "refused in both": ["z"],
        "refused in one": ["w"],
        "only in the first": ["old"],
        "only in the second": ["new"],
    }
    # a configuration only the old tree has (a removed format) is reported, not a failure
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"x": "1", "adamw format=rot4 master=24 bfloat16 fused=False": "3"}))
    new.write_text(json.dumps({"x": "1"}))
    assert harness.main(["same", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "bit-identical: 1 of 1" in out
    assert f"1 configurations only in {old}:\n  adamw format=rot4 master=24 bfloat16 fused=False" in out
    new.write_text(json.dumps({"x": "2"}))
    assert harness.main(["same", str(old), str(new)]) == 1 and "differ: x" in capsys.readouterr().out


def test_kernel_instructions_counts_the_fast_path_by_statement(monkeypatch):
    """nvdisasm -gi output: each instruction goes to the _update_tile line its innermost caller in that body
    is at (or another file's innermost line); a slow-path call site's block (either shape) and the routines
    after the body are left out."""
    where = '\t//## File "/r/kernels/{0}", line {1} inlined at "/r/kernels/update.py", line {2}\n'
    body = "\n".join(
        [
            where.format("moments.py", 9, 40),  # inlined from update.py:40, inside the body
            "        /*0000*/                   FADD R1, R2, R3 ;",
            "        /*0010*/                   MUFU.RSQ R0, R1 ;",
            "        /*0020*/              @!P1 BRA `(.L_x_3) ;",  # skips the call block: counted
            "        /*0030*/                   IMAD.MOV.U32 R0, RZ, RZ, R1 ;",
            "        /*0040*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_sqrt_rn_f32_slowpath) ;",
            "        /*0050*/                   BRA `(.L_x_4) ;",
            ".L_x_3:",
            '\t//## File "/r/kernels/update.py", line 41',
            "        /*0060*/                   FFMA R2, R0, R1, R2 ;",
            "        /*0070*/              @!P2 BRA `(.L_x_5) ;",
            "        /*0080*/                   MOV R2, 0x38a0 ;",
            "        /*0090*/                   CALL.REL.NOINC `($__internal_1_div_slowpath) ;",
            "        /*00a0*/                   IMAD.MOV.U32 R18, RZ, RZ, R0 ;",
            ".L_x_5:",
            '\t//## File "/r/kernels/update.py", line 90',  # outside the body
            "        /*00b0*/                   STG.E [R2.64], R0 ;",
            "        /*00c0*/                   NOP ;",
            "        /*00d0*/                   EXIT ;",
            ".L_x_9:",
            "        /*00e0*/                   BRA `(.L_x_9) ;",
            "        .type           $__internal_0_$__cuda_sm20_sqrt_rn_f32_slowpath,@function",
            "        /*00f0*/                   FMUL R0, R0, R1 ;",
            "        /*0100*/                   RET.REL.NODEC R2 `(_update_kernel) ;",
        ]
    )
    counts = kernel_instructions.statements(body, range(30, 60))
    assert counts == {40: 3, 41: 2, None: 2}
    # by the innermost line of another file (Adafactor's kernels by kernels/factored.py)
    assert kernel_instructions.statements(body, range(1, 100), "kernels/moments.py") == {9: 3, None: 4}
    # a line marked as a rare branch: its code (up to the next line information) is not on the fast path
    assert kernel_instructions.statements(body, range(30, 60), rare={("kernels/update.py", 41)}) == {40: 3, None: 2}
    assert kernel_instructions.statements(body, range(30, 60), rare={("kernels/moments.py", 41)}) == counts
    # --lines: by the innermost line of a kernels/ module, with its text
    monkeypatch.setattr(kernel_instructions, "_sass", lambda fn, record, lines=False: (body, 0))
    source = inspect.getsourcelines(moments)[0]
    assert kernel_instructions._by_line(None, None, ["moments"]) == {"moments": [(9, source[8].strip(), 3)]}


def test_idle_gaps_charge_each_gap_to_the_code_that_launched_the_next_kernel():
    """fit_7b.py --idle: a gap between the end of the kernels so far and the next kernel's start goes to that
    kernel's launch (by correlation id): the innermost frames of the project's code around the launch and its
    operator; overlapping kernels and gaps at the threshold or below count nothing; per step."""

    def frame(name, ts, dur, cat="python_function", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    def kernel(ts, dur, correlation=None):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    def launch(ts, correlation, cat="cuda_runtime", tid=1):
        return {
            "ph": "X",
            "cat": cat,
            "name": "launch",
            "ts": ts,
            "dur": 1,
            "tid": tid,
            "args": {"correlation": correlation},
        }

    events = [
        frame("benchmarks/fit_7b.py(1): step", 0, 1000),
        frame("torch/autograd/graph.py(5): backward", 10, 900),
        frame("/src/fusedopt/release.py(7): hook", 100, 50),
        frame("/src/fusedopt/kernels/launcher.py(3): launch", 120, 20),
        frame("aten::add_", 125, 10, cat="cpu_op"),
        launch(130, 1, cat="cuda_driver"),
        frame("torch/nn/functional.py(9): linear", 300, 40),
        frame("aten::mm", 305, 30, cat="cpu_op"),
        launch(310, 2),
        frame("torch/optim/adamw.py(2): step", 600, 50, tid=2),  # another thread: torch's frames only
        launch(610, 3, tid=2),
        kernel(0, 100),
        kernel(50, 90),  # overlaps: no gap
        kernel(60, 10),  # inside the one before: the next gap runs from 140, not from its end
        kernel(160, 20, correlation=1),  # 20 us after the end (140): the release hook
        kernel(185, 10),  # 5 us: at the threshold, not a gap
        kernel(400, 10, correlation=2),  # 205 us: launched in torch's linear, inside the benchmark's step
        kernel(500, 10, correlation=99),  # 90 us: its launch is not in the trace
        kernel(700, 10, correlation=3),  # 190 us
    ]
    result = fit_7b.idle_gaps(events, steps=2)
    gaps = result["gaps"]
    assert gaps == {
        "fit_7b.py(1): step | aten::mm": [0.102, 1],  # the project's frames, however far out, before torch's
        "(launch not found)": [0.045, 1],
        "torch/optim/adamw.py(2): step | ?": [0.095, 1],
        "launcher.py(3): launch < release.py(7): hook < fit_7b.py(1): step | aten::add_": [0.01, 1],
    }
    assert result["total_ms"] == pytest.approx((20 + 205 + 90 + 190) / 1000 / 2)


def test_kernel_instructions_names_the_source_lines_of_each_layout_conversion():
    """--layouts: a TTGIR's convert_layout ops by the locations they carry (a file location, a named one, call
    sites nested in call sites), innermost first, in the module's order; a location it cannot read is named."""
    ttgir = "\n".join(
        [
            "module {",
            "  %1 = ttg.convert_layout %0 : tensor<8xf32, #a> -> tensor<8xf32, #b> loc(#loc5)",
            "  %2 = arith.addf %1, %1 : tensor<8xf32, #b> loc(#loc1)",
            "  %3 = ttg.convert_layout %2 : tensor<8xf32, #b> -> tensor<8xf32, #a> loc(#loc6)",
            "  %4 = ttg.convert_layout %3 : tensor<8xf32, #a> -> tensor<8xf32, #b> loc(#loc9)",
            "}",
            '#loc = loc("/r/kernels/update.py":1:0)',
            '#loc1 = loc("/r/kernels/update.py":716:4)',
            '#loc2 = loc("/r/kernels/normalised.py":134:8)',
            '#loc3 = loc("/r/kernels/update.py":526:12)',
            '#loc4 = loc("x"(#loc2))',
            "#loc5 = loc(callsite(#loc4 at #loc7))",
            '#loc6 = loc("/r/kernels/rootgrid.py":107:4)',
            "#loc7 = loc(callsite(#loc3 at #loc1))",
        ]
    )
    assert kernel_instructions.layout_conversions(ttgir) == [
        "normalised.py:134 < update.py:526 < update.py:716",
        "rootgrid.py:107",
        "#loc9",
    ]
    assert kernel_instructions.layout_conversions("module {\n}") == []


def test_kernel_counters_weight_each_launchs_stall_rates_by_its_time(tmp_path, capsys):
    """STALLS=1, PIPES=1: ncu's per-launch rates (issue slots, warps per cycle, stall reasons, pipes) averaged over a
    kernel's launches by their time, the reasons largest first (below 1% left out); sums (time, instructions) add up."""
    header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    rows = []
    for launch, time, issue, barrier, wait in (("0", 1000, 50, 10, 30), ("1", 3000, 90, 2, 6)):
        metrics = {
            "gpu__time_duration.sum": time, "smsp__thread_inst_executed.sum": 1e9, "dram__bytes_read.sum": 2e8,
            "dram__bytes_write.sum": 1e8, "smsp__issue_active.avg.pct_of_peak_sustained_active": issue,
            "smsp__warps_active.avg.per_cycle_active": 4, "smsp__warps_eligible.avg.per_cycle_active": 1,
            "smsp__warp_issue_stalled_barrier_per_warp_active.pct": barrier,
            "smsp__warp_issue_stalled_wait_per_warp_active.pct": wait,
            "smsp__warp_issue_stalled_drain_per_warp_active.pct": 0.5,
            "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active": issue - 10,
            "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active": 20,
        }  # fmt: skip
        rows += [f'"{launch}","_update_kernel(int)","{name}","x","{value:,}"' for name, value in metrics.items()]
    path = tmp_path / "counters_0.csv"
    path.write_text("\n".join([f"{kernel_counters.MARK} fusedopt.AdamW", header, *rows]))
    kernel_counters.summarize([str(path)])
    out = capsys.readouterr().out
    elements = kernel_counters.SHAPE[0] * kernel_counters.SHAPE[1]
    assert f"| fusedopt.AdamW | _update_kernel | 2 | 4.0 | {2e9 / elements:.1f} | {6e8 / elements:.2f} |" in out
    # issue (50 * 1 + 90 * 3) / 4 = 80; wait (30 + 18) / 4 = 12; barrier (10 + 6) / 4 = 4; drain 0.5: left out
    assert "| fusedopt.AdamW | _update_kernel | 80 | 4.00 / 1.00 | wait 12, barrier 4 |" in out
    # PIPES=1: each pipe's share weighted the same way, pipes ncu did not report as "-"
    assert "| fusedopt.AdamW | _update_kernel | 70 | 20 | - | - | - | - | - |" in out


def test_kernel_instructions_sums_opcodes_by_their_pipe():
    """--pipes: opcodes by their first word onto sm_90's pipes, modifiers and all; unknown ones as "other"."""
    ops = collections.Counter({"LOP3.LUT": 3, "FMNMX": 2, "FFMA": 4, "IMAD.MOV.U32": 1, "MUFU.RCP": 1, "LDG.E.128": 2,
                               "BRA": 5, "VIADD": 1})  # fmt: skip
    assert kernel_instructions.by_pipe(ops) == {"alu": 5, "fma": 5, "xu": 1, "lsu": 2, "other": 6}


def test_kernel_instructions_finds_the_rare_branch_of_adams_denominator():
    """The approximate denominator's IEEE fallbacks (eps below the flush-safe bound; one per direction helper)
    are marked rare in the kernel source, so the static fast path counts the branch a normal eps takes."""
    rare = kernel_instructions.rare_lines()
    assert len(rare) == 2
    for path, line in rare:
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)) as f:
            assert "tl.sqrt_rn(v)" in f.read().splitlines()[line - 1]


def test_draw_seeds_give_each_seed_its_own_rounding_draws():
    """quality.py --draw-seeds: a fusedopt configuration's optimizer seed follows the run's seed (a control's
    own seed offset kept); other libraries' configurations and runs without the option are left alone."""
    on, off = {"lr": 1e-3, "draw_seeds": True}, {"lr": 1e-3}
    seeds = [quality.run_config(key, s, on)[1].kwargs["seed"] for key in ("default", "default~") for s in (0, 3)]
    assert seeds == [0, 3000, 1, 3001]
    assert "seed" not in quality.run_config("default", 3, off)[1].kwargs
    assert quality.run_config("default~", 3, off)[1].kwargs["seed"] == 1
    assert "seed" not in quality.run_config("bf16-rtn", 3, on)[1].kwargs  # torch's AdamW has none
