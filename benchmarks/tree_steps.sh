#!/usr/bin/env bash
# Step speed of several source trees on one GPU, in rounds whose order rotates: each tree in its own process,
# timed against torch's fused AdamW of that process (step_speed.py), the same benchmark code (this tree's) for
# every tree (only the library differs: PYTHONPATH=<tree>). From the repo root on the GPU machine:
#   TREES=". .ab/old" ROUNDS=2 STEP_ARGS="--formats norm2-root4 --rounds 3" bash benchmarks/tree_steps.sh
# (a tree: `git archive COMMIT fusedopt kernels | tar -x -C .ab/NAME`, .ab excluded in .git/info/exclude and carried)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
read -ra trees <<< "${TREES:-. .ab/old}"
for tree in "${trees[@]}"; do [ -e "$tree/fusedopt/kernels" ] || ln -s ../kernels "$tree/fusedopt/kernels"; done
n=${#trees[@]}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for k in $(seq 0 $((n - 1))); do
    tree=${trees[$(((k + round) % n))]}
    name=$(echo "$tree" | tr './' '_-')
    # shellcheck disable=SC2086
    PYTHONPATH=$tree python3 benchmarks/step_speed.py ${STEP_ARGS:-} --out "$OUT/steps_${name}_$round.json" \
      > "$OUT/steps_${name}_$round.log" 2>&1
    grep "^| " "$OUT/steps_${name}_$round.log" | sed "s|^|$tree r$round: |"
  done
done
