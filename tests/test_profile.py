"""fusedopt.profile: the memory profiler, its command line and the planner.

Hand-built cases with a known peak check the measurement itself; one run of the command on
the embedded model (tiny preset, three configurations, each in its own process) checks the
comparison the profiler exists for; bad inputs must give a message and exit code 2.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import tracked_step

import fusedopt
from fusedopt.dispatch import bucket_budget
from fusedopt.profile import MemoryTracker, OptimizerConfig, main, parse_config, plan, recommend
from fusedopt.profile.cli import _parse_gib
from fusedopt.profile.memory import CATEGORIES, cpu_allocator_trace
from fusedopt.profile.models import PRESETS, ModelSpec, UserError, parse_shape

MB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fusedopt_default_config() -> str:
    """fusedopt's defaults once they are implemented; until then a stand-in with 16-bit state."""
    param = torch.nn.Parameter(torch.zeros(64, 128))
    try:
        opt = fusedopt.AdamW([param])
        param.grad = torch.ones_like(param)
        opt.step()
        return "fusedopt.AdamW"
    except NotImplementedError:
        return "fusedopt.AdamW:state_bits=16,master_weight_bits=None"


def fusedopt_release_config() -> str:
    config = fusedopt_default_config()
    return config + (",fused=True" if ":" in config else ":fused=True")


def _sums_to_total(bd) -> bool:
    cats = bd["categories"] if isinstance(bd, dict) else bd.categories
    total = bd["total"] if isinstance(bd, dict) else bd.total
    return sum(cats[c] for c in CATEGORIES) == total


# --- hand-built cases with a known peak ----------------------------------------------------------


def _known_step(tracker, device, unit=MB):
    """forward: +3, +5, -3, +2 units (peak 8); backward: +4 (peak 11), -5; update: frees the rest."""
    kw = dict(dtype=torch.uint8, device=device)
    with tracker:
        with tracker.phase("forward"):
            a = torch.empty(3 * unit, **kw)
            b = torch.empty(5 * unit, **kw)
            del a
            c = torch.empty(2 * unit, **kw)
        with tracker.phase("backward"):
            d = torch.ones(4 * unit, **kw)
            view = d.view(2, -1)  # a view: no new memory
            del b
        with tracker.phase("update"):
            del c, d, view
    return tracker.result()


def test_known_peak_cpu():
    r = _known_step(MemoryTracker(device="cpu"), "cpu")
    assert r.peak == 11 * MB
    assert r.peak_phase == "backward"
    assert r.persistent == 0
    assert r.phases["forward"]["peak"] == 8 * MB
    assert r.phases["backward"]["peak"] == 11 * MB
    assert r.phases["backward"]["end"] == 6 * MB
    assert r.phases["update"]["peak"] == 6 * MB and r.phases["update"]["end"] == 0
    cats = r.peak_breakdown.categories
    assert cats["activations"] == 7 * MB  # b and c, allocated in forward
    assert cats["rest"] == 4 * MB and r.peak_breakdown.rest_parts["backward_temporaries"] == 4 * MB
    assert _sums_to_total(r.peak_breakdown) and r.peak_breakdown.total == r.peak
    assert "tensor accounting" in r.method["peak"]
    # the timeline's categories sum to its totals and its maximum is the peak
    assert max(s[2] for s in r.timeline) == r.peak
    assert all(sum(s[3:9]) == s[2] for s in r.timeline)


class _ToyOptimizer(torch.optim.Optimizer):
    """State with a correction and a moment, as fusedopt's, made by hand."""

    def __init__(self, params):
        super().__init__(params, {})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros(p.numel(), dtype=torch.float32)  # 4 B / element
                self.state[p]["master_correction"] = torch.zeros(p.numel(), dtype=torch.int8)  # 1 B / element

    def step(self, closure=None):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    tmp = p.grad.float() * 2  # an update temporary
                    p.sub_(tmp.to(p.dtype))


def test_categories_by_hand():
    model = torch.nn.Linear(512, 1024, bias=False).to(torch.bfloat16)  # 1 MiB of bf16 weight
    opt = _ToyOptimizer(model.parameters())
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    n = 512 * 1024
    r = tracked_step(model, opt, x)
    persistent = r.persistent_breakdown.categories
    assert persistent["parameters"] == 2 * n
    assert persistent["corrections"] == n
    assert persistent["optimizer_state"] == 4 * n
    assert persistent["gradients"] == 0
    # the peak is in the update: weight, state, the bf16 gradient and the fp32 temporary
    assert r.peak_phase == "update"
    cats = r.peak_breakdown.categories
    assert cats["gradients"] == 2 * n
    assert r.peak_breakdown.rest_parts["update_temporaries"] >= 4 * n
    assert _sums_to_total(r.peak_breakdown)


class _HookedOptimizer(torch.optim.Optimizer):
    """The update-hook protocol of fusedopt's optimizers under other method names: the tracker
    must find updates through ``register_update_hook``, not by what the methods are called."""

    def __init__(self, params):
        super().__init__(params, {})
        self.hooks = []

    def register_update_hook(self, hook):
        self.hooks.append(hook)
        hooks = self.hooks

        class Handle:
            def remove(self):
                hooks.remove(hook)

        return Handle()

    def apply_now(self, p):  # an update inside backward, as fusedopt's fused=True runs them
        with contextlib.ExitStack() as stack:
            for hook in list(self.hooks):
                stack.enter_context(hook())
            with torch.no_grad():
                tmp = p.grad.float() * 2  # an update temporary, kept alive into the peak
                p.sub_(tmp.to(p.dtype))
            return tmp

    def step(self, closure=None):
        pass


