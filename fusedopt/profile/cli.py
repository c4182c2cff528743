"""The command line of ``fusedopt-profile`` (``python -m fusedopt.profile``): its two parsers, the
profiler run and the planner (``plan``), and their exit codes. The work itself is
``run.run_profile`` and ``planner.plan``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from fusedopt.profile.configs import DEFAULT_CONFIGS, parse_config
from fusedopt.profile.models import PRESETS, ModelSpec, UserError, dtype_name, parse_dtype
from fusedopt.profile.planner import (
    BASELINE_CONFIGS,
    GIB,
    format_plan,
    format_recommendation,
    plan,
    recommend,
)
from fusedopt.profile.run import run_profile, worker_main


def _parse_count(text: str) -> int:
    """``7e9``, ``1.1B``, ``350M``, ``1,100,048,384`` -> int."""
    t = text.strip().replace(",", "").replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:].lower(), 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 7e9, 1.1B, 350M)") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}")
    return int(value)


def _parse_gib(text: str) -> float:
    """``24``, ``24GiB``, ``24G`` -> 24 GiB; ``24GB`` -> 24e9 bytes in GiB (22.35)."""
    t = text.strip().lower()
    scale = 1.0
    for suffix, unit in (("gib", 1.0), ("gb", 1e9 / 2**30), ("g", 1.0)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], unit
            break
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a memory size in GiB: {text!r} (e.g. 24, 80GiB, 24GB)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a memory size in GiB: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PRESET", help=f"model size preset: {', '.join(PRESETS)}")
    g.add_argument(
        "--shape",
        metavar="K=V,...",
        help="explicit shape of the embedded LM, e.g. layers=4,d_model=256,heads=4,kv_heads=4,ffn=1024,vocab=8192 "
        "(on top of --model when both are given)",
    )
    g.add_argument("--hf-config", metavar="PATH", help="a transformers config.json (or its directory); no download")
    g.add_argument("--no-checkpointing", action="store_true", help="keep all activations (no recomputation)")
    g.add_argument(
        "--chunked-loss",
        nargs="?",
        const=0,
        type=_positive_int,
        metavar="TOKENS",
        help="compute the loss with fusedopt.chunked_cross_entropy, TOKENS per chunk (default: about 2**24 logits "
        "per chunk), which never builds the full logits; without it the loss is the cross-entropy of the full logits",
    )
    g.add_argument(
        "--vocab-pieces",
        type=_positive_int,
        metavar="N",
        help="hold the embedding and the LM head as N row pieces each (fusedopt.split_rows), so that gradient "
        "release holds one piece's gradient at a time",
    )


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusedopt-profile",
        description="Measure the memory of real training steps per optimizer configuration "
        "(peak, persistent, breakdown, phase), print a table, write a plot and JSON. "
        "`fusedopt-profile plan --help` for the planner.",
    )
    _add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--dtype", help="parameter dtype: fp32, bf16, fp16 (default bf16)")
    g.add_argument("--batch", type=_positive_int, default=1, help="micro-batch size (default 1)")
    g.add_argument("--seq-len", type=_positive_int, help="tokens per sequence (default 1024 on CUDA, 256 on CPU)")
    g.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--steps", type=_positive_int, help="training steps per configuration (default 8 CUDA, 4 CPU)")
    g.add_argument(
        "--config",
        action="append",
        metavar="OPT[:k=v,...]",
        help="an optimizer configuration, repeatable: torch.AdamW, fusedopt.AdamW, fusedopt.SGD, fusedopt.Lion, "
        "torch.SGD with keyword arguments, e.g. 'fusedopt:fused=True,state_bits=16' "
        f"(default: {' '.join(DEFAULT_CONFIGS)})",
    )
    g.add_argument("--in-process", action="store_true", help="run configurations in this process (no isolation)")
    g.add_argument("--threads", type=_positive_int, help="CPU threads for torch in each run (default: torch's)")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="out/fusedopt-profile", help="where results.json and memory.png go")
    o.add_argument("--json", help="results JSON path (default OUTPUT_DIR/results.json)")
    o.add_argument("--plot", help="memory-over-time PNG path (default OUTPUT_DIR/memory.png)")
    o.add_argument("--no-plot", action="store_true", help="do not write the plot")
    o.add_argument("--no-allocator-pass", action="store_true", help="CPU: skip the torch.profiler allocator pass")
    o.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusedopt-profile plan",
        description="Which optimizer configurations fit in a GPU's memory, and which fusedopt AdamW "
        "configuration to use: the first that fits from the default format down, in order of preference (the "
        "8-bit formats, then norm2-root4, then 4-bit blocks; quality: held-out loss against fp32 AdamW from "
        "benchmarks/quality.py). "
        "Per-parameter bytes come from a profiler measurement (--results), else from the optimizer's state "
        "layout, else from fusedopt's byte model (the stored bytes of each state format); activations are "
        "estimated from the model shape at --batch x --seq-len (a Hugging Face config's, when Llama-style).",
    )
    p.add_argument("--params", type=_parse_count, help="parameter count, e.g. 7e9, 1.1B (or give a model)")
    p.add_argument("--gpu-memory", type=_parse_gib, required=True, metavar="GIB", help="memory size in GiB")
    _add_model_args(p)
    p.add_argument("--dtype", default="bf16", help="parameter dtype (default bf16)")
    p.add_argument(
        "--batch", type=_positive_int, default=1, help="micro-batch size for the activation estimate (default 1)"
    )
    p.add_argument(
        "--seq-len",
        type=_positive_int,
        default=1024,
        help="tokens per sequence for the activation estimate (default 1024)",
    )
    p.add_argument(
        "--config",
        action="append",
        metavar="OPT[:k=v,...]",
        help="a configuration to show in the table, as for the profiler (repeatable; default: torch AdamW "
        "with fp32 master + autocast, torch AdamW pure bf16, fusedopt's default with and without fused=True)",
    )
    p.add_argument("--results", help="results.json of a profiler run: use its measured figures")
    p.add_argument("--activations", type=_parse_gib, metavar="GIB", help="activation memory to assume, in GiB")
    return p


def _main_plan(argv) -> int:
    args = _plan_parser().parse_args(argv)
    spec = None
    if args.model or args.shape or args.hf_config:
        if args.params is not None:
            raise UserError("give --params N or a model (--model, --shape, --hf-config), not both")
        spec = ModelSpec.from_args(args.model, args.shape, args.hf_config, not args.no_checkpointing, args.chunked_loss)
        spec.with_vocab_pieces(args.vocab_pieces)  # checked against the model's vocabulary
    if spec is None and args.params is None:
        raise UserError("give --params N or a model (--model, --shape, --hf-config)")
    if spec is None and args.no_checkpointing:
        raise UserError(
            "--no-checkpointing needs a model (--model, --shape, --hf-config): with --params alone the activations "
            "are estimated for activation checkpointing"
        )
    measurements = None
    if args.results:
        try:
            with open(args.results) as f:
                measurements = json.load(f)["results"]
            if not isinstance(measurements, list) or not all(map(_is_result, measurements)):
                raise ValueError("its 'results' is not a list of the profiler's results")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"cannot read profiler results {args.results!r}: {exc}") from None
    configs = [parse_config(c) for c in (args.config or BASELINE_CONFIGS)]
    for config in configs:
        config.check()  # as the profiler does: an option the optimizer refuses is an error, not a row
    common = dict(
        model=spec,
        dtype=args.dtype,
        batch=args.batch,
        seq_len=args.seq_len,
        measurements=measurements,
        activations_gib=args.activations,
        chunked_loss=args.chunked_loss,
        vocab_pieces=args.vocab_pieces,
    )
    rows = plan(args.params, args.gpu_memory, configs, **common)
    rec = recommend(args.params, args.gpu_memory, **common)
    n = args.params or spec.num_params()
    dtype = dtype_name(parse_dtype(args.dtype))
    model = spec.describe() if spec else "a model"
    ckpt = "" if spec else ", activation checkpointing"
    if spec is None and args.chunked_loss is not None:
        ckpt += ", chunked loss"
    header = f"fusedopt plan: {model}, {dtype} parameters, micro-batch {args.batch} x {args.seq_len}{ckpt}"
    memory = int(args.gpu_memory * GIB)
    print(format_plan(rows, num_params=n, memory_bytes=memory, header=header))
    measured = sorted({r["dtype"] for r in measurements or () if r.get("ok")})
    if measured and measured != [dtype]:
        print(
            f"note: --results holds {'/'.join(measured)} measurements and this plan is for {dtype} parameters: "
            f"only {dtype} measurements are used (profile with --dtype {dtype} for measured figures)"
        )
    print()
    print(format_recommendation(rec, memory_bytes=memory))
    return 0


def _is_result(result) -> bool:
    """A profiler result the planner can read (a failed one is skipped there)."""
    if not isinstance(result, dict):
        return False
    if not result.get("ok"):
        return True
    needed = ("label", "dtype", "num_params", "memory", "device", "model", "model_key", "batch", "seq_len")
    try:
        return all(k in result for k in needed) and isinstance(result["memory"]["peak_breakdown"]["categories"], dict)
    except (KeyError, TypeError):
        return False


def plan_hint(args, num_params: int, json_path: str) -> str:
    """The run's closing pointer to the planner: two commands that run as printed (but for GIB)."""
    flags = (("model", args.model), ("shape", args.shape), ("hf-config", args.hf_config))
    model_args = "".join(f"--{flag} {value} " for flag, value in flags if value)
    model_args = model_args or f"--params {num_params} "  # the default model: no flag names it
    return (
        "which configuration fits your GPU, and which to use: "
        f"fusedopt-profile plan --params {num_params} --gpu-memory GIB"
        f" (or plan {model_args}--gpu-memory GIB --results {json_path})"
    )


