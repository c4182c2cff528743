#!/usr/bin/env bash
# The GPU tests in two tiers, fast then long, within one device call (tests/gpu/README.md).
# From the repository root on the GPU machine:
#   bash tests/gpu/run_tiers.sh [PATH...]        (default PATH: tests/gpu)
# Logs: $OUT/gpu_fast.log, $OUT/gpu_long.log (OUT defaults to out/), each ending with its summary and
# the tests that took a second or more. Settings:
#   TIERS         "fast long" (default), "fast" or "long"
#   FAST_TIMEOUT  seconds the fast tier may take (default 330)
#   BUDGET        seconds for the whole script, install included (default 560: a 600 s call, less a
#                 margin); the long tier gets what is left of it
#   SKIP_INSTALL  set: the package is installed already (benchmarks/run_h200_session.sh)
# A tier that runs out of time is interrupted (SIGINT): pytest still writes what passed and where it stopped.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1  # output written before an interruption is kept
BUDGET=${BUDGET:-560}
paths=("${@:-tests/gpu}")

[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee "$OUT/gpu.txt"
# without a visible GPU every test would skip, and the tiers would pass
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/gpu.txt"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'" || exit 1

status=0
for tier in ${TIERS:-fast long}; do
  left=$((BUDGET - SECONDS)) limit=$((BUDGET - SECONDS))
  case $tier in
    fast) expr="gpu and not gpu_long"; [ "$limit" -gt "${FAST_TIMEOUT:-330}" ] && limit=${FAST_TIMEOUT:-330} ;;
    long) expr="gpu_long" ;;
    *) echo "unknown tier: $tier (fast or long)"; exit 2 ;;
  esac
  log="$OUT/gpu_$tier.log"
  if [ "$left" -lt 30 ]; then
    echo "$tier tier not run: ${left}s left of BUDGET=${BUDGET}" | tee "$log"
    status=1
    continue
  fi
  echo "== $tier tier: pytest -m \"$expr\" ${paths[*]} (timeout ${limit}s)"
  start=$SECONDS
  timeout -s INT -k 20 "$limit" python3 -m pytest -q -p no:cacheprovider -m "$expr" \
    --durations=0 --durations-min=1 "${paths[@]}" > "$log" 2>&1
  rc=$?
  tail -n 8 "$log"
  case $rc in
    0) echo "== $tier tier: passed in $((SECONDS - start))s" ;;
    124 | 137) echo "== $tier tier: cut by its ${limit}s timeout (see $log)"; status=1 ;;
    *) echo "== $tier tier: pytest exit code $rc after $((SECONDS - start))s (see $log)"; status=1 ;;
  esac
done
exit $status
