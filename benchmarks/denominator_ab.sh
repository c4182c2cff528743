#!/usr/bin/env bash
# AdamW's approximate denominator (kernels/update.py APPROXIMATE_DENOMINATOR, or the constant SWITCH names:
# APPROXIMATE_ROOT_GRID, norm2-root4's; APPROXIMATE_DIVISION, the others' division) against IEEE, on the GPU machine
# from the repository root: every figure of benchmarks/RESULTS.md "How we chose" on it, and the CUDA runs of the
# test files that hold the kernel to the reference, with it on. Stages (STAGES, default all, in this order):
#   tests    tests/test_kernels.py, tests/test_lowbit_kernel.py, every norm2-root4 case of the kernel against the CPU
#            reference (tests/gpu/test_state_formats_on_cuda.py) and the fast GPU tier (FAST_BUDGET s), with it on
#   speed    step_speed.py: each configuration with and without it in one process (ratios to torch's fused AdamW)
#   counters kernel_counters.sh (ncu) in both trees: executed instructions per element of the update
#   quality  quality.py --quick --draw-seeds in both trees at each of LRS, same seeds and draws; paired difference
# The other setting is a copy of the package under /tmp (the flag flipped by sed), imported through PYTHONPATH;
# everything runs from this repository's root (tests/conftest.py drops the root from sys.path, so a copied tree's
# root would not do).
# Results under $OUT (default out/). BUDGET seconds (default 560) bound the whole script; a stage that would
# start past it is skipped.
# OTHER_TREE=DIR (a checkout or `git archive` of another commit): the quality stage of this tree ("new") against
# DIR's package ("old") instead, each with its own setting of the flag; a change of bits other than the flag's
# (e.g. the draws) is measured the same way. The other stages need the flag: they refuse.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BUDGET=${BUDGET:-560}
FAST_BUDGET=${FAST_BUDGET:-300}  # the fast GPU tier after the test files (0: not run)
STAGES=${STAGES:-tests speed counters quality}
LRS=${LRS:-2.5e-4 1e-3 3e-3}
DEVICE=${DEVICE:-cuda}  # cpu: a smoke test of the quality stage (on the CPU both trees compute the same)
JOBS=${JOBS:-12}
SWITCH=${SWITCH:-APPROXIMATE_DENOMINATOR}
SEEDS=${SEEDS:-0,1,2,3,4,5}
KEYS=${KEYS:-default,block4,nomaster,norm2-root4,norm2-root4-nomaster}
CONFIGS=("fusedopt.AdamW" "fusedopt.AdamW:state_bits=4" "fusedopt.AdamW:master_weight_bits=None"
  "fusedopt.AdamW:state_format='norm2-root4'" "fusedopt.AdamW:state_format='norm2-root4',master_weight_bits=None")

python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
copy() { PYTHONPATH="$COPY" "$@"; }
here() { "$@"; }
if [ -n "${OTHER_TREE:-}" ]; then
  COPY=/tmp/fusedopt_other_tree
  rm -rf "$COPY" && mkdir -p "$COPY"
  cp -r "$OTHER_TREE/fusedopt" "$COPY"/ && rm -rf "$COPY/fusedopt/kernels" && cp -r "$OTHER_TREE/kernels" "$COPY/fusedopt/kernels"
  A=new B=old
  a() { here "$@"; }; b() { copy "$@"; }
  (cd /tmp && copy python3 -c "import fusedopt; assert fusedopt.__file__.startswith('$COPY'), fusedopt.__file__") || exit 1
