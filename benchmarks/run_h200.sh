#!/usr/bin/env bash
# One device call: install, GPU tests (kernel parity, end to end, profiler on CUDA), then the
# step benchmark and the release-overhead benchmark. From the repo root on the GPU machine:
#   bash benchmarks/run_h200.sh            (logs under $OUT; TESTS=... narrows the tests)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu tests/test_kernels.py} 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -25
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_profile.py 2>&1 | tee "$OUT/profile_gpu_tests.log" | tail -5
python3 benchmarks/step_bandwidth.py --out "$OUT/step_bandwidth.json" 2>&1 | tee "$OUT/step_bandwidth.log"
python3 benchmarks/release_overhead.py --out "$OUT/release_overhead.json" 2>&1 | tee "$OUT/release_overhead.log"
