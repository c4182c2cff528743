#!/usr/bin/env bash
# One device call (10 minutes) for the state-format and Adafactor measurements, run from the repo
# root on the GPU machine with benchmarks/wheels/turboadam-*.whl (and any other competitor wheel) carried:
#   bash benchmarks/run_h200_session.sh          (everything lands in $OUT/results.tgz)
# 1. alone on the GPU: kernel_ablation.py's variants when ABLATION is set, then, when AB is set (its step
#    times are compared), benchmarks/step_ab.py --formats $AB;
# 2. then side by side, each lane bounded by `timeout` so the archive is always written:
#    quality (format_quality.py --jobs, one process per lane of $LANES: seeds and configurations),
#    GPU tests ($TESTS, filtered by -k $TESTS_K if set), peak memory of the 1.1B step ($MEM), and the 7B
#    fine-tunes under the 24 GiB cap ($FITS; their step times are taken while the GPU is shared).
# Defaults are this file's last call; every list can be overridden from the environment.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/r"
R=$OUT/r
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
python3 -m pip install -q --no-deps benchmarks/wheels/*.whl >> "$R/install.log" 2>&1  # the carried ones
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$R/gpu.txt"
START=$SECONDS
left() { echo $(( ${DEADLINE:-360} - (SECONDS - START) )); }

ABLATION=${ABLATION-}  # kernel_ablation.py's variants of the $ABLATION_FORMAT step, alone on the GPU, before AB
[ -n "$ABLATION" ] && timeout -k 10 ${ABLATION_S:-200} python3 benchmarks/kernel_ablation.py --variants "$ABLATION" \
  --state-format "${ABLATION_FORMAT:-norm2-log4}" --out "$R/ablation.json" > "$R/ablation.log" 2>&1

AB=${AB-}
[ -n "$AB" ] && timeout -k 10 ${AB_S:-100} python3 benchmarks/step_ab.py --rounds ${AB_ROUNDS:-6} --reps 5 --formats $AB \
  ${AB_LINEUP:+--lineup $AB_LINEUP} --out "$R/step_ab.json" > "$R/step_ab.log" 2>&1

# lanes: "name|seeds|keys|jobs"; every lane starts from the runs of $QBASE (same settings), if given
LANES=${LANES:-"all|0,1|fp32,bf16-rtn,default,default~,norm2-log4,turboadam,adafactor-m4,block4,rot4,block4-nomaster|15"}
while IFS='|' read -r name seeds keys jobs; do
  [ -z "$name" ] && continue
  [ -n "${QBASE:-}" ] && cp "$QBASE" "$R/quality_$name.json"
  ( timeout -k 10 $(( $(left) - 15 )) python3 benchmarks/format_quality.py --jobs "$jobs" --seeds "$seeds" \
      --out "$R/quality_$name.json" --only "$keys" > "$R/quality_$name.log" 2>&1
    python3 benchmarks/format_quality.py --report-only --seeds "$seeds" --out "$R/quality_$name.json" --only "$keys" \
      > "$R/quality_${name}_report.txt" 2>&1 ) &
done <<< "$LANES"

TESTS=${TESTS-tests/gpu/test_state_formats_on_cuda.py tests/gpu/test_adafactor_cuda.py tests/gpu/test_gpu_parity.py tests/gpu/test_release_streams.py}
(
  for t in $TESTS; do
    [ "$(left)" -gt 40 ] || { echo "no time left" > "$R/test_$(basename "$t" .py).log"; continue; }
    timeout -k 10 $(( $(left) - 20 )) python3 -m pytest -q -s -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} "$t" \
      > "$R/test_$(basename "$t" .py).log" 2>&1
  done
) &

MEM=${MEM-}  # line-up keys for compare_memory (regime a); peaks are per process, so sharing the GPU leaves them as they are
[ -n "$MEM" ] && ( timeout -k 10 $(( $(left) - 15 )) python3 benchmarks/compare_memory.py --regime a --only "$MEM" \
  --out "$R/memory_a.json" > "$R/memory_a.log" 2>&1 ) &

FITS=${FITS-}
(
  for c in $FITS; do
    [ "$(left)" -gt 60 ] || continue
    timeout -k 10 $(( $(left) - 20 )) python3 benchmarks/fit_7b.py --config "$c" --steps ${FIT_STEPS:-200} --warmup 20 \
      --out "$R/fit_7b_$c.json" > "$R/fit_7b_$c.log" 2>&1
  done
) &
wait
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
echo "done in $((SECONDS - START)) s"