def _check_accumulation(text: str, grad_accum: int) -> None:
    """A configuration's own accumulation_steps must be the run's --grad-accum: release updates on the
    accumulation_steps-th backward, the run steps after --grad-accum of them."""
    steps = parse_config(text).constructor_kwargs.get("accumulation_steps")
    if steps is not None and steps != grad_accum:
        raise UserError(
            f"--config {text!r} sets accumulation_steps={steps}, but the run accumulates --grad-accum {grad_accum} "
            "micro-batches per step: give --grad-accum instead (it sets accumulation_steps)"
        )


def _check_plot_format(path: str) -> None:
    """A plot path whose extension matplotlib writes (checked before anything is measured)."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    try:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = set(FigureCanvasBase.get_supported_filetypes())
    except ImportError:  # no plot will be drawn (report.plot says why)
        return
    if ext not in formats:
        known = ", ".join(sorted(formats))
        raise UserError(f"cannot write the plot {path!r}: its extension names no image format ({known})")


def _writable_file(path: str, what: str) -> str:
    """``path``'s folder created; a UserError now, not after the measurement, if it cannot be written."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write the {what} to {path!r}: {exc}") from None
    if os.path.isdir(path):
        raise UserError(f"cannot write the {what} to {path!r}: it is a directory")
    return path


