#!/usr/bin/env bash
# Before/after A/B of two source trees on one GPU: results bit for bit (tree_bits.py) and, in
# interleaved rounds, the step over the 1.1B model's parameters (step_ab.py --model 1b) and a
# release step (release_overhead.py), each against torch's fused AdamW in the same process.
# From the repo root on the GPU machine, with the old tree copied to .ab/old (git worktree or
# archive of the old commit; .git/info/exclude it and carry .ab):
#   ROUNDS=2 bash benchmarks/tree_ab.sh      (results under $OUT; BITS=0 skips the fingerprints,
#   ROUNDS=0 the timing)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
for tree in . .ab/old; do [ -e $tree/fusedopt/kernels ] || ln -s ../kernels $tree/fusedopt/kernels; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${BITS:-1}" = 1 ]; then
  for tree in new old; do
    dir=$([ $tree = new ] && echo . || echo .ab/old)
    PYTHONPATH=$dir python3 benchmarks/tree_bits.py --out "$OUT/bits_$tree.json" || exit 1
  done
  python3 - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/bits_{t}.json")) for t in ("new", "old"))
same = [k for k in a if a[k] == b.get(k)]
print(f"bit-identical: {len(same)} of {len(a)} configurations"); [print("  differs:", k) for k in a if k not in same]
PY
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  order=$([ $((round % 2)) = 1 ] && echo "new old" || echo "old new")
  for tree in $order; do
    dir=$([ $tree = new ] && echo . || echo .ab/old)
    PYTHONPATH=$dir python3 $dir/benchmarks/step_ab.py --model 1b --rounds ${STEP_ROUNDS:-6} \
      --out "$OUT/step_${tree}_$round.json" > "$OUT/step_${tree}_$round.log" 2>&1
    grep "^| " "$OUT/step_${tree}_$round.log" | sed "s/^/$tree r$round step: /"
    PYTHONPATH=$dir python3 $dir/benchmarks/release_overhead.py --only "default, fused" --rounds ${RELEASE_ROUNDS:-3} \
      --steps ${RELEASE_STEPS:-3} --batch ${RELEASE_BATCH:-16} --out "$OUT/release_${tree}_$round.json" \
      > "$OUT/release_${tree}_$round.log" 2>&1
    tail -4 "$OUT/release_${tree}_$round.log" | sed "s/^/$tree r$round release: /"
  done
done
