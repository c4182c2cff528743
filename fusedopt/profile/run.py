"""The profiler's run: each optimizer configuration trains the same model in a fresh process
(:func:`run_profile`); one step of each is tracked (:func:`profile_step`, ``memory.py``) and the
figures come back as a :class:`ProfileReport` (table and plot: ``report.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import psutil
import torch

from fusedopt.profile.competitors import correction_keys
from fusedopt.profile.configs import DEFAULT_CONFIGS, AutocastLM, OptimizerConfig, parse_config
from fusedopt.profile.memory import MemoryTracker, RssReader, StepMemory, cpu_allocator_trace, state_storages
from fusedopt.profile.models import ModelSpec, UserError, dtype_name, parse_dtype, random_batch
from fusedopt.profile.planner import GIB, activation_estimate, byte_model
from fusedopt.profile.report import format_table, plot_timelines

# --- one configuration (runs in the worker process) -----------------------------------------------


def train_step(model, optimizer, batches, phase, *, scale: float = 1.0):
    """forward + backward per micro-batch, then ``step()`` and ``zero_grad()``; returns the last loss."""
    value = None
    for input_ids, labels in batches:
        with phase("forward"):
            loss = model(input_ids, labels)
            if scale != 1.0:
                loss = loss * scale
        with phase("backward"):
            loss.backward()
            value = loss.detach()
            del loss
    with phase("update"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return value


def _no_phase(name):
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(
    model, optimizer, batches, *, device=None, baseline: int = 0, timeline: bool = True, opaque_update: bool = False
) -> StepMemory:
    """Track one training step of ``model`` with ``optimizer`` over ``batches`` (in this process).

    ``batches`` is a list of ``(input_ids, labels)``; ``model(input_ids, labels)`` must return
    the loss. Call it after a warm-up step or two, so the optimizer state exists.
    """
    tracker = MemoryTracker(
        model, optimizer, device=device, baseline=baseline, timeline=timeline, opaque_update=opaque_update
    )
    tracker.register_inputs(*(t for b in batches for t in b))
    with tracker:
        train_step(model, optimizer, batches, tracker.phase, scale=1.0 / len(batches))
    return tracker.result()


def _progress(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def _fits_check(job: dict, spec: ModelSpec, config: OptimizerConfig, device: torch.device, dtype) -> str | None:
    """A message if the analytic estimate of this configuration exceeds the device's memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        capacity, what = free, f"{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB on {device}"
    else:
        capacity = psutil.virtual_memory().available
        what = f"{capacity / GIB:.1f} GiB of RAM available"
    n = job["num_params"]
    per = byte_model(config.optimizer, config.kwargs, dtype)
    shape = spec.activation_shape()[0]
    act = activation_estimate(
        shape,
        batch=job["batch"],
        seq_len=job["seq_len"],
        dtype=dtype,
        checkpointing=spec.checkpointing,
        chunked_loss=spec.chunked_loss,
    )
    need = per.at_peak * n + (act or 0)
    if need > capacity:
        return (
            f"does not fit: {n:,} parameters need about {need / GIB:.1f} GiB with {config.label} "
            f"(byte model: {per.at_peak:.1f} B/param + activations), {what}"
        )
    return None


