#!/usr/bin/env bash
# One device call (10 minutes) for the FSDP2, Adafactor and state-format measurements, run from the
# repo root on the GPU machine with benchmarks/wheels/{flashoptim,turboadam}-*.whl carried:
#   bash benchmarks/run_h200_session.sh          (everything lands in $OUT/results.tgz)
# 1. alone on the GPU (its step times are compared): benchmarks/fsdp_step.py, world size 1;
# 2. then side by side, each lane bounded by `timeout` so the archive is always written:
#    quality (format_quality.py --jobs, two line-ups), GPU tests, and memory-only runs (compare_memory
#    peaks, fit_7b under the 24 GiB cap; their step times are taken while the GPU is shared).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/r"
R=$OUT/r
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
python3 -m pip install -q --no-deps benchmarks/wheels/flashoptim-*.whl benchmarks/wheels/turboadam-*.whl >> "$R/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$R/gpu.txt"
START=$SECONDS
left() { echo $(( ${DEADLINE:-550} - (SECONDS - START) )); }

timeout 150 torchrun --nproc-per-node 1 benchmarks/fsdp_step.py --steps 8 --out "$R/fsdp_step.json" > "$R/fsdp_step.log" 2>&1

base=benchmarks/results/format-quality/h200.json
cp "$base" "$R/quality_adafactor.json"; cp "$base" "$R/quality_formats.json"
timeout $(( $(left) - 15 )) python3 benchmarks/format_quality.py --jobs 8 --out "$R/quality_adafactor.json" \
  --only ${QA:-adafactor-fp32,adafactor,adafactor-m32,adafactor-m8,adafactor-m4} > "$R/quality_adafactor.log" 2>&1 &
timeout $(( $(left) - 15 )) python3 benchmarks/format_quality.py --jobs 7 --out "$R/quality_formats.json" \
  --only ${QF:-rot4,norm2-log4,norm4-log4,rot4-log4,turboadam} > "$R/quality_formats.log" 2>&1 &

(
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_adafactor_cuda.py > "$R/test_adafactor.log" 2>&1
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fsdp_cuda.py > "$R/test_fsdp.log" 2>&1
  timeout $(( $(left) - 20 )) python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_rotated_on_cuda.py \
    > "$R/test_rotated.log" 2>&1
) &

(
  timeout 210 python3 benchmarks/compare_memory.py --regime a --only ${MEM:-FOR,FO4R,AFR,AFM8R,AFM4R} --budget-s 200 \
    --out "$R/memory_adafactor.json" > "$R/memory_adafactor.log" 2>&1
  timeout 130 python3 benchmarks/fit_7b.py --config adafactor --steps 40 --warmup 4 --out "$R/fit_7b_adafactor.json" \
    > "$R/fit_7b_adafactor.log" 2>&1
  timeout $(( $(left) - 20 )) python3 benchmarks/fit_7b.py --config block4-nomaster --steps 40 --warmup 4 \
    --out "$R/fit_7b_block4_nomaster.json" > "$R/fit_7b_block4_nomaster.log" 2>&1
) &
wait
for q in adafactor formats; do
  python3 benchmarks/format_quality.py --report-only --out "$R/quality_$q.json" \
    --only "$( [ $q = adafactor ] && echo "${QA:-adafactor-fp32,adafactor,adafactor-m32,adafactor-m8,adafactor-m4}" \
      || echo "${QF:-rot4,norm2-log4,norm4-log4,rot4-log4,turboadam}" ),default" > "$R/quality_${q}_report.txt" 2>&1
done
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
echo "done in $((SECONDS - START)) s"
