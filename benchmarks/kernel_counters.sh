#!/usr/bin/env bash
# kernel_counters.py under Nsight Compute, one process per configuration, then its table (GPU machine, repo root):
#   [STALLS=1] [PIPES=1] bash benchmarks/kernel_counters.sh ["CONFIG" ...]      (results under $OUT, default out/)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
METRICS=gpu__time_duration.sum,smsp__thread_inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum
# STALLS=1: also issue-slot use, warps per scheduler and the stall reasons (kernel_counters.STALL_METRICS)
[ -n "${STALLS:-}" ] && METRICS=$METRICS,$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import kernel_counters as k; print(','.join(k.STALL_METRICS))")
# PIPES=1: also how busy each execution pipe was (kernel_counters.PIPE_METRICS, % of its peak over active cycles)
[ -n "${PIPES:-}" ] && METRICS=$METRICS,$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import kernel_counters as k; print(','.join(k.PIPE_METRICS))")
if [ $# -eq 0 ]; then
  mapfile -t configs < <(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import kernel_counters as k; print('\n'.join(k.CONFIGS))")
else
  configs=("$@")
fi
i=0
for c in "${configs[@]}"; do
  ncu --clock-control none --profile-from-start off --csv --metrics $METRICS \
    python3 benchmarks/kernel_counters.py --configs "$c" > "$OUT/counters_$i.csv" 2> "$OUT/counters_$i.err" \
    || { echo "ncu failed for $c:"; tail -5 "$OUT/counters_$i.err"; }
  i=$((i + 1))
done
python3 benchmarks/kernel_counters.py --summarize "$OUT"/counters_*.csv | tee "$OUT/counters.md"
