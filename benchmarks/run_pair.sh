#!/usr/bin/env bash
# Two jobs at once on a 2-GPU machine (device kind nvidia-h200-x2), one per GPU, each with its own
# $OUT/gpu0 or $OUT/gpu1. Installs the package and the competitor wheels once, first:
#   bash benchmarks/run_pair.sh "bash benchmarks/run_compare.sh 1a" "bash benchmarks/run_h200.sh release"
# The jobs share the host's CPUs: host-bound timings of one can be disturbed by the other.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/gpu0" "$OUT/gpu1"
{
  python3 -m pip install -q --no-deps --no-index benchmarks/wheels/*.whl \
    || echo "competitor wheels not (all) installed; those competitors are reported as skipped"
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
} > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export SKIP_INSTALL=1 PYTHONUNBUFFERED=1
for i in 0 1; do
  cmd=$([ $i = 0 ] && echo "$1" || echo "$2")
  (CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i" bash -c "$cmd" > "$OUT/gpu$i/console.log" 2>&1; echo "exit $?" >> "$OUT/gpu$i/console.log") &
done
wait
# the device tool returns at most 8 files: one log and one archive per GPU
for i in 0 1; do
  cp "$OUT/gpu$i/console.log" "$OUT/gpu$i.log"
  tar czf "$OUT/gpu$i.tgz" -C "$OUT" "gpu$i" && rm -rf "${OUT:?}/gpu$i"
done
tail -n 40 "$OUT/gpu0.log" "$OUT/gpu1.log"
