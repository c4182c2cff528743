"""Training quality with paired seeds: which optimizer configuration trains as well as which.

A byte-level Llama-shaped model (``fusedopt.profile.models.TinyLM``) is trained on Python's
standard-library source with each configuration (``harness.train_one``). For a seed, every
configuration starts from the same fp32 initialisation and sees the same batches in the same order;
only the optimizer differs. Reported per configuration: the held-out loss and, per seed, its
difference to the study's reference of the same seed (mean ± sd, paired t, whether it is worse or
better on every seed), beside the gap of the means that an unpaired comparison would see
(``harness.paired``). Pairing removes the seed-to-seed spread of the loss itself (initialisation and
data), which is larger than most of the effects measured; what is left is each configuration's
effect plus trajectory noise, which the control ``default~`` (the default with other
stochastic-rounding draws) measures.

Studies (``--study``; each sets the settings, the configurations and the reference; options override):

* ``formats`` (default): fusedopt's state formats against fp32 AdamW (``fp32``: ``state_bits=32,
  master_weight_bits=32``, which follows fp32 master weights and moments exactly), every
  configuration on bf16 parameters: 6 layers, d_model 512, ffn 1408, 1500 steps of 32 x 256 bytes,
  peak lr 1.5e-3 (100 warm-up steps, cosine to 0), weight decay 0.1, 4096 held-out windows. The lr
  is the best of a single-seed GPU sweep (1.5e-3 ended 19% below 3e-3; lower lrs untried), and the
  decay to 0 makes late updates small against a bf16 ulp, so rounding matters. Adafactor's keys take
  their own peak lr (``PEAK_LR``: torch's relative step) with AdamW's weight decay per step, and are
  also paired against fusedopt's default and fp32 Adafactor; ``KEY@LR`` runs a key at another peak
  lr (a sweep). The known-worse configurations must come out worse than fp32 beyond the noise.
* ``lineup``: other libraries' optimizers (the keys of ``fusedopt/profile/lineup.py``'s line-up,
  its shared hyperparameters) against torch AdamW with fp32 parameters and bf16 autocast (``A``):
  8 layers, d_model 512, ffn 1408, 2000 steps of 16 x 256 bytes, peak lr 1e-3, 256 held-out windows.
* ``clipping``: clipping under gradient release. ``exact`` (``fused=False``: the global norm in
  ``step()``) against each ``release_clipping`` method with ``fused=True`` and ``none`` (no
  clipping), ``max_grad_norm=1.0``, with and without loss spikes (1% of the steps after warm-up, the
  same for every configuration of a seed, have their loss multiplied by ``--spike-factor``): 4 layers,
  d_model 256, ffn 704, 800 steps of 16 x 256 bytes, peak lr 3e-3 (50 warm-up steps), 256 held-out
  windows; per-seed differences in loss, and the recovery after a spike.

Every key of every study can be run in any study (``--only fp32,default,H``). Hyperparameters:
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 for every AdamW-like configuration.

    python benchmarks/quality.py --quick                                   # CPU, formats, a few minutes
    python benchmarks/quality.py --jobs 8 --seeds 0,1,2 --out out/quality.json      # GPU, ~20 min on an H200
    python benchmarks/quality.py --report-only --out out/quality.json      # the tables of a results file
    python benchmarks/quality.py --study lineup --jobs 8 --out out/lineup.json
    python benchmarks/quality.py --study clipping --jobs 12 --out out/clipping.json  # GPU, ~3 min
    python benchmarks/quality.py --study clipping --quick --out /tmp/clipping.json   # CPU smoke test

Runs are appended to ``--out`` as they end and skipped when there already (same settings; a file of
other settings or another corpus is refused), so an interrupted run resumes; ``--jobs N`` trains N
runs at a time in fresh processes (the model is small: one run leaves an H200 mostly idle); each
run is alone in its process, so the results do not depend on N. ``--budget-s`` starts no run that
would end after that many seconds. ``--report-only`` also reads the results files of the scripts
this one replaced (``format_quality.py``, ``compare_quality.py``, ``clipping_quality.py``, in git
history at commit ``7d4d420``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from fusedopt.clipping import CLIP_METHODS  # noqa: E402

ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# Adafactor's update is max(eps2, RMS(p)) * min(lr, 1/sqrt(t)) times the clipped normalised gradient:
# its lr is not AdamW's, so its keys take their own peak lr (PEAK_LR, from single-seed sweeps on the
# GPU settings); weight_decay = ADAMW_DECAY / peak lr keeps the decay per step, lr * weight_decay * p,
# equal to the AdamW configurations' at the formats study's lr.
ADAMW_DECAY = 1.5e-3 * ADAMW["weight_decay"]

# key -> (profiler --config, label): the keys of the studies besides the line-up's
CONFIGS = {
    "fp32": ("fusedopt.AdamW:state_bits=32,master_weight_bits=32", "fp32 AdamW (fp32 master weights and moments)"),
    "bf16-rtn": ("torch.AdamW", "torch AdamW, pure bf16 (round to nearest)"),
    "default": ("fusedopt.AdamW", "fusedopt default (block8)"),
    "default~": ("fusedopt.AdamW:seed=1", "control: default, other rounding draws"),
    "nomaster": ("fusedopt.AdamW:master_weight_bits=None", "block8, no correction (bf16 + SR)"),
    "block4": ("fusedopt.AdamW:state_bits=4", "block4, 24-bit"),
    "block4-nomaster": ("fusedopt.AdamW:state_bits=4,master_weight_bits=None", "block4, no correction"),
    "norm2-root4": ("fusedopt.AdamW:state_format='norm2-root4'", "norm2-root4 (0.81 B/param), 24-bit"),
    "norm2-root4-nomaster": (
        "fusedopt.AdamW:state_format='norm2-root4',master_weight_bits=None",
        "norm2-root4, no correction",
    ),
    "norm2-root4-nomaster~": (  # the trajectory noise of a format whose draws change (not in the study)
        "fusedopt.AdamW:state_format='norm2-root4',master_weight_bits=None,seed=1",
        "control: norm2-root4, no correction, other rounding draws",
    ),
    "state16": (  # for A/B runs of its kernel (denominator_ab.sh KEYS), not in the study
        "fusedopt.AdamW:state_bits=16",
        "bf16 moments (state_bits=16), 24-bit",
    ),
    "turboadam": (
        "turboadam.TurboAdam",
        "TurboAdam 0.2.0 (its defaults: UState + 1Q, 0.81 B/param; bf16 parameters, no master)",
    ),
    "adafactor-fp32": (
        "fusedopt.Adafactor:beta1=None,state_bits=32,master_weight_bits=32",
        "Adafactor, no momentum, fp32 master weights (its own reference)",
    ),
    "adafactor": ("fusedopt.Adafactor:beta1=None", "Adafactor, no momentum, 24-bit master"),
    "adafactor-m32": (
        "fusedopt.Adafactor:beta1=0.9,state_bits=32,master_weight_bits=32",
        "Adafactor, fp32 momentum, fp32 master weights (the momentum configurations' reference)",
    ),
    "adafactor-m8": ("fusedopt.Adafactor:beta1=0.9", "Adafactor, 8-bit momentum, 24-bit master"),
    "adafactor-m4": ("fusedopt.Adafactor:beta1=0.9,state_bits=4", "Adafactor, 4-bit momentum, 24-bit master"),
    # the clipping study (max_grad_norm=1.0; fused=True with each release_clipping method)
    "exact": ("fusedopt.AdamW:max_grad_norm=1.0", "exact: fused=False, the global norm in step()"),
    **{
        m: (f"fusedopt.AdamW:fused=True,max_grad_norm=1.0,release_clipping='{m}'", f"fused=True, {m}")
        for m in CLIP_METHODS
    },
    "none": ("fusedopt.AdamW:fused=True,max_grad_norm=None", "fused=True, no clipping"),
}
FORMAT_KEYS = tuple(k for k in CONFIGS if k not in ("exact", "none", "norm2-root4-nomaster~", "state16", *CLIP_METHODS))
PEAK_LR = {"adafactor-fp32": 0.03, "adafactor": 0.03, "adafactor-m32": 0.03, "adafactor-m8": 0.03, "adafactor-m4": 0.03}
KNOWN_WORSE = ("bf16-rtn", "nomaster", "block4", "block4-nomaster")
# also paired against these (configuration -> references besides the study's) in the report
ALSO_AGAINST = {
    "adafactor-fp32": ("default",),
    "adafactor": ("default", "adafactor-fp32"),
    "adafactor-m32": ("default", "adafactor-fp32"),
    "adafactor-m8": ("default", "adafactor-fp32", "adafactor-m32"),
    "adafactor-m4": ("default", "adafactor-fp32", "adafactor-m32"),
    # the state formats' targets are stated against the 8-bit default
    **{key: ("default",) for key in FORMAT_KEYS if key not in ("fp32", "default") and not key.startswith("adafactor")},
}

_SETTINGS = ("shape", "steps", "warmup", "batch", "seq", "lr", "eval_seqs", "corpus_limit")
STUDIES = {
    "formats": dict(
        reference="fp32",
        only=FORMAT_KEYS,
        units="pct",
        gpu=dict(
            shape="vocab=256,d_model=512,layers=6,heads=8,kv_heads=8,ffn=1408",
            steps=1500, warmup=100, batch=32, seq=256, lr=1.5e-3, eval_seqs=4096, seeds="0,1,2", spikes="no",
            corpus_limit=None,
        ),
        quick=dict(
            shape="vocab=256,d_model=64,layers=1,heads=4,kv_heads=4,ffn=192",
            steps=400, warmup=40, batch=16, seq=64, lr=3e-3, eval_seqs=1024, seeds="0,1,2", spikes="no",
            corpus_limit=2_000_000, only="fp32,bf16-rtn,block4-nomaster,default~",
        ),
    ),
    "lineup": dict(
        reference="A",
        only=harness.PARTS["quality"],
        units="pct",
        gpu=dict(
            shape="vocab=256,d_model=512,layers=8,heads=8,kv_heads=8,ffn=1408",
            steps=2000, warmup=100, batch=16, seq=256, lr=1e-3, eval_seqs=256, seeds="0", spikes="no",
            corpus_limit=None,
        ),
        quick=dict(
            shape="vocab=256,d_model=64,layers=2,heads=2,kv_heads=2,ffn=192",
            steps=20, warmup=2, batch=4, seq=32, lr=1e-3, eval_seqs=16, seeds="0", spikes="no",
            corpus_limit=2_000_000, only="A,B,FO",
        ),
    ),
    "clipping": dict(
        reference="exact",
        only=("exact", *CLIP_METHODS, "none"),
        units="abs",
        gpu=dict(
            shape="vocab=256,d_model=256,layers=4,heads=4,kv_heads=4,ffn=704",
            steps=800, warmup=50, batch=16, seq=256, lr=3e-3, eval_seqs=256, seeds="0,1,2", spikes="no,yes",
            corpus_limit=None,
        ),
        quick=dict(
            shape="vocab=256,d_model=64,layers=2,heads=2,kv_heads=2,ffn=176",
            steps=160, warmup=10, batch=4, seq=32, lr=3e-3, eval_seqs=256, seeds="0,1,2", spikes="no,yes",
            corpus_limit=2_000_000,
        ),
    ),
}  # fmt: skip


def config_of(key: str, lr: float):
    """(label, OptimizerConfig, peak lr) of a run key: a key of :data:`CONFIGS` or of the line-up,
    or ``KEY@LR`` for that configuration at another peak lr. ``lr``: the peak lr of keys without
    their own (:data:`PEAK_LR`)."""
    from fusedopt.profile import parse_config
    from fusedopt.profile.lineup import BY_KEY, HPARAMS

    base, sep, value = key.partition("@")
    if base not in CONFIGS and base not in BY_KEY:
        raise ValueError(f"unknown configuration {base!r} (known: {', '.join([*CONFIGS, *BY_KEY])})")
    peak = PEAK_LR.get(base, lr)
    if sep:
        try:
            peak = float(value)
        except ValueError:
            raise ValueError(f"{key!r}: the peak lr after '@' must be a number, got {value!r}") from None
        if not (math.isfinite(peak) and peak > 0):
            raise ValueError(f"{key!r}: the peak lr after '@' must be positive and finite")
    if base in BY_KEY:
        entry = BY_KEY[base]
        return entry.label, entry.optimizer_config({**HPARAMS, "lr": peak}), peak
    text, label = CONFIGS[base]
    config = parse_config(text)
    if config.optimizer.endswith("Adafactor"):  # torch.optim.Adafactor's arguments: AdamW's decay per step
        own = dict(lr=peak, weight_decay=ADAMW_DECAY / peak)
    else:
        own = dict(lr=peak, **ADAMW)
    config.kwargs = {**own, **config.kwargs}
    return label, config, peak


def _peak_lr(key: str, lr: float) -> float | None:
    try:
        return config_of(key, lr)[2]
    except ValueError:  # a configuration this script no longer has
        return None


def run_config(key: str, seed: int, settings: dict):
    """``config_of`` for the run of ``key`` at ``seed``: with ``draw_seeds``, a fusedopt optimizer's seed
    becomes 1000 x ``seed`` + its own (0 unless given), so its rounding draws differ between seeds."""
    label, config, peak = config_of(key, settings["lr"])
    if settings.get("draw_seeds") and config.optimizer.startswith("fusedopt."):
        config.kwargs = {**config.kwargs, "seed": 1000 * seed + config.kwargs.get("seed", 0)}
    return label, config, peak


def run_one(key: str, seed: int, spiky: bool, settings: dict, device: str) -> dict:
    """One training run (``harness.train_one``) of configuration ``key``; a worker process's job."""
    torch.set_num_threads(1 if device == "cpu" else 2)  # small tensors; several runs share the host
    label, config, peak = run_config(key, seed, settings)
    autocast = config.autocast is not None

    def make(model):
        return config.build(model.parameters(), model=model, device_type=device)

    run = harness.train_one(make, seed, settings, device, spiky=spiky, autocast=autocast)
    return {"key": key, "label": label, "lr": peak, **run}


