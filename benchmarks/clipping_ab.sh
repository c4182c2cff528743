#!/usr/bin/env bash
# Clipping cost of a training step (1.1B Llama shape, bf16, checkpointing) on a CUDA machine, as ratios
# within one process: release_overhead.py --paired (single steps of each configuration in turn, ROUNDS
# rounds; ratios to the unclipped fused=True step of the same round), micro-batches BATCHES; then
# clipping_step.py (one fused=False step() over 64 x 4096^2 bf16 tensors, with and without clipping).
# With a tree of another commit in .base/ (git archive COMMIT | tar -x -C .base), that tree runs first
# (same commands, its own process).  Logs land in $OUT.
#   ROUNDS=30 BATCHES="4 1" bash benchmarks/clipping_ab.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CONFIGS=("default, fused=True" "clipping, fused=True" "torch AdamW (fused=True" "default, fused=False" "clipping, fused=False")
run_tree() {  # $1: tree, $2: label
  ln -sfn ../kernels "$1/fusedopt/kernels"  # the package layout an install gives (pyproject)
  for b in ${BATCHES:-4 1}; do
    (cd "$1" && PYTHONPATH=. timeout -k 10 ${RUN_S:-240} python3 "$ROOT/benchmarks/release_overhead.py" \
      --only "${CONFIGS[@]}" --paired ${ROUNDS:-30} --batch "$b") > "$OUT/$2_b$b.log" 2>&1
    grep -E "^\||rounds of" "$OUT/$2_b$b.log" | sed "s/^/[$2 b$b] /"
  done
  (cd "$1" && PYTHONPATH=. timeout -k 10 ${RUN_S:-240} python3 "$ROOT/benchmarks/clipping_step.py") > "$OUT/$2_step.log" 2>&1
  grep -E "^\||/" "$OUT/$2_step.log" | sed "s/^/[$2 step] /"
}
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ -d .base ] && run_tree .base before
run_tree . after