def _finite(value):
    """``value`` with non-finite floats as None: JSON has no NaN (a diverged run's loss)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _main_run(argv) -> int:
    args = _run_parser().parse_args(argv)
    spec = ModelSpec.from_args(args.model, args.shape, args.hf_config, not args.no_checkpointing, args.chunked_loss)
    if args.model is None and args.shape is None and args.hf_config is None:
        spec = ModelSpec.default(not args.no_checkpointing, device=args.device)
        if args.chunked_loss is not None:
            spec = spec.with_chunked_loss(args.chunked_loss)
    spec = spec.with_vocab_pieces(args.vocab_pieces)
    for text in args.config or ():
        _check_accumulation(text, args.grad_accum)
    configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
    json_path = _writable_file(args.json or os.path.join(args.output_dir, "results.json"), "results")
    plot_path = args.plot or os.path.join(args.output_dir, "memory.png")
    plot_path = None if args.no_plot else _writable_file(plot_path, "plot")
    if plot_path is not None:
        _check_plot_format(plot_path)
    report = run_profile(
        spec,
        configs,
        device=args.device,
        dtype=args.dtype,
        batch=args.batch,
        seq_len=args.seq_len,
        steps=args.steps,
        grad_accum=args.grad_accum,
        isolate=not args.in_process,
        allocator_pass=not args.no_allocator_pass,
        progress=not args.quiet,
        threads=args.threads,
    )
    with open(json_path, "w") as f:  # before printing: a closed pipe must not lose the results
        json.dump(_finite(report.to_dict()), f, indent=1, allow_nan=False)
    print(report.table())
    for r in report.results:
        if r.get("warning"):
            print(f"warning: {r.get('label')}: {r['warning']}", file=sys.stderr)
    print(f"results: {json_path}")
    if plot_path is not None:
        why_not = report.plot(plot_path)
        print(f"plot: {plot_path}" if why_not is None else f"plot: not written ({why_not})")
    print(plan_hint(args, report.settings["num_params"], json_path))
    ok = [r for r in report.results if r.get("ok")]
    if not ok and report.results and all(r.get("error_kind") == "does_not_fit" for r in report.results):
        print("error: the model does not fit this device with any configuration", file=sys.stderr)
        return 2
    return 1 if report.failed else 0


def run_command(argv: list[str]) -> int:
    """``fusedopt-profile [plan] ARGS``: run it, print a user error as one line (exit code 2)."""
    try:
        if argv[:1] == ["plan"]:
            return _main_plan(argv[1:])
        return _main_run(argv)
    except UserError as exc:
        print(f"fusedopt-profile: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fusedopt-profile: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fusedopt-profile`` / ``python -m fusedopt.profile``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # one configuration, in the fresh process run_profile started
        return worker_main(argv[1], argv[2])
    try:
        return run_command(argv)
    except BrokenPipeError:
        # the reader went away (`fusedopt-profile plan ... | head`): stop quietly, as other tools do;
        # stdout goes to devnull so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