def test_updates_are_attributed_through_the_update_hook():
    model = torch.nn.Linear(512, 1024, bias=False).to(torch.bfloat16)
    opt = _HookedOptimizer(model.parameters())
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    n = 512 * 1024
    tracker = MemoryTracker(model, opt)
    tracker.register_inputs(x)
    with tracker:
        with tracker.phase("forward"):
            loss = model(x).float().pow(2).sum()
        with tracker.phase("backward"):
            loss.backward()
            del loss
            tmp = opt.apply_now(model.weight)
            model.weight.grad = None
            del tmp
    r = tracker.result()
    parts = r.phases["backward"]["breakdown"].rest_parts
    assert parts["update_temporaries"] >= 4 * n  # the fp32 temporaries, made in backward by the update
    assert parts["backward_temporaries"] < 4 * n
    assert opt.hooks == []  # the tracker removed its hook on exit


def test_fusedopt_updates_in_backward_are_the_updates():
    """fused=True updates inside backward: their temporaries are update temporaries, seen
    through the optimizer's public hook; the optimizer is left unpatched."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(1, 1024, dtype=torch.bfloat16)
    model(x).float().sum().backward()  # state exists before the tracked step
    opt.step()
    tracker = MemoryTracker(model, opt)
    tracker.register_inputs(x)
    with tracker:
        with tracker.phase("forward"):
            loss = model(x).float().sum()
        with tracker.phase("backward"):
            loss.backward()
            del loss
        with tracker.phase("update"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    r = tracker.result()
    assert r.peak_phase == "backward"
    assert r.peak_breakdown.rest_parts["update_temporaries"] >= 4 * 1024 * 1024  # at least one fp32 copy
    assert not {"update_param", "queue_update", "flush_updates"} & set(vars(opt))


def test_profiler_reads_no_private_optimizer_attribute():
    """The profiler uses optimizers' public API only, so renaming their internals cannot break it."""
    import ast
    import pathlib

    names = {"opt", "optimizer"}
    found = []
    for path in pathlib.Path(fusedopt.profile.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.endswith("__"):
                continue
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if owner_name in names:
                found.append(f"{path.name}:{node.lineno} {owner_name}.{node.attr}")
    assert found == []


def test_views_of_existing_memory_are_not_charged():
    data = torch.zeros(16 * MB, dtype=torch.uint8)  # exists before tracking
    tracker = MemoryTracker()
    with tracker:
        with tracker.phase("forward"):
            window = data[: 1 * MB]
            copy = window.clone()
    del window, copy
    assert tracker.result().peak == 1 * MB


def test_cpu_allocator_trace_known_peak():
    def step(phase):
        with phase("forward"):
            a = torch.empty(3 * MB, dtype=torch.uint8)
            b = torch.empty(5 * MB, dtype=torch.uint8)
            del a
        with phase("backward"):
            c = torch.empty(1 * MB, dtype=torch.uint8)
            del b, c

    result = cpu_allocator_trace(step)
    assert result["peak"] == 8 * MB
    assert result["phase"] == "forward"
    assert result["phases"]["backward"] == 6 * MB


def test_rss_reader_sees_touched_memory():
    # In a fresh process: in this one, memory freed by earlier tests can stay resident and be
    # reused, so a new allocation need not raise the RSS (seen once in CI).
    script = (
        "import torch\n"
        "from fusedopt.profile.memory import RssReader\n"
        "rss = RssReader()\n"
        "before = rss.current()\n"
        "block = torch.ones(64 * 2**20, dtype=torch.uint8)\n"
        "print(rss.current() - before)\n"
        "rss.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) >= 48 * MB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_known_peak_cuda():
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    unit = 2 * MB  # the caching allocator rounds large blocks up to multiples of 2 MiB
    r = _known_step(MemoryTracker(device="cuda", baseline=baseline), "cuda", unit)
    assert r.peak == 11 * unit
    assert r.peak_phase == "backward"
    assert r.persistent == 0
    assert "CUDA caching allocator" in r.method["peak"]
    assert _sums_to_total(r.peak_breakdown) and r.peak_breakdown.total == r.peak


# --- the command on the embedded model -----------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    """torch.optim.AdamW vs fusedopt (fused=False, fused=True) on the tiny embedded LM, CPU. Records the
    jobs handed to a worker process (``workers``) and those measured in this process (``in_process``)."""
    from fusedopt.profile import run as profile_run

    out = tmp_path_factory.mktemp("profile")
    configs = ["torch.AdamW", fusedopt_default_config(), fusedopt_release_config()]
    argv = ["--model", "tiny", "--seq-len", "64", "--steps", "3", "--device", "cpu", "--threads", "1", "--quiet"]
    argv += ["--output-dir", str(out)]
    for c in configs:
        argv += ["--config", c]
    workers, in_process = [], []
    to_worker, measure = profile_run._run_in_subprocess, profile_run.measure_config

    def run_in_worker(job):
        workers.append(job["tag"])
        return to_worker(job)

    def measure_here(job):
        in_process.append(job["tag"])
        return measure(job)

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(profile_run, "_run_in_subprocess", run_in_worker)
        patch.setattr(profile_run, "measure_config", measure_here)
        rc = main(argv)
    with open(out / "results.json") as f:
        data = json.load(f)
    labels = [parse_config(c).label for c in configs]
    return {
        "rc": rc,
        "stdout": stdout.getvalue(),
        "data": data,
        "configs": configs,
        "labels": labels,
        "out": out,
        "workers": workers,
        "in_process": in_process,
    }


def test_command_runs_and_prints_table(embedded_run):
    assert embedded_run["rc"] == 0, embedded_run["stdout"]
    text = embedded_run["stdout"]
    for label in embedded_run["labels"]:
        assert label in text
    assert "Breakdown of each peak" in text and "How each figure was measured" in text
    assert "fusedopt-profile plan" in text  # the run ends with a pointer to the recommendation
    # --steps 3 on CPU: warm-up, tracked and allocator steps, none left to time; the table says why
    assert "step ms '-': --steps 3 left no step for it" in text
    results = embedded_run["data"]["results"]
    assert embedded_run["data"]["settings"]["dtype"] == "bf16"  # the default, on CPU too
    # master-weight splitting shows: fusedopt's default keeps a correction per bf16 parameter
    assert results[1]["memory"]["persistent_breakdown"]["categories"]["corrections"] > 0
    plot = embedded_run["out"] / "memory.png"
    try:
        import matplotlib  # noqa: F401

        assert plot.exists() and plot.stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in text
    results = embedded_run["data"]["results"]
    assert all(r["ok"] for r in results)
    # each ran in its own process: every configuration's job went to a worker process, none ran here
    assert embedded_run["in_process"] == []
    assert len(embedded_run["workers"]) == len(embedded_run["labels"])
    assert all(label in tag for tag, label in zip(embedded_run["workers"], embedded_run["labels"]))
    assert embedded_run["data"]["settings"]["isolation"] == "fresh process per configuration"


def test_plot_is_optional(embedded_run, monkeypatch, tmp_path):
    report = fusedopt.profile.ProfileReport(embedded_run["data"]["settings"], embedded_run["data"]["results"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    why = report.plot(str(tmp_path / "memory.png"))
    assert "matplotlib is not installed" in why and not (tmp_path / "memory.png").exists()
    assert "Breakdown of each peak" in report.table()


def test_categories_sum_to_total(embedded_run):
    for r in embedded_run["data"]["results"]:
        m = r["memory"]
        assert _sums_to_total(m["peak_breakdown"]) and m["peak_breakdown"]["total"] == m["peak"]
        assert _sums_to_total(m["persistent_breakdown"]) and m["persistent_breakdown"]["total"] == m["persistent"]
        assert all(sum(s[3:9]) == s[2] for s in m["timeline"])
        assert m["peak"] == max(s[2] for s in m["timeline"])


def test_fusedopt_peak_below_torch_adamw(embedded_run):
    torch_r, unfused, fused = embedded_run["data"]["results"]

    def without_reference_temporaries(r):
        # on CPU fusedopt runs its PyTorch reference update, whose fp32 temporaries the GPU kernel
        # does not make; against torch's bf16 state they outweigh the bytes the formats save
        m = r["memory"]
        return m["peak"] - m["peak_breakdown"]["rest_parts"]["update_temporaries"]

    assert without_reference_temporaries(unfused) < without_reference_temporaries(torch_r)
    assert fused["memory"]["peak"] < unfused["memory"]["peak"]
    assert unfused["memory"]["persistent"] < torch_r["memory"]["persistent"]


def test_release_saves_about_one_set_of_gradients(embedded_run):
    _, unfused, fused = embedded_run["data"]["results"]
    grads = unfused["param_bytes"]  # gradients: one per parameter, as large as the parameters
    saved = unfused["memory"]["peak"] - fused["memory"]["peak"]
    # Not exactly one set: the two peaks fall at different moments (fused=False at the end of
    # backward or in the update, fused=True early in backward with a few gradients in flight).
    assert 0.5 * grads <= saved <= 1.25 * grads, (saved, grads)
    assert fused["memory"]["peak_phase"] != "update"
    assert fused["memory"]["peak_breakdown"]["categories"]["gradients"] < 0.25 * grads
    assert unfused["memory"]["peak_breakdown"]["categories"]["gradients"] > 0.9 * grads


def test_persistent_memory_is_weights_and_state(embedded_run):
    for r in embedded_run["data"]["results"]:
        cats = r["memory"]["persistent_breakdown"]["categories"]
        assert cats["parameters"] == r["param_bytes"]
        assert cats["optimizer_state"] + cats["corrections"] == r["state_bytes"] + r["correction_bytes"]
        assert cats["gradients"] == 0 and cats["activations"] == 0


def test_cpu_figures_are_labelled_and_consistent(embedded_run):
    for r in embedded_run["data"]["results"]:
        m = r["memory"]
        assert "tensor accounting" in m["method"]["peak"] and "RSS" in m["method"]["rss"]
        # the allocator counts every tensor byte, plus scratch inside ops (a separate, identical step)
        assert m["persistent"] + r["allocator_pass"]["peak"] >= 0.97 * m["peak"]
        assert m["rss"]["peak"] >= m["rss"]["before"]


def test_planner_uses_measured_figures(embedded_run):
    results = embedded_run["data"]["results"]
    labels = embedded_run["configs"]
    spec = ModelSpec.from_args("tiny", None, None)
    rows = plan(None, 1.0, labels, model=spec, dtype="bf16", batch=1, seq_len=64, measurements=results)
    for row, r in zip(rows, results):
        assert row.per_param.source.startswith("measured")
        assert row.activation_source == "measured"
        assert row.peak == pytest.approx(r["memory"]["peak"], rel=1e-6, abs=64)
        assert row.fits is True
    # a bigger model: measured per-parameter costs, estimated activations
    rows = plan(None, 16.0, labels, model="1b", dtype="bf16", measurements=results)
    assert all(r.per_param.source.startswith("measured") and r.activation_source == "estimate" for r in rows)


# --- the planner without measurements --------------------------------------------------------------


def test_gradients_release_holds_count_as_gradients(monkeypatch, device):
    """Gradients that release holds for a bucketed update (p.grad is None by then) are gradients."""
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "1000")  # hold every gradient until the end of backward
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(3)]).to(device, torch.bfloat16)
    opt = fusedopt.AdamW(model.parameters(), lr=1e-3, fused=True, min_compress_numel=0)
    x = torch.randn(1, 64, device=device, dtype=torch.bfloat16)
    model(x).float().sum().backward()  # the first updates run at once: prepared launches from here
    opt.step()
    held = []
    hold = opt._release.on_gradient

    def on_gradient(p):  # what release holds once each hook has run
        hold(p)
        held.append(sum(g.numel() * g.element_size() for g in opt._release.held_gradients()))

    tracker = MemoryTracker(model, opt)
    tracker.register_inputs(x)
    with tracker:
        monkeypatch.setattr(opt._release, "on_gradient", on_gradient)
        with tracker.phase("backward"):
            model(x).float().sum().backward()
        opt.step()
    assert held == [8192, 16384, 24576]  # all three held until the end of backward
    # sampled at the next op: after the second hook (the third's is flushed before another op)
    gradients = CATEGORIES.index("gradients")
    assert max(s[3 + gradients] for s in tracker.result().timeline) >= held[1]


def test_plan_from_byte_model_and_layout(capsys):
    rows = plan(7_000_000_000, 24.0, ["torch.AdamW", "fusedopt.AdamW:fused=True"], dtype="bf16")
    torch_row, fo_row = rows
    assert torch_row.per_param.source.startswith("byte model") and torch_row.per_param.at_peak == 8.0
    assert torch_row.description == "torch AdamW, pure bf16"
    # a bare parameter count: activations estimated with the shape of the preset nearest in size
    assert torch_row.activation_source.startswith("estimate for the 7b preset") and torch_row.activations > 0
    assert torch_row.fits is False
    assert fo_row.per_param.grads_at_peak == 0 and fo_row.per_param.persistent < torch_row.per_param.persistent
    # release may hold the bucket budget to launch updates in buckets, plus the gradient that reaches it,
    # which exists whole before its hook frees it: at most the largest parameter's (the 7b preset's
    # embedding and LM head, 32000 x 4096, in bf16)
    assert fo_row.grads == bucket_budget() + 2 * 32000 * 4096
    assert main(["plan", "--model", "1b", "--gpu-memory", "16", "--config", "torch", "--config", "fusedopt"]) == 0
    text = capsys.readouterr().out
    assert "1,100,048,384 parameters" in text and "fits" in text and "GiB, estimate" in text


def test_plan_counts_what_release_holds(monkeypatch):
    configs = ["fusedopt.AdamW:fused=True", "fusedopt.AdamW:fused=True,accumulation_steps=4", "fusedopt.AdamW"]
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "64")
    held, accumulating, unfused = plan(7_000_000_000, 24.0, configs, dtype="bf16")
    largest = 2 * 32000 * 4096  # the 7b preset's largest gradient (embedding, LM head), bf16
    assert held.grads == 64 * 2**20 + largest
    assert accumulating.grads == unfused.grads == 2 * 7_000_000_000  # accumulation buffers: every gradient
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "0")  # no bucket: one gradient at a time, until its hook frees it
    assert plan(7_000_000_000, 24.0, configs[:1], dtype="bf16")[0].grads == largest
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "64")
    assert plan(1000, 24.0, configs[:1], dtype="bf16")[0].grads == 2000  # never more than one full set


def test_presets_and_shapes():
    assert PRESETS["1b"].num_params() == 1_100_048_384  # the TinyLlama shape of the H200 anchors
    shape = parse_shape("layers=2,d_model=64,heads=4")
    assert (shape.ffn, shape.kv_heads, shape.vocab) == (256, 4, 32000)
    assert parse_shape("layers=3", PRESETS["tiny"]).layers == 3
    config = parse_config("fusedopt:fused=True,betas=(0.9, 0.95),master_weight_bits=None")
    assert config == OptimizerConfig(
        "fusedopt.AdamW", {"fused": True, "betas": (0.9, 0.95), "master_weight_bits": None}
    )


@pytest.mark.parametrize(
    "text",
    ["layers=x,d_model=64,heads=4", "layers=2,d_model=64", "layers=2,d_model=65,heads=4", "depth=2", "layers=-1"],
)
def test_malformed_shapes_are_refused(text):
    with pytest.raises(UserError, match="malformed shape"):
        parse_shape(text)


# --- bad input: a message and exit code 2, never a traceback ----------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "huge"], "unknown model preset 'huge'"),
        (["--shape", "layers=2,d_model=64"], "malformed shape"),
        (["--model", "tiny", "--config", "adam9"], "unknown optimizer"),
        (["--model", "tiny", "--config", "fusedopt:state_bits=7"], "Invalid state_bits"),
        (["--model", "tiny", "--config", "fusedopt:fused"], "malformed --config"),
        (["--model", "tiny", "--dtype", "int8"], "unknown dtype"),
        (["--shape", "layers=1000,d_model=65536,heads=64", "--device", "cpu"], "does not fit"),
        (["plan", "--gpu-memory", "24"], "give --params"),
        (["plan", "--params", "7e9", "--model", "1b", "--gpu-memory", "24"], "not both"),
        (["plan", "--params", "7e9", "--gpu-memory", "24", "--no-checkpointing"], "--no-checkpointing needs a model"),
        (["plan", "--model", "1b", "--gpu-memory", "24", "--vocab-pieces", "40000"], "more pieces than the vocabulary"),
        (["--model", "tiny", "--vocab-pieces", "300"], "more pieces than the vocabulary has rows (256)"),
        (["--model", "tiny", "--config", "fusedopt:fused=True,accumulation_steps=4"], "give --grad-accum instead"),
        (
            ["--model", "tiny", "--grad-accum", "4", "--config", "fusedopt:fused=True,accumulation_steps=2"],
            "sets accumulation_steps=2, but the run accumulates --grad-accum 4",
        ),
        (["--hf-config", "/nonexistent/config.json"], "config"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, message, capsys, tmp_path):
    rc = main(argv + ["--output-dir", str(tmp_path)] if argv[0] != "plan" else argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


PLAN_TINY = ["plan", "--model", "tiny", "--gpu-memory", "24"]


def _write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "make_argv, message",
    [
        # output paths that cannot be written: refused before anything is measured
        (lambda d: ["--model", "tiny", "--json", str(d)], "it is a directory"),
        (lambda d: ["--model", "tiny", "--json", str(d / _write(d / "f", "") / "x.json")], "cannot write the results"),
        (lambda d: ["--model", "tiny", "--plot", _write(d / "f", "") + "/m.png"], "cannot write the plot"),
        (lambda d: ["--model", "tiny", "--plot", str(d / "m.xyz")], "its extension names no image format"),
        # planner: configurations the profiler refuses, results files it cannot read
        (lambda d: [*PLAN_TINY, "--config", "fusedopt:state_bits=7"], "state_bits"),
        (
            lambda d: [*PLAN_TINY, "--results", _write(d / "r", '{"results": 5}')],
            "not a list of the profiler's results",
        ),
        (
            lambda d: [*PLAN_TINY, "--results", _write(d / "r", '{"results": [{"ok": true}]}')],
            "not a list of the profiler's results",
        ),
    ],
)
def test_bad_paths_configs_and_files_exit_2_before_measuring(make_argv, message, capsys, tmp_path):
    rc = main(make_argv(tmp_path))
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "config, message",
    [
        ('{"model_type": "vit", "hidden_size": 64}', "Hugging Face config"),  # not a causal LM
        (
            '{"model_type": "llama", "vocab_size": 256, "hidden_size": -64, "intermediate_size": 128, '
            '"num_hidden_layers": 1, "num_attention_heads": 4}',
            "cannot build a causal LM",
        ),
    ],
)
def test_hf_configs_that_build_no_causal_lm_exit_2(config, message, capsys, tmp_path):
    pytest.importorskip("transformers")
    assert main(["plan", "--hf-config", _write(tmp_path / "c.json", config), "--gpu-memory", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_gb_is_not_gib():
    assert _parse_gib("24") == _parse_gib("24GiB") == _parse_gib("24g") == 24.0
    assert _parse_gib("24GB") == pytest.approx(24e9 / 2**30)


def test_plan_counts_autocast_configurations_as_fp32_parameters(capsys):
    """torch.AdamW under autocast trains fp32 parameters (16 B/param with its state and gradients)."""
    argv = ["plan", "--model", "1b", "--gpu-memory", "24", "--config", "torch:autocast='bf16'", "--config", "torch"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    autocast = next(line for line in lines if line.startswith("torch AdamW, fp32 master + bf16 autocast "))
    pure = next(line for line in lines if line.startswith("torch AdamW, pure bf16 "))
    assert autocast.split()[7] == "16.00" and pure.split()[4] == "8.00"


def _plan_output(capsys, *argv) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_plan_recommends_what_fits_7b_in_24_gib(capsys):
    """The issue: 7e9 parameters in 24 GiB. Only 4-bit state (norm2-root4, then block4) without
    correction and with gradient release fits, with the full logits and with the chunked loss; the
    planner must say so, choose norm2-root4 with the full logits, and list nothing that does not fit."""
    rec = recommend(7_000_000_000, 24.0)
    norm2 = parse_config("fusedopt:state_format='norm2-root4',master_weight_bits=None,fused=True")
    block4 = parse_config("fusedopt:state_bits=4,master_weight_bits=None,fused=True")
    assert [(r.config, r.chunked_loss is not None) for r in rec.fitting] == [
        (norm2, False),
        (norm2, True),
        (block4, False),
        (block4, True),
    ]
    assert rec.choice is rec.fitting[0] and rec.choice.margin > 0 and rec.choice.activations > 0
    assert all(r.peak <= 24 * 2**30 for r in rec.fitting)
    text = _plan_output(capsys, "--params", "7e9", "--gpu-memory", "24")
    use = next(line for line in text.splitlines() if line.startswith("Use: "))
    assert "state_format='norm2-root4',master_weight_bits=None,fused=True" in use and "slower optimizer step" in use
    assert "vs the default: +0.27% at lr 2.5e-4" in text and "+0.48% (sd 0.48, 6 seeds)" in text  # measured quality
    listed = [line for line in text.splitlines() if line.startswith((" * ", "   fusedopt"))]
    assert len(listed) == 4
    # the baselines say what they are
    assert "torch AdamW, pure bf16" in text and "torch AdamW, fp32 master + bf16 autocast" in text


def test_plan_recommends_the_default_where_it_fits(capsys):
    rec = recommend(7_000_000_000, 80.0)
    assert rec.choice.config == parse_config("fusedopt:state_bits=8,master_weight_bits=24")
    fitting = [r.config for r in rec.fitting]
    # in order of preference: the default before every leaner format that fits, norm2-root4 before block4
    assert (
        fitting.index(rec.choice.config)
        < fitting.index(parse_config("fusedopt:state_bits=8,master_weight_bits=None"))
        < fitting.index(parse_config("fusedopt:state_format='norm2-root4',master_weight_bits=24"))
        < fitting.index(parse_config("fusedopt:state_format='norm2-root4',master_weight_bits=None"))
        < fitting.index(parse_config("fusedopt:state_bits=4,master_weight_bits=24"))
        < fitting.index(parse_config("fusedopt:state_bits=4,master_weight_bits=None"))
    )
    text = _plan_output(capsys, "--params", "7e9", "--gpu-memory", "80")
    assert 'Use: fusedopt AdamW, 8-bit state, 24-bit master (default) (--config "fusedopt:state_bits=8' in text


def test_plan_with_nothing_that_fits_says_so(capsys):
    rec = recommend(70_000_000_000, 8.0)
    assert rec.choice is None and rec.fitting == []
    assert "No fusedopt AdamW configuration fits" in _plan_output(capsys, "--params", "70e9", "--gpu-memory", "8")


def test_plan_says_when_results_of_another_dtype_are_not_used(embedded_run, capsys):
    """The embedded run measured bf16 parameters; an fp32 plan cannot use them and must say so."""
    path = str(embedded_run["out"] / "results.json")
    text = _plan_output(capsys, "--model", "tiny", "--gpu-memory", "1", "--dtype", "fp32", "--results", path)
    assert "--results holds bf16 measurements and this plan is for fp32" in text
    text = _plan_output(capsys, "--params", "7e9", "--gpu-memory", "80", "--results", path, "--config", "torch")
    assert "measured on cpu with" in text and "scaled to 7,000,000,000" in text


def test_plan_help_and_output_cite_no_missing_document(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert "--batch" in help_text and "micro-batch size for the activation estimate" in help_text
    assert "tokens per sequence for the activation estimate" in help_text
    text = _plan_output(capsys, "--params", "7e9", "--gpu-memory", "24")
    for output in (help_text, text):
        assert "DESIGN" not in output


def test_a_diverging_run_writes_strict_json_and_warns(capsys, tmp_path):
    """A loss that overflows is a warning on stderr, and results.json stays JSON (no NaN tokens)."""
    out = tmp_path / "r.json"
    argv = ["--model", "tiny", "--seq-len", "16", "--steps", "3", "--no-plot", "--in-process", "--quiet"]
    assert main(argv + ["--config", "torch.SGD:lr=1e38", "--json", str(out), "--no-allocator-pass"]) == 0
    assert "non-finite loss" in capsys.readouterr().err
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in results.json"))


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--batch", "two"], ["--seq-len", "-5"], ["plan", "--params", "x"]])
def test_impossible_numbers_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv + (["--gpu-memory", "8"] if argv[0] == "plan" else []))
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_console_entry_point_without_traceback():
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "fusedopt.profile", "--model", "nope"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2
    assert "unknown model preset 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_unimplemented_configuration_is_reported_not_fatal(monkeypatch):
    def not_yet(self):
        return "not implemented yet: state_bits=3"

    monkeypatch.setattr(OptimizerConfig, "check", not_yet)
    report = fusedopt.profile.run_profile("tiny", ["fusedopt"], device="cpu", seq_len=16, steps=1, progress=False)
    assert report.results[0]["error_kind"] == "not_implemented"
    assert "not implemented yet" in report.table()


# --- Hugging Face configs (optional) -----------------------------------------------------------------


def test_the_closing_pointer_runs_as_printed_for_the_default_model(tmp_path, capsys):
    """A run without a model flag profiled the default model: the planner command names its size."""
    from fusedopt.profile.cli import _run_parser, plan_hint

    args = _run_parser().parse_args([])
    hint = plan_hint(args, 1771648, str(tmp_path / "results.json"))
    assert "(or plan --params 1771648 --gpu-memory GIB" in hint
    command = hint.split("(or ")[1].rstrip(")").replace("GIB", "24").split()
    with open(tmp_path / "results.json", "w") as f:
        json.dump({"results": []}, f)
    assert main(command) == 0
    assert "Use:" in capsys.readouterr().out


def test_a_worker_process_gets_the_checkout_on_its_path_only_where_this_one_does(monkeypatch):
    """The checkout's kernels/ on a worker's path would hide the `kernels` package transformers imports
    (profiling an --hf-config model failed in every worker); an installed fusedopt needs no path."""
    from fusedopt.profile.run import worker_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(fusedopt.__file__)))
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != root])
    assert worker_env()["PYTHONPATH"] == "elsewhere"
    monkeypatch.setattr(sys, "path", [root, *sys.path])
    assert worker_env()["PYTHONPATH"].split(os.pathsep) == [root, "elsewhere"]


def test_hf_config_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    config.save_pretrained(tmp_path / "model")
    argv = ["--hf-config", str(tmp_path / "model"), "--seq-len", "32", "--steps", "2", "--device", "cpu"]
    argv += ["--threads", "1", "--quiet", "--in-process", "--no-plot", "--output-dir", str(tmp_path)]
    argv += ["--config", fusedopt_release_config()]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    with open(tmp_path / "results.json") as f:
        (result,) = json.load(f)["results"]
    assert result["ok"] and result["num_params"] == sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
    )
    assert main(["--hf-config", str(tmp_path / "model"), "--seq-len", "4096", "--output-dir", str(tmp_path)]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_embedded_model_on_cuda():
    """On the GPU (Triton kernel, no reference temporaries) release saves close to one set of gradients."""
    configs = ["torch.AdamW", fusedopt_default_config(), fusedopt_release_config()]
    # The 1.1B TinyLlama shape at micro-batch 1 x 1024 with checkpointing: gradients outweigh the
    # loss head's transient. (At 125M parameters the loss head's buffers set the peak and release
    # saves nothing, as the H200 anchors found for large micro-batches.)
    report = fusedopt.profile.run_profile(
        "1b", configs, device="cuda", dtype="bf16", seq_len=1024, steps=4, progress=False
    )
    torch_r, unfused, fused = report.results
    assert all(r["ok"] for r in report.results), report.table()
    for r in report.results:
        m = r["memory"]
        assert "CUDA caching allocator" in m["method"]["peak"]
        assert _sums_to_total(m["peak_breakdown"]) and m["peak_breakdown"]["total"] == m["peak"]
        # tensor accounting sees (nearly) everything the allocator holds at the peak
        assert m["peak_breakdown"]["rest_parts"]["untracked"] < 0.1 * m["peak"]
    assert unfused["memory"]["peak"] < torch_r["memory"]["peak"]
    grads = unfused["param_bytes"]
    saved = unfused["memory"]["peak"] - fused["memory"]["peak"]
    assert 0.6 * grads <= saved <= 1.1 * grads, report.table()


# --- the planner: labels, Hugging Face shapes, unknown activations -----------------------------------


def test_plan_rows_name_their_state_format(capsys):
    """A state_format (which wins over state_bits) is named in the row, never hidden behind the default's
    words; the recommendation speaks of a configuration in the table's words."""
    configs = [
        "fusedopt:fused=True",
        "fusedopt:fused=True,state_format='norm2-root4'",
        "fusedopt:fused=True,state_format='block4'",
        "fusedopt:state_bits=4,state_format='block8'",
        "fusedopt:state_format='block4'",
    ]
    rows = plan(None, 24.0, configs, model="1b")
    assert [r.description for r in rows] == [
        "fusedopt AdamW, 8-bit state, 24-bit master, fused=True",
        "fusedopt AdamW, norm2-root4 state, 24-bit master, fused=True, slower optimizer step",
        "fusedopt AdamW, block4 state, 24-bit master, fused=True",
        "fusedopt AdamW, block8 state, 24-bit master",  # named by its format, not by the overridden bits
        "fusedopt AdamW, block4 state, 24-bit master",  # not the default: its other options are
    ]
    assert len({r.per_param.at_peak for r in rows[:3]}) == 3  # three formats, three costs
    adafactor = ["fusedopt.Adafactor:beta1=0.9", "fusedopt.Adafactor:beta1=0.9,state_format='block4'"]
    block8, block4 = plan(None, 24.0, adafactor, model="1b")
    assert "block4" not in block8.description and "state_format='block4'" in block4.description
    assert block4.per_param.state < block8.per_param.state
    text = _plan_output(capsys, "--model", "1b", "--gpu-memory", "24", "--config", "fusedopt")
    name = "fusedopt AdamW, 8-bit state, 24-bit master (default)"
    assert any(line.startswith(name + " ") for line in text.splitlines())  # the table's row
    assert f"Use: {name} (" in text and f" * {name} " in text  # the recommendation's lines


def _without_header(text: str) -> list[str]:
    return text.splitlines()[1:]  # the first line names the model as it was given


def test_plan_estimates_a_llama_hf_config_like_its_shape(capsys):
    """benchmarks/tinyllama_1b.json is the 1b preset's shape: the same plan, number for number."""
    pytest.importorskip("transformers")
    configs = [
        "--config",
        "fusedopt:fused=True",
        "--config",
        "fusedopt:fused=True,state_bits=4,master_weight_bits=None",
    ]
    hf_config = os.path.join(REPO, "benchmarks", "tinyllama_1b.json")
    from_hf = _plan_output(capsys, "--hf-config", hf_config, "--gpu-memory", "24", *configs)
    shape = "vocab=32000,d_model=2048,layers=22,heads=32,kv_heads=4,ffn=5632"
    from_shape = _plan_output(capsys, "--shape", shape, "--gpu-memory", "24", *configs)
    assert _without_header(from_hf) == _without_header(from_shape)
    # 0.59 GiB: checkpointed block inputs and one block (0.22) + the full logits, 12 bytes per logit (0.37)
    assert "activations: 0.59 GiB, estimate\n" in from_hf and "n/a" not in from_hf and "?" not in from_hf
    assert "Use: fusedopt AdamW, 8-bit state, 24-bit master (default)" in from_hf


def _llama_fields(**extra) -> str:
    fields = dict(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
    )
    return json.dumps({**fields, **extra})


@pytest.mark.parametrize(
    "config, source",
    [
        ('{"model_type": "mistral", ' + _llama_fields()[1:], "estimate"),
        (
            '{"model_type": "qwen3", ' + _llama_fields(head_dim=64)[1:],
            "estimate (from its Llama-style fields; a qwen3 block may differ from a Llama one)",
        ),
        (
            '{"model_type": "qwen3", ' + _llama_fields(head_dim=128)[1:],
            "not included: {path} gives no shape to estimate them from; it has head_dim=128, "
            "not hidden_size / num_attention_heads = 64",
        ),
        (
            '{"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 1000}',
            "not included: {path} gives no shape to estimate them from; it is not a Llama-style config "
            "(no num_key_value_heads, intermediate_size)",
        ),
    ],
)
def test_plan_says_how_an_hf_config_gives_activations(config, source, tmp_path, capsys):
    pytest.importorskip("transformers")
    path = _write(tmp_path / "config.json", config)
    rows = plan(None, 24.0, ["fusedopt"], model=ModelSpec.from_args(None, None, path))
    assert rows[0].activation_source == source.format(path=path)
    assert (rows[0].activations is None) == source.startswith("not included")
    text = _plan_output(capsys, "--hf-config", path, "--gpu-memory", "24", "--config", "fusedopt")
    if rows[0].activations is None:
        assert f"activations: {source.format(path=path)}\n" in text
    else:
        assert f"activations: {rows[0].activations / 2**30:.2f} GiB, {source}\n" in text


def test_plan_without_activations_ranks_what_fits_before_them(tmp_path, capsys):
    """No activation figure: the planner must not say that nothing fits when formats fit on their
    other bytes; it says that the verdict needs activations, how to give them, and ranks those formats."""
    pytest.importorskip("transformers")
    path = _write(tmp_path / "gpt2.json", '{"model_type": "gpt2", "n_embd": 512, "n_layer": 4, "n_head": 8}')
    spec = ModelSpec.from_args(None, None, path)
    memory = 0.24  # GiB: the leaner formats fit before activations, the default does not
    rec = recommend(None, memory, model=spec)
    assert rec.choice is None and rec.fitting == []
    undecided = rec.undecided
    assert 0 < len(undecided) < len(rec.rows)
    assert all((r.fits is None) == (r.peak <= memory * 2**30) for r in rec.rows) and not any(r.fits for r in rec.rows)
    choice = rec.choice_if_activations_fit
    assert choice in undecided and choice.config == parse_config("fusedopt:state_bits=8,master_weight_bits=None")
    text = _plan_output(capsys, "--hf-config", path, "--gpu-memory", str(memory))
    assert "No fusedopt AdamW configuration fits" not in text
    assert "depends on the activations, which are not known" in text and "--activations GIB" in text
    listed = [line for line in text.splitlines() if line.startswith((" * ", "   fusedopt"))]
    assert len(listed) == len(undecided) and all("+ GiB  room " in line for line in listed)
    assert f"If the activations fit in {choice.margin / 2**30:.2f} GiB, use: {choice.description} (" in text
    # activations given: the verdict follows from the room each format leaves
    room = choice.margin / 2**30
    settled = recommend(None, memory, model=spec, activations_gib=room * 0.99)
    assert settled.choice.config == choice.config and settled.undecided == []
    # bytes alone over the memory: nothing fits, and the figure says it is before activations
    text = _plan_output(capsys, "--hf-config", path, "--gpu-memory", "0.05")
    assert "No fusedopt AdamW configuration fits in 0.05 GiB" in text and "GiB before activations" in text


def test_recommendation_with_some_activations_unknown_says_so():
    """A measured row fits while others lack activations: the choice is among those that fit, and
    the output says that more formats might."""
    from fusedopt.profile.planner import Recommendation, format_recommendation

    rows = recommend(7_000_000_000, 80.0).rows
    unknown = [r for r in rows if r.config != rows[-1].config]
    for r in unknown:
        r.activations, r.fits = None, None
    text = format_recommendation(Recommendation(rows, rows[-1]), memory_bytes=80 * 2**30)
    assert f"Use: {rows[-1].description} (" in text
    assert f"({len(unknown)} more formats fit on their other bytes; their activations are not known)" in text


def test_cli_stops_quietly_when_its_reader_goes_away():
    """`fusedopt-profile plan ... | head -1`: a closed pipe ends the command without a traceback."""
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    proc = subprocess.run(
        [sys.executable, "-m", "fusedopt.profile", "plan", "--params", "1e9", "--gpu-memory", "24"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr
