#!/usr/bin/env bash
# One device call: install, GPU tests (kernel parity, end to end), then the step benchmark.
# Run from the repo root on the GPU machine: bash benchmarks/run_h200.sh  (logs under $OUT)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_kernels.py tests/gpu} -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 benchmarks/step_bandwidth.py --out "$OUT/step_bandwidth.json" 2>&1 | tee "$OUT/step_bandwidth.log"
