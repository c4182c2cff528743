#!/usr/bin/env bash
# One device call (10 minutes) of benchmarks and GPU tests, from the repo root on the GPU machine, with the
# competitor wheels carried in benchmarks/wheels/ (bash benchmarks/fetch_wheels.sh, on a machine with network):
#   STEP="--formats norm2-root4" MEM=FOR,FONR4R TIERS=fast bash benchmarks/run_h200_session.sh
# Everything lands in $OUT/results.tgz (the device tool returns few files); the console gets the tables.
# Nothing runs unless asked for:
# 1. alone on the GPU, one after another (their step times are compared):
#    STEP="ARGS"      benchmarks/step_speed.py ARGS (e.g. "--formats norm2-root4 --lineup H E4 --rounds 6")
#    CLIPSTEP="ARGS"  benchmarks/clipping_step.py ARGS ("" for its defaults: set CLIPSTEP= to run it)
#    RELEASE="ARGS"   benchmarks/release_overhead.py ARGS (e.g. '--only "default, fused" --batch 16')
#    FSDP="ARGS"      torchrun --nproc-per-node ${NPROC:-1} benchmarks/fsdp_step.py ARGS
# 2. then side by side until the deadline (DEADLINE seconds after the start, default 540), each bounded by
#    `timeout` so that the archive is always written:
#    LANES="name|seeds|keys|jobs[|study]" lines: benchmarks/quality.py, one process per lane (QBASE: a
#                     results file every lane starts from, e.g. an earlier call's, same settings)
#    TIERS="fast" or "fast long"  tests/gpu/run_tiers.sh by tier (TESTS: its paths, default tests/gpu)
#    MEM=KEYS         benchmarks/compare_memory.py --regime ${MEM_REGIME:-a} (peaks are per process: sharing
#                     the GPU leaves them as they are; its step times are not comparable)
#    DEPTH=GIB[,GIB]  benchmarks/compare_fit.py --budgets (DEPTH_ONLY=KEYS)
#    FITS="CONFIG..." benchmarks/fit_7b.py --config CONFIG under its 24 GiB cap (step times taken while shared)
#    EXAMPLES=1       the two examples at their GPU size
#    QUALITY_ARGS, MEM_ARGS, DEPTH_ARGS: more arguments for those scripts (e.g. QUALITY_ARGS="--budget-s 400")
# Two jobs on a 2-GPU machine: run this script twice, CUDA_VISIBLE_DEVICES=0 and =1, each with its own OUT.
set -uo pipefail
OUT=${OUT:-out}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
ls benchmarks/wheels/*.whl > /dev/null 2>&1 \
  && python3 -m pip install -q --no-deps --no-index benchmarks/wheels/*.whl >> "$R/install.log" 2>&1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %H %cd' 2>/dev/null
  python3 benchmarks/harness.py lineup
} > "$R/env.txt" 2>&1
head -3 "$R/env.txt"
START=$SECONDS
left() { echo $(( ${DEADLINE:-540} - (SECONDS - START) )); }
alone() {  # alone NAME COMMAND: one benchmark alone on the GPU (COMMAND as a shell would read it), its tables shown
  local name=$1
  [ "$(left)" -gt 60 ] || { echo "== $name: not run, $(left) s left"; return; }
  eval "timeout -k 10 $(( $(left) - 30 )) $2" > "$R/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -E "^\||/ " "$R/$name.log" | head -40
}
[ -n "${STEP+x}" ] && alone step_speed "python3 benchmarks/step_speed.py $STEP --out $R/step_speed.json"
[ -n "${CLIPSTEP+x}" ] && alone clipping_step "python3 benchmarks/clipping_step.py $CLIPSTEP --out $R/clipping_step.json"
[ -n "${RELEASE+x}" ] && alone release_overhead "python3 benchmarks/release_overhead.py $RELEASE --out $R/release.json"
[ -n "${FSDP+x}" ] && alone fsdp_step "torchrun --nproc-per-node ${NPROC:-1} benchmarks/fsdp_step.py $FSDP --out $R/fsdp.json"

while IFS='|' read -r name seeds keys jobs study; do
  [ -z "$name" ] && continue
  [ -n "${QBASE:-}" ] && cp "$QBASE" "$R/quality_$name.json"
  ( timeout -k 10 $(( $(left) - 15 )) python3 benchmarks/quality.py --study "${study:-formats}" --jobs "$jobs" \
      --seeds "$seeds" --only "$keys" --out "$R/quality_$name.json" ${QUALITY_ARGS:-} > "$R/quality_$name.log" 2>&1
    python3 benchmarks/quality.py --study "${study:-formats}" --report-only --seeds "$seeds" \
      --out "$R/quality_$name.json" > "$R/quality_${name}_report.txt" 2>&1 ) &
done <<< "${LANES:-}"

if [ -n "${TIERS:-}" ]; then
  # shellcheck disable=SC2086
  ( SKIP_INSTALL=1 OUT=$R BUDGET=$(( $(left) - 20 )) TIERS=$TIERS bash tests/gpu/run_tiers.sh ${TESTS:-} \
      > "$R/tiers.log" 2>&1 ) &
fi

[ -n "${MEM:-}" ] && ( timeout -k 10 $(( $(left) - 15 )) python3 benchmarks/compare_memory.py \
  --regime "${MEM_REGIME:-a}" --only "$MEM" --out "$R/memory.json" ${MEM_ARGS:-} > "$R/memory.log" 2>&1 ) &

[ -n "${DEPTH:-}" ] && ( timeout -k 10 $(( $(left) - 15 )) python3 benchmarks/compare_fit.py --budgets "$DEPTH" \
  ${DEPTH_ONLY:+--only $DEPTH_ONLY} --budget-s $(( $(left) - 60 )) --out "$R/fit.json" ${DEPTH_ARGS:-} \
  > "$R/fit.log" 2>&1 ) &

if [ -n "${FITS:-}" ]; then
  (
    for c in $FITS; do
      [ "$(left)" -gt 60 ] || continue
      timeout -k 10 $(( $(left) - 20 )) python3 benchmarks/fit_7b.py --config "$c" --steps "${FIT_STEPS:-200}" \
        --warmup 20 --out "$R/fit_7b_$c.json" > "$R/fit_7b_$c.log" 2>&1
    done
  ) &
fi

if [ -n "${EXAMPLES:-}" ]; then
  (
    timeout -k 10 120 python3 examples/finetune_lowvram.py --steps "${EXAMPLE_STEPS:-60}" --out /tmp/ex_lowvram \
      --summary-json "$R/example_lowvram.json" > "$R/example_lowvram.log" 2>&1
    timeout -k 10 120 python3 examples/finetune_hf.py --steps "${EXAMPLE_STEPS:-60}" > "$R/example_hf.log" 2>&1
  ) &
fi
wait
[ -f "$R/tiers.log" ] && { echo "== tests/gpu by tier"; grep -E "^== " "$R/tiers.log" || tail -3 "$R/tiers.log"; }
for f in "$R"/quality_*_report.txt; do [ -f "$f" ] && { echo "== $(basename "$f")"; grep -E "^\|" "$f"; }; done
[ -f "$R/memory.log" ] && { echo "== memory"; grep -E "^\|" "$R/memory.log" | head -30; }
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
echo "done in $((SECONDS - START)) s: $OUT/results.tgz"
