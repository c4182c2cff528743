#!/usr/bin/env bash
# Clipping cost of a training step (1.1B Llama shape, bf16, checkpointing) on a CUDA machine:
# release_overhead.py's configurations with and without max_grad_norm, in one process, interleaved.
# With a tree of another commit in .base/ (git archive COMMIT | tar -x -C .base), that tree runs first
# (same command, its own process), then this one.  Logs land in $OUT.
#   bash benchmarks/clipping_ab.sh            BATCHES="4 1"; DIAGNOSE=before profiles a step of that tree
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CONFIGS=("default, fused" "clipping, fused" "torch AdamW (fused")
run_tree() {  # $1: tree, $2: label
  (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1) || return 1
  for b in ${BATCHES:-4 1}; do
    diag=(); [ "$b" = 4 ] && [ "${DIAGNOSE:-}" = "$2" ] && diag=(--diagnose "/tmp/diag_$2")
    (cd "$1" && timeout -k 10 ${RUN_S:-240} python3 benchmarks/release_overhead.py --only "${CONFIGS[@]}" \
      --rounds ${ROUNDS:-3} --steps ${STEPS:-3} --batch "$b" "${diag[@]}") > "$OUT/$2_b$b.log" 2>&1
    grep -E "^\||whole step" "$OUT/$2_b$b.log" | sed "s/^/[$2 b$b] /"
  done
  # fused=False: one step() over 64 x 4096^2 bf16 tensors with and without max_grad_norm
  (cd "$1" && timeout -k 10 ${RUN_S:-240} python3 "$ROOT/benchmarks/clipping_step.py") > "$OUT/$2_step.log" 2>&1
  grep -E "^\||/" "$OUT/$2_step.log" | sed "s/^/[$2 step] /"
}
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ -d .base ] && run_tree .base before
run_tree . after
[ -n "${TESTS:-}" ] && { timeout -k 10 ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"; }