def normalised(runs) -> list[dict]:
    """Runs as a list of records with ``key`` and ``spiky``, whichever script wrote them (the
    results of compare_quality.py were a dict, those of clipping_quality.py named the key ``config``)."""
    runs = list(runs.values()) if isinstance(runs, dict) else list(runs)
    out = []
    for r in runs:
        key = r.get("key", r.get("config"))
        out.append({**r, "key": key, "label": r.get("label", key), "spiky": r.get("spiky", bool(r.get("spikes")))})
    return out


def also_against(runs: list[dict], seeds: list[int]) -> dict[str, list[dict]]:
    """reference -> the rows of the configurations :data:`ALSO_AGAINST` pairs with it (those that ran)."""
    keys = {r["key"] for r in runs}
    wanted = {}
    for key, refs in ALSO_AGAINST.items():
        for ref in refs:
            if ref in keys and any(k.partition("@")[0] == key for k in keys):
                wanted.setdefault(ref, set()).add(key)
    return {
        ref: [r for r in harness.paired(runs, ref, seeds) if r["key"].partition("@")[0] in these and r["diff_pct"]]
        for ref, these in wanted.items()
    }


def noise(rows: list[dict]) -> float | None:
    """rms over seeds of the control's (``default~``) difference to the default, in %, or None."""
    by_key = {r["key"]: r for r in rows}
    control = by_key.get("default~")
    if control is None or not control["diff_pct"]:
        return None
    base = by_key.get("default")
    if base is not None and len(base["diff_pct"]) == len(control["diff_pct"]):
        gaps = [a - b for a, b in zip(control["diff_pct"], base["diff_pct"])]
    else:
        gaps = control["diff_pct"]
    return math.sqrt(statistics.fmean(g * g for g in gaps))