else
  FLAG=$(sed -n "s/^$SWITCH = \\(True\\|False\\)\$/\\1/p" kernels/update.py)
  [ -n "$FLAG" ] || { echo "no line '$SWITCH = True|False' in kernels/update.py"; exit 2; }
  [ "$FLAG" = True ] && OTHER=False || OTHER=True
  COPY=/tmp/fusedopt_${SWITCH}_$OTHER
  rm -rf "$COPY" && mkdir -p "$COPY"
  cp -r fusedopt "$COPY"/ && rm -rf "$COPY/fusedopt/kernels" && cp -r kernels "$COPY/fusedopt/kernels"
  sed -i "s/^$SWITCH = $FLAG\$/$SWITCH = $OTHER/" "$COPY/fusedopt/kernels/update.py"
  A=approximate B=ieee
  if [ "$FLAG" = True ]; then a() { here "$@"; }; b() { copy "$@"; }; else a() { copy "$@"; }; b() { here "$@"; }; fi
  # (from /tmp: \`python3 -c\` would find this root's fusedopt/ first; scripts put their own folder there instead)
  (cd /tmp && copy python3 -c "from fusedopt.kernels import update as u
assert u.__file__.startswith('$COPY') and u.$SWITCH == $OTHER, u.__file__") || exit 1
  # under pytest too: the test that holds the flag's default must fail there
  copy python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k approximates_its_denominator > "$OUT/canary.log" 2>&1
  [ $? -eq 1 ] || { echo "pytest does not import the copy with the flag flipped:"; tail -5 "$OUT/canary.log"; exit 1; }
fi
left() { echo $((BUDGET - SECONDS)); }

for stage in $STAGES; do
  [ "$(left)" -lt 30 ] && { echo "$stage: not run, $(left) s left of BUDGET=$BUDGET"; continue; }
  echo "== $stage at $SECONDS s"
  [ -n "${OTHER_TREE:-}" ] && [ "$stage" != quality ] && { echo "$stage: needs the flag, not OTHER_TREE"; exit 2; }
  case $stage in
    tests)
      a timeout -s INT 240 python3 -m pytest -q -rf --tb=line -p no:cacheprovider tests/test_kernels.py \
        tests/test_lowbit_kernel.py "tests/gpu/test_state_formats_on_cuda.py::test_the_kernel_on_cuda_matches_the_cpu_reference" \
        -k "not approximates_its_denominator" > "$OUT/tests_approximate.log" 2>&1
      tail -15 "$OUT/tests_approximate.log"
      fast=$(($(left) < FAST_BUDGET ? $(left) : FAST_BUDGET))
      [ "$fast" -ge 30 ] && a env OUT="$OUT/approximate_tier" SKIP_INSTALL=1 TIERS=fast BUDGET=$fast \
        bash tests/gpu/run_tiers.sh | tail -3 ;;
    speed)
      python3 benchmarks/step_speed.py --tensors 2 --rounds 8 --reps 5 --configs "${CONFIGS[@]}" \
        --constants $SWITCH=$OTHER --out "$OUT/speed.json" 2>&1 | tail -9 ;;
    counters)
      b env OUT="$OUT/ieee" bash benchmarks/kernel_counters.sh "${CONFIGS[@]}" | tail -8
      a env OUT="$OUT/approximate" bash benchmarks/kernel_counters.sh "${CONFIGS[@]}" | tail -8 ;;
    quality)
      for lr in $LRS; do
        [ "$(left)" -lt 60 ] && { echo "lr $lr: not run"; continue; }
        common=(--quick --draw-seeds --device "$DEVICE" --seeds "$SEEDS" --only "$KEYS" --lr "$lr" --jobs "$JOBS")
        b python3 benchmarks/quality.py "${common[@]}" --out "$OUT/q_${B}_$lr.json" > "$OUT/q_${B}_$lr.log" 2>&1
        a python3 benchmarks/quality.py "${common[@]}" --out "$OUT/q_${A}_$lr.json" > "$OUT/q_${A}_$lr.log" 2>&1
      done
      python3 - "$OUT" "$A" "$B" <<'EOF'
import glob, json, os, statistics, sys
# per key and lr: run A's held-out loss against run B's of the same seed, in %
out, a, b = sys.argv[1:]
for path in sorted(glob.glob(os.path.join(out, f"q_{a}_*.json"))):
    lr, other = path.rsplit("_", 1)[1][:-5], path.replace(f"q_{a}_", f"q_{b}_")
    runs = [{(r["key"], r["seed"]): r["final_eval"] for r in json.load(open(p))["runs"]} for p in (path, other)]
    for key in sorted({k for k, _ in runs[0]}):
        d = [100 * (runs[0][k, s] / runs[1][k, s] - 1) for k, s in runs[0] if k == key and (k, s) in runs[1]]
        sd = statistics.stdev(d) if len(d) > 1 else float("nan")
        print(f"lr {lr} {key}: {a} - {b} {statistics.fmean(d):+.3f} ± {sd:.3f}% over {len(d)} seeds")
EOF
      ;;
    *) echo "unknown stage: $stage"; exit 2 ;;
  esac
done
echo "== end at $SECONDS s"
