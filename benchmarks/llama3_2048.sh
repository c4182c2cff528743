#!/usr/bin/env bash
# Llama-3-8B at 2048 tokens on one GPU: the docs/fit.md recipe (norm2-root4 without a correction,
# clipping at 1.0, a 22.35 GiB cap) against torch's bf16 fused AdamW run without a cap, with and
# without clip_grad_norm_, in one session; then the recipe through Hugging Face's LlamaForCausalLM
# (examples/finetune_hf.py, 50 steps under the cap). Prints one summary line per run.
#
#   OUT=$OUT bash benchmarks/llama3_2048.sh            # all four runs (about 2 minutes on an H100)
#   RUNS="recipe torch-clip" OUT=$OUT bash benchmarks/llama3_2048.sh
#
# Without transformers installed, the HF run installs it from benchmarks/wheels/ (pip download
# transformers==5.25.0 and its dependencies there first; the device has no network).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/llama3_2048}
RUNS=${RUNS:-recipe torch-clip torch hf}
STEPS=${STEPS:-8}
SEQ=${SEQ:-2048}
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }

summary() {
  python - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
p = r.get("profile") or {}
print(f"{r['config']} clip={r['clip_grad_norm'] or r['optimizer_kwargs'].get('max_grad_norm')} "
      f"steps {r['steps_run']}/{r['steps']} error={r['error']} median_step_ms={1e3 * (r['step_s_median'] or 0):.1f} "
      f"peak_alloc={r['peak_allocated_gib']:.2f} reserved={r['peak_reserved_gib']:.2f} "
      f"gpu_ms={p.get('gpu_ms_per_step', 0):.1f} optimizer_ms={p.get('optimizer_ms_per_step', 0):.2f} "
      f"loss {r['loss_first']:.2f}->{r['loss_last']:.2f} {r['device']} torch {r['torch']}")
for k, v in (p.get("optimizer_kernels_ms") or {}).items():
    print(f"   {v:8.3f} ms  {k}")
EOF
}

fit() {  # name, fit_7b.py arguments
  local name=$1
  shift
  python benchmarks/fit_7b.py --shape llama3-8b --seq "$SEQ" --steps "$STEPS" --profile-steps 2 \
    --out "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name (rc $?)"
  if [ -f "$OUT/$name.json" ]; then summary "$OUT/$name.json"; else tail -5 "$OUT/$name.log"; fi
}

for run in $RUNS; do
  case $run in
    recipe) fit recipe --config norm2-root4-nomaster --budget-gib 22.35 --vocab-pieces 8 --chunked-loss 0 \
      --opt max_grad_norm=1.0 ;;
    torch-clip) fit torch-clip --config torch-bf16 --budget-gib 1000 --opt max_grad_norm=1.0 ;;
    torch) fit torch --config torch-bf16 --budget-gib 1000 ;;
    hf)
      python -c "import transformers" 2>/dev/null ||
        python -m pip install -q --no-index --find-links benchmarks/wheels "transformers==5.25.0" >"$OUT/pip.log" 2>&1
      python examples/finetune_hf.py --config benchmarks/llama3_8b.json --state-format norm2-root4 \
        --master-weight-bits none --vocab-pieces 8 --chunked-loss --accum 1 --seq-len "$SEQ" --steps 50 \
        --max-grad-norm 1.0 --memory-cap-gib 22.35 --no-save --summary-json "$OUT/hf.json" >"$OUT/hf.log" 2>&1
      echo "== hf (rc $?)"
      tail -4 "$OUT/hf.log"
      [ -f "$OUT/hf.json" ] && python -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1])))[:1500])" "$OUT/hf.json"
      ;;
    *) echo "unknown run $run" >&2 ;;
  esac
done
