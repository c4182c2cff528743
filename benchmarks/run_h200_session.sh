#!/usr/bin/env bash
# One device call (10 minutes) for the state-format and Adafactor measurements, run from the repo
# root on the GPU machine with benchmarks/wheels/turboadam-*.whl carried:
#   bash benchmarks/run_h200_session.sh          (everything lands in $OUT/results.tgz)
# 1. alone on the GPU when AB is set (its step times are compared): benchmarks/step_ab.py --formats $AB;
# 2. then side by side, each lane bounded by `timeout` so the archive is always written:
#    quality (format_quality.py --jobs: the format line-up over $SEEDS, and single-seed lr sweeps),
#    GPU tests ($TESTS), and the 7B fine-tunes under the 24 GiB cap ($FITS; their step times are taken
#    while the GPU is shared).
# Defaults are this file's last call; every list can be overridden from the environment.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/r"
R=$OUT/r
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
python3 -m pip install -q --no-deps benchmarks/wheels/turboadam-*.whl >> "$R/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$R/gpu.txt"
START=$SECONDS
left() { echo $(( ${DEADLINE:-560} - (SECONDS - START) )); }

AB=${AB:-}
[ -n "$AB" ] && timeout ${AB_S:-150} python3 benchmarks/step_ab.py --rounds ${AB_ROUNDS:-10} --reps 5 --formats $AB \
  --out "$R/step_ab.json" > "$R/step_ab.log" 2>&1

SEEDS=${SEEDS:-0,1,2,3}
QF=${QF:-fp32,bf16-rtn,default,default~,block4,block4-nomaster,rot4}
QS=${QS:-fp32@0.006,fp32@0.012,adafactor@0.01,adafactor@0.03,adafactor@0.1}
for f in ${QBASE:-}; do cp "$f" "$R/quality_formats.json"; done
timeout $(( $(left) - 15 )) python3 benchmarks/format_quality.py --jobs ${JF:-10} --seeds "$SEEDS" \
  --out "$R/quality_formats.json" --only "$QF" > "$R/quality_formats.log" 2>&1 &
[ -n "$QS" ] && timeout $(( $(left) - 15 )) python3 benchmarks/format_quality.py --jobs ${JS:-3} --seeds ${SSEEDS:-0} \
  --out "$R/quality_sweep.json" --only "$QS" > "$R/quality_sweep.log" 2>&1 &

TESTS=${TESTS:-tests/gpu/test_adafactor_cuda.py tests/gpu/test_rotated_on_cuda.py tests/gpu/test_plugins_on_cuda.py tests/gpu/test_recipes_cuda.py}
(
  for t in $TESTS; do
    timeout $(( $(left) - 20 )) python3 -m pytest -q -p no:cacheprovider "$t" > "$R/test_$(basename "$t" .py).log" 2>&1
  done
) &

FITS=${FITS:-block4-nomaster adafactor-m4}
(
  for c in $FITS; do
    timeout $(( $(left) - 20 )) python3 benchmarks/fit_7b.py --config "$c" --steps ${FIT_STEPS:-200} --warmup 20 \
      --out "$R/fit_7b_$c.json" > "$R/fit_7b_$c.log" 2>&1
  done
) &
wait
python3 benchmarks/format_quality.py --report-only --seeds "$SEEDS" --out "$R/quality_formats.json" --only "$QF" \
  > "$R/quality_formats_report.txt" 2>&1
[ -n "$QS" ] && python3 benchmarks/format_quality.py --report-only --seeds ${SSEEDS:-0} --out "$R/quality_sweep.json" \
  --only "$QS" > "$R/quality_sweep_report.txt" 2>&1
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
echo "done in $((SECONDS - START)) s"