def report(runs: list[dict], settings: dict, reference: str, seeds: list[int] | None, units: str = "pct") -> str:
    """The tables (one per condition: without and with spikes) and what they say about the noise."""
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in settings.items())]
    for spiky in sorted({bool(r.get("spiky")) for r in runs}):
        rows = harness.paired(runs, reference, seeds, spiky)
        lines += ["", "with loss spikes:" if spiky else "held-out loss:", harness.paired_table(rows, reference, units)]
        own = [r["key"] for r in rows if "@" in r["key"] or r["key"] in PEAK_LR]
        if own and "lr" in settings:
            peaks = ", ".join(f"{k} {config_of(k, settings['lr'])[2]:g}" for k in own)
            lines.append(f"own peak lr (the others: {settings['lr']:g}): {peaks}")
        ref = next((r for r in rows if r["key"] == reference), None)
        if ref and len(ref["loss"]) > 1:
            spread = 100 * (max(ref["loss"]) - min(ref["loss"])) / min(ref["loss"])
            lines.append(f"{reference}'s own seed-to-seed range: {spread:.2f}% (what unpaired comparisons face)")
        trajectory = noise(rows)
        if trajectory is not None:
            lines.append(
                f"trajectory noise: the same configuration with other rounding draws moves the loss by "
                f"{trajectory:.2f}% (rms over seeds of default~ against default, or against {reference})"
            )
        evals = [r["eval_se_pct"] for r in rows if "eval_se_pct" in r]
        if evals:
            lines.append(
                f"of which the held-out sample's part (eval±: standard error of a paired difference over the "
                f"{settings.get('eval_seqs')} held-out windows, rms over seeds): {min(evals):.3f}-{max(evals):.3f}%"
            )
        worse = [r for r in rows if r["key"] in KNOWN_WORSE]
        if worse:
            seen = [r for r in worse if r["diff_pct"] and min(r["diff_pct"]) > 0]  # worse on every seed run
            beyond = [r["key"] for r in seen if trajectory is None or r["mean_pct"] > 2 * trajectory]
            seen = [r["key"] for r in seen]
            lines.append(
                f"known-worse configurations worse than {reference} on every seed: {len(seen)} of {len(worse)} "
                f"({', '.join(seen)}); of those by more than twice the trajectory noise: {', '.join(beyond) or 'none'}"
            )
        for other, paired in (also_against([r for r in runs if bool(r.get("spiky")) == spiky], seeds) or {}).items():
            label = next(r["label"] for r in runs if r["key"] == other)
            lines += ["", f"paired against {other} ({label}):", harness.paired_table(paired, other, units)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--study", choices=sorted(STUDIES), default="formats")
    parser.add_argument("--quick", action="store_true", help="the study's small CPU settings")
    parser.add_argument("--only", help="comma-separated configuration keys (the reference always runs)")
    parser.add_argument("--seeds", help="comma-separated seeds")
    parser.add_argument("--spikes", help="no, yes or no,yes: runs without and/or with loss spikes")
    parser.add_argument("--spike-factor", type=float, default=1000.0)
    parser.add_argument("--shape", help="model shape, key=value overrides of the tiny preset")
    for name, kind in (("steps", int), ("warmup", int), ("batch", int), ("seq", int), ("lr", float)):
        parser.add_argument(f"--{name}", type=kind)
    parser.add_argument("--eval-seqs", type=int, help="held-out windows")
    parser.add_argument("--corpus-limit", type=int, help="use at most this many bytes of each split")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="results JSON: runs are appended, finished ones skipped")
    parser.add_argument("--jobs", "--parallel", type=int, default=1, help="runs at a time, one process each")
    parser.add_argument("--budget-s", type=float, help="start no run that would end after this many seconds")
    parser.add_argument("--report-only", "--report", action="store_true", help="report --out; train nothing")
    parser.add_argument(
        "--draw-seeds",
        action="store_true",
        help="fusedopt's rounding draws differ between seeds (optimizer seed 1000 x seed + its own): for "
        "comparisons of draws, which otherwise repeat in every seed",
    )
    args = parser.parse_args(argv)
    study = STUDIES[args.study]
    base = {**study["gpu"], **(study["quick"] if args.quick else {})}
    for name, value in base.items():
        if name != "seeds" and getattr(args, name, None) is None:
            setattr(args, name, value)
    reference = study["reference"]
    args.only = args.only or ",".join(study["only"])
    given_seeds, args.seeds = args.seeds, args.seeds or base["seeds"]
    seeds = [int(s) for s in str(args.seeds).split(",")]
    spikes = [{"no": False, "yes": True}[s.strip()] for s in args.spikes.split(",")]
    keys = [reference] + [k for k in dict.fromkeys(args.only.split(",")) if k and k != reference]
    for key in keys:
        try:
            config_of(key, args.lr)
        except ValueError as exc:
            parser.error(str(exc))
    settings = {k: getattr(args, k) for k in _SETTINGS}
    if args.draw_seeds:
        settings["draw_seeds"] = True
    if any(spikes):
        settings["spike_factor"] = args.spike_factor
    data = harness.load(args.out)
    if args.report_only:
        runs = normalised(data.get("runs", []))
        seeds = seeds if given_seeds else sorted({r["seed"] for r in runs})  # all of the file's, unless given
        print(report(runs, data.get("settings", settings), reference, seeds, study["units"]))
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _, _, digest = harness.corpus(args.corpus_limit)
    if data and (data.get("settings") != settings or data.get("corpus", digest) != digest):
        print(f"error: {args.out} holds runs of other settings or another corpus:", file=sys.stderr)
        print(f"  there: {data.get('settings')}, corpus {data.get('corpus')}", file=sys.stderr)
        print(f"  here:  {settings}, corpus {digest}", file=sys.stderr)
        return 2
    data = {"settings": settings, "corpus": digest, "env": harness.environment(), "runs": data.get("runs", [])}
    # a run at another peak lr than its configuration's now (PEAK_LR changed) is measured again
    data["runs"] = [r for r in normalised(data["runs"]) if r.get("lr", args.lr) == _peak_lr(r["key"], args.lr)]
    done = {(r["key"], r["seed"], bool(r["spiky"])) for r in data["runs"]}
    todo = []
    for seed in seeds:  # seed order: an interrupted run has whole seeds first
        for spiky in spikes:
            for key in keys:
                why = config_of(key, args.lr)[1].unavailable(device)
                if why:
                    print(f"{key}: skipped ({why})", flush=True)
                elif (key, seed, spiky) not in done:
                    todo.append((key, seed, spiky, settings, device))
    t_start = time.perf_counter()

    def record(job, run):
        if run is None:
            return
        data["runs"].append(run)
        harness.save(args.out, data)
        spiky = " with spikes" if run["spiky"] else ""
        line = f"{run['key']:<16} seed {run['seed']}{spiky}: held-out {run['final_eval']:.4f} ({run['wall_s']:.0f} s)"
        print(line, flush=True)

    harness.run_jobs(run_one, todo, args.jobs, record, args.budget_s)
    print(report(data["runs"], settings, reference, seeds, study["units"]))
    print(f"total {time.perf_counter() - t_start:.0f} s on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
