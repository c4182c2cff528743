#!/usr/bin/env bash
# Before/after A/B of two source trees on one GPU: parameters and optimizer state bit for bit (harness.py
# bits: every algorithm x state bits and every state format x master x dtype x fused) and, in interleaved
# rounds, the step over the 1.1B model's parameters (step_speed.py --model 1b) and a release step
# (release_overhead.py), each against torch's fused AdamW in the same process. The same benchmark code
# (this tree's) measures both trees: only the library differs (PYTHONPATH=<tree>).
# From the repo root on the GPU machine, with the old tree copied to .ab/old (git worktree or archive of
# the old commit: git archive COMMIT | tar -x -C .ab/old; .git/info/exclude it and carry .ab):
#   ROUNDS=2 bash benchmarks/tree_ab.sh      (results under $OUT; exit code 1 when a configuration differs)
# BITS=0 skips the fingerprints, ROUNDS=0 the timing; BITS_ARGS="--algorithms adamw --formats block8,norm2-root4"
# narrows the fingerprints (all of them compile each format's kernels once per tree: minutes, cold cache).
# CLIPPING=1 also measures what max_grad_norm adds, per tree in its own process: release_overhead.py --paired
# (the 1.1B shape, micro-batches BATCHES, CLIP_ROUNDS rounds of single steps; ratios to the unclipped fused=True
# step of the same round) and clipping_step.py (one fused=False step() over 1.07e9 bf16 elements).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
for tree in . .ab/old; do [ -e $tree/fusedopt/kernels ] || ln -s ../kernels $tree/fusedopt/kernels; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
if [ "${BITS:-1}" = 1 ]; then
  for tree in old new; do
    dir=$([ $tree = new ] && echo . || echo .ab/old)
    # shellcheck disable=SC2086
    PYTHONPATH=$dir python3 benchmarks/harness.py bits --out "$OUT/bits_$tree.json" ${BITS_ARGS:-} || exit 1
  done
  python3 benchmarks/harness.py same "$OUT/bits_old.json" "$OUT/bits_new.json" | tee "$OUT/bits_same.txt" || status=1
fi
if [ "${CLIPPING:-0}" = 1 ]; then
  configs=("default, fused=True" "clipping, fused=True" "torch AdamW (fused=True" "default, fused=False" "clipping, fused=False")
  for tree in old new; do
    dir=$([ $tree = new ] && echo . || echo .ab/old)
    for b in ${BATCHES:-4 1}; do
      PYTHONPATH=$dir timeout -k 10 240 python3 benchmarks/release_overhead.py --only "${configs[@]}" \
        --paired ${CLIP_ROUNDS:-30} --batch "$b" > "$OUT/clipping_${tree}_b$b.log" 2>&1
      grep -E "^\||rounds of" "$OUT/clipping_${tree}_b$b.log" | sed "s/^/$tree b$b clipping: /"
    done
    PYTHONPATH=$dir timeout -k 10 240 python3 benchmarks/clipping_step.py > "$OUT/clipping_step_$tree.log" 2>&1
    grep -E "^\||/" "$OUT/clipping_step_$tree.log" | sed "s/^/$tree clipping step: /"
  done
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  order=$([ $((round % 2)) = 1 ] && echo "new old" || echo "old new")
  for tree in $order; do
    dir=$([ $tree = new ] && echo . || echo .ab/old)
    PYTHONPATH=$dir python3 benchmarks/step_speed.py --model 1b --rounds ${STEP_ROUNDS:-6} \
      --out "$OUT/step_${tree}_$round.json" > "$OUT/step_${tree}_$round.log" 2>&1
    grep "^| " "$OUT/step_${tree}_$round.log" | sed "s/^/$tree r$round step: /"
    PYTHONPATH=$dir python3 benchmarks/release_overhead.py --only "default, fused" --rounds ${RELEASE_ROUNDS:-3} \
      --steps ${RELEASE_STEPS:-3} --batch ${RELEASE_BATCH:-16} --out "$OUT/release_${tree}_$round.json" \
      > "$OUT/release_${tree}_$round.log" 2>&1
    tail -4 "$OUT/release_${tree}_$round.log" | sed "s/^/$tree r$round release: /"
  done
done
exit $status