def measure_config(job: dict) -> dict:
    """Build the model, run ``job['steps']`` training steps with one configuration, return figures."""
    spec = ModelSpec.from_dict(job["model"])
    config = OptimizerConfig(**job["config"])
    device = torch.device(job["device"])
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = config.param_dtype(parse_dtype(job["dtype"]))
    verbose = job.get("progress", True)
    tag = job.get("tag", config.label)
    out = {
        "label": config.label,
        "config": config.to_dict(),
        "device": str(device),
        "dtype": dtype_name(dtype),
        "autocast": config.autocast,
        "release": config.release,
        "model": job["model_desc"],
        "model_key": job["model_key"],
        "batch": job["batch"],
        "seq_len": job["seq_len"],
        "grad_accum": job["grad_accum"],
        "num_params": job["num_params"],
        "ok": False,
    }
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    torch.manual_seed(job.get("seed", 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    baseline = 0
    if device.type == "cuda":
        # Create the cuBLAS workspaces before the baseline so they are not charged to the step.
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
        del a
        _sync(device)
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated(device)
    out["baseline_bytes"] = baseline
    message = _fits_check(job, spec, config, device, dtype)
    if message:
        out.update(error=message, error_kind="does_not_fit")
        return out
    rss = RssReader()
    out["rss_before_model"] = rss.current()
    try:
        model = spec.build(device, dtype)
        if config.autocast:
            model = AutocastLM(model, parse_dtype(config.autocast))
        model.train()
        try:
            opt = config.build(model.parameters(), job["grad_accum"], model=model, device_type=device.type)
        except NotImplementedError as exc:
            out.update(error=f"not implemented yet: {exc}", error_kind="not_implemented")
            return out
        out["num_params"] = sum(p.numel() for p in model.parameters())
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        vocab = job["vocab"]
        gen = torch.Generator(device=device)
        steps, k = job["steps"], job["grad_accum"]
        warmup = min(2 if device.type == "cuda" else 1, steps - 1)
        tracked_at = warmup
        alloc_at = tracked_at + 1 if device.type == "cpu" and job.get("allocator_pass", True) else None
        times, losses = [], []
        memory = allocator = None
        t_start = time.perf_counter()
        for i in range(steps):
            gen.manual_seed(1000 + i)
            batches = [random_batch(vocab, job["batch"], job["seq_len"], device, gen) for _ in range(k)]
            what = {tracked_at: "tracked", alloc_at: "allocator pass"}.get(i, "warm-up" if i < warmup else "timed")
            _progress(verbose, f"  [{tag}] step {i + 1}/{steps} ({what}), {time.perf_counter() - t_start:.1f}s")
            if i == tracked_at:
                memory = profile_step(
                    model,
                    opt,
                    batches,
                    device=device,
                    baseline=baseline,
                    timeline=job["timeline"],
                    opaque_update=config.competitor is not None and config.competitor.compiles,
                )
                loss = None
            elif i == alloc_at:
                allocator = cpu_allocator_trace(
                    lambda phase, batches=batches: train_step(model, opt, batches, phase, scale=1.0 / k)
                )
                loss = None
            else:
                _sync(device)
                t0 = time.perf_counter()
                loss = train_step(model, opt, batches, _no_phase, scale=1.0 / k)
                _sync(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            if loss is not None:
                losses.append(float(loss))
        state_bytes = corr_bytes = 0
        for key, nbytes in state_storages(opt, device):
            if key.startswith(correction_keys()):
                corr_bytes += nbytes
            else:
                state_bytes += nbytes
        out.update(
            ok=True,
            memory=memory.to_dict(),
            allocator_pass=allocator,
            step_ms=times,
            median_step_ms=statistics.median(times) if times else None,
            losses=losses,
            state_bytes=state_bytes,
            correction_bytes=corr_bytes,
            rss_after=rss.current(),
            seconds=time.perf_counter() - t_start,
        )
        if not all(math.isfinite(x) for x in losses):
            out["warning"] = "non-finite loss"
    except torch.OutOfMemoryError as exc:
        out.update(error=f"out of memory: {str(exc).splitlines()[0]}", error_kind="oom")
    except RuntimeError as exc:
        if "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower():
            out.update(error=f"out of memory: {str(exc).splitlines()[0]}", error_kind="oom")
        else:
            raise
    finally:
        rss.close()
    return out


def worker_main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = measure_config(job)
    except UserError as exc:
        result = {"label": job.get("tag"), "ok": False, "error": str(exc), "error_kind": "user"}
    except Exception as exc:  # reported in the table; the traceback goes to stderr for debugging
        traceback.print_exc()
        result = {"label": job.get("tag"), "ok": False, "error": f"{type(exc).__name__}: {exc}", "error_kind": "error"}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


def worker_env() -> dict:
    """The environment of a worker process: this one's, with the checkout's root first on PYTHONPATH only
    where this process finds fusedopt through it (not installed). Elsewhere the root on the path would let
    the checkout's kernels/ hide the `kernels` package transformers imports."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if any(os.path.abspath(entry or os.curdir) == root for entry in sys.path):
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run_in_subprocess(job: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="fusedopt-profile-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        cmd = [sys.executable, "-m", "fusedopt.profile", "--worker", job_path, result_path]
        proc = subprocess.run(cmd, env=worker_env(), stdout=subprocess.DEVNULL)
        if os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
        return {"label": job["tag"], "ok": False, "error": f"worker process died: {why}", "error_kind": "crash"}


# --- the whole profile ---------------------------------------------------------------------------


@dataclass
class ProfileReport:
    """Settings and per-configuration results of :func:`run_profile`."""

    settings: dict
    results: list[dict]

    def result(self, label: str) -> dict:
        return next(r for r in self.results if r["label"] == label)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "results": self.results}

    def table(self) -> str:
        return format_table(self)

    def plot(self, path: str) -> str | None:
        """Write the memory-over-time PNG; returns None, or why no plot was written."""
        return plot_timelines(self, path)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if not r.get("ok")]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_profile(
    model: ModelSpec | str | None = None,
    configs: list | tuple | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    batch: int = 1,
    seq_len: int | None = None,
    steps: int | None = None,
    grad_accum: int = 1,
    isolate: bool = True,
    timeline: bool = True,
    allocator_pass: bool = True,
    progress: bool = True,
    threads: int | None = None,
) -> ProfileReport:
    """Profile each optimizer configuration on the same model; see the module docstring.

    ``model`` is a :class:`ModelSpec` or a preset name (default: the embedded LM, ``small`` on
    CPU, ``1b`` on CUDA). ``configs`` are :class:`OptimizerConfig`s or ``--config`` strings
    (default :data:`DEFAULT_CONFIGS`). ``isolate=True`` runs each configuration in a fresh
    Python process; ``False`` runs them here, one after the other (CUDA figures stay clean
    through the allocator's own accounting, but CPU RSS figures then carry over).
    """
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("device cuda requested but CUDA is not available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"unsupported device {device!r} (cpu or cuda[:N])")
    if model is None:
        spec = ModelSpec.default(device=device)
    elif isinstance(model, str):
        spec = ModelSpec.from_args(model, None, None)
    else:
        spec = model
    torch_device = torch.device(device)
    dtype = dtype or "bf16"  # on CPU too: bf16 parameters are where master-weight corrections show
    torch_dtype = parse_dtype(dtype)
    seq_len = seq_len or (1024 if torch_device.type == "cuda" else 256)
    steps = steps or (8 if torch_device.type == "cuda" else 4)
    for name, value, low in (("batch size", batch, 1), ("sequence length", seq_len, 2), ("steps", steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"impossible {name}: {value!r} (must be an integer >= {low})")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise UserError(f"impossible gradient accumulation: {grad_accum!r} (must be an integer >= 1)")
    limit = spec.max_positions()
    if limit is not None and seq_len > limit:
        raise UserError(f"sequence length {seq_len} exceeds the model's max_position_embeddings ({limit})")
    configs = [parse_config(c) if isinstance(c, str) else c for c in (configs or DEFAULT_CONFIGS)]
    num_params = spec.num_params()
    vocab = spec.vocab_size()
    settings = {
        "model": spec.describe(),
        "model_spec": spec.to_dict(),
        "num_params": num_params,
        "device": device,
        "dtype": dtype_name(torch_dtype),
        "batch": batch,
        "seq_len": seq_len,
        "grad_accum": grad_accum,
        "steps": steps,
        "allocator_pass": allocator_pass,
        "isolation": "fresh process per configuration" if isolate else "in-process, one after another",
        "torch": torch.__version__,
    }
    # what cannot run here, and why; bad options raise UserError here
    missing = {config.label: config.unavailable(torch_device.type) or config.check() for config in configs}
    if torch_device.type == "cpu":
        available = psutil.virtual_memory().available
        shape = spec.activation_shape()[0]
        act = activation_estimate(
            shape,
            batch=batch,
            seq_len=seq_len,
            dtype=torch_dtype,
            checkpointing=spec.checkpointing,
            chunked_loss=spec.chunked_loss,
        )
        per = [byte_model(c.optimizer, c.kwargs, c.param_dtype(torch_dtype)).at_peak for c in configs]
        need = min(per) * num_params + (act or 0)
        if need > available:
            raise UserError(
                f"the model does not fit this device: {num_params:,} parameters need about {need / GIB:.1f} GiB "
                f"with the leanest configuration (byte model), {available / GIB:.1f} GiB of RAM available "
                "(try `fusedopt-profile plan`)"
            )
    results = []
    for index, config in enumerate(configs):
        tag = f"{index + 1}/{len(configs)} {config.label}"
        _progress(progress, f"[{tag}] starting")
        why = missing[config.label]
        if why:
            _progress(progress, f"[{tag}] skipped: {why}")
            results.append(
                {
                    "label": config.label,
                    "config": config.to_dict(),
                    "ok": False,
                    "error": why,
                    "error_kind": "unavailable" if config.unavailable(torch_device.type) else "not_implemented",
                }
            )
            continue
        job = {
            "model": spec.to_dict(),
            "model_desc": spec.describe(),
            "model_key": json.dumps(spec.to_dict(), sort_keys=True),
            "config": dataclasses.asdict(config),
            "device": device,
            "dtype": dtype,
            "batch": batch,
            "seq_len": seq_len,
            "steps": steps,
            "grad_accum": grad_accum,
            "vocab": vocab,
            "num_params": num_params,
            "timeline": timeline,
            "allocator_pass": allocator_pass,
            "progress": progress,
            "threads": threads,
            "tag": tag,
        }
        t0 = time.perf_counter()
        if isolate:
            result = _run_in_subprocess(job)
        else:
            if torch_device.type == "cuda":
                torch.cuda.empty_cache()
            result = measure_config(job)
        result["label"] = config.label  # (a worker's failure is labelled with its progress tag)
        state = "done" if result.get("ok") else f"failed: {result.get('error')}"
        _progress(progress, f"[{tag}] {state} ({time.perf_counter() - t0:.1f}s)")
        results.append(result)
    return ProfileReport(settings, results)
