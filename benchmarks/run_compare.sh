#!/usr/bin/env bash
# Issue 6 head-to-head benchmarks, one device call per part. From the repo root on the GPU machine,
# with the competitor wheels carried in benchmarks/wheels/ (bash benchmarks/fetch_wheels.sh here):
#   bash benchmarks/run_compare.sh PART          (results, plots and logs under $OUT)
# parts (estimated H200 time of one call; a part stops starting work at BUDGET_S=450 s and the
# next call of the same part resumes where it stopped):
#   1a  memory + step time, 1.1B TinyLlama shape, checkpointing, micro-batch 1 x 1024, 18 configs
#       in fresh processes (~20 s each + JIT/compile: torchao ~30 s, FlashOptim/TurboAdam ~10 s)  ~8 min
#   1b  the same at batch 4 x 1024 without checkpointing                               ~8 min
#       (part 3, end-to-end step time, is the step-time table of 1a and 1b)
#   2   optimizer step over 1.07e9 elements against a copy, 12 configs                 ~3 min
#   4   training quality: 18 runs of 2000 steps of a 26M byte-level model, 8 at a time
#       (~1-2 min a run, torchao ~4 min)                                                ~8 min, maybe 2 calls
#   5a  largest trainable depth in 24 GiB: 13 optimizers x ~6 trials of ~4 s           ~8 min, maybe 2 calls
#   5b  the same in 80 GiB (~10 s a trial at ~15-25B parameters)                        2 calls
#   Altogether about 55-60 min of device time; by value: 1a, 2, 4, then 1b, 5a, 5b.
# Resuming: a part whose results file exists in $PREV (default out/prev/, ignored by git: put an
# earlier call's NAME.json there) continues from it (run standalone,
# the script leaves $OUT as one archive, results.tgz: the device tool returns at most 8 files).
# ONLY=A,FO,...  narrows a part to some line-up keys; EXTRA='...' adds arguments to its script.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PREV=${PREV:-out/prev}
BUDGET_S=${BUDGET_S:-450}
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: installed already (benchmarks/run_pair.sh)
  python3 -m pip install -q --no-deps --no-index benchmarks/wheels/*.whl > "$OUT/install.log" 2>&1 \
    || echo "competitor wheels not (all) installed: see $OUT/install.log; those competitors are reported as skipped"
  python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  git log -1 --format='commit %H %cd' 2>/dev/null
  python3 benchmarks/competitors.py
} 2>&1 | tee "$OUT/env.txt"

resume() {  # resume NAME: start $OUT/NAME.json from the committed one, if any
  if [ -f "$PREV/$1.json" ] && [ ! -f "$OUT/$1.json" ]; then cp "$PREV/$1.json" "$OUT/$1.json"; fi
}
only=${ONLY:+--only $ONLY}
for part in "$@"; do
  case $part in
    1a|1b)
      resume "memory_${part:1}"
      python3 benchmarks/compare_memory.py --regime "${part:1}" $only --budget-s "$BUDGET_S" \
        --out "$OUT/memory_${part:1}.json" ${EXTRA:-} 2>&1 | tee "$OUT/memory_${part:1}.log" | grep -v '^  \[' ;;
    2)
      python3 benchmarks/compare_step.py $only --out "$OUT/step.json" ${EXTRA:-} 2>&1 | tee "$OUT/step.log" ;;
    4)
      resume quality
      python3 benchmarks/compare_quality.py $only --parallel ${PARALLEL:-8} --budget-s "$BUDGET_S" \
        --out "$OUT/quality.json" ${EXTRA:-} 2>&1 | tee "$OUT/quality.log" ;;
    5a|5b)
      resume fit
      budget=$([ "$part" = 5a ] && echo 24 || echo 80)
      python3 benchmarks/compare_fit.py --budgets "$budget" $only --budget-s "$BUDGET_S" --out "$OUT/fit.json" \
        ${EXTRA:-} 2>&1 | tee "$OUT/fit_$part.log" ;;
    *) echo "unknown part: $part (1a 1b 2 4 5a 5b)"; exit 2 ;;
  esac
done
# standalone on the GPU machine: logs plus one archive (run_pair.sh archives per GPU itself)
[ -n "${SKIP_INSTALL:-}" ] || bash benchmarks/pack_out.sh "$OUT"
