#!/usr/bin/env bash
# GPU checks and benchmarks, one device call per part. From the repo root on the GPU machine:
#   bash benchmarks/run_h200.sh PART...     (logs and results under $OUT, left as one archive,
#                                            $OUT/results.tgz, unless run by run_pair.sh)
# parts: perf     kernel ablation + step bandwidth (benchmarks/kernel_ablation.py, step_bandwidth.py)
#        bandwidth      step bandwidth only
#        ab       the default against torch's fused AdamW (and tile variants), interleaved (step_ab.py)
#        tests    GPU parity and end-to-end tests (tests/gpu) + the interpreter suite on CUDA tensors
#        profile  the profiler's CUDA tests
#        release  release overhead on a ~1B model (benchmarks/release_overhead.py)
#        examples the two examples at their GPU size
#        launch   host time of one parameter's update (benchmarks/launch_overhead.py)
#        codec    8-bit square vs shifted-minifloat levels: tracking error, then training loss
#                 (benchmarks/codec_choice.py, ~6 min; the figures of docs/codecs.md)
#        ablation kernel ablation only (VARIANTS=...)
#        counters Nsight Compute counters of the update kernel, its VARIANTS and torch's fused AdamW
#                 (benchmarks/kernel_counters.py; the report, its raw/details CSV and the SASS page)
# SKIP_INSTALL=1: the package is already installed (benchmarks/run_pair.sh installs once).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %H %cd' 2>/dev/null | tee -a "$OUT/gpu.txt"
for part in "${@:-perf tests}"; do
  case $part in
    perf)
      python3 benchmarks/kernel_ablation.py --out "$OUT/ablation.json" ${VARIANTS:+--variants $VARIANTS} 2>&1 \
        | tee "$OUT/ablation.log"  # e.g. VARIANTS=base,scale1d,base,scale1d (a candidate against the base)
      python3 benchmarks/step_bandwidth.py --sweep --out "$OUT/step_bandwidth.json" 2>&1 | tee "$OUT/step_bandwidth.log" ;;
    bandwidth)
      python3 benchmarks/step_bandwidth.py --out "$OUT/step_bandwidth.json" 2>&1 | tee "$OUT/step_bandwidth.log" ;;
    ab)
      python3 benchmarks/step_ab.py --variants ${AB_ARGS:-} --out "$OUT/step_ab.json" 2>&1 | tee "$OUT/step_ab.log" ;;
    tests)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu tests/test_kernels.py} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -25 ;;
    profile)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_profile.py 2>&1 | tee "$OUT/profile_gpu_tests.log" | tail -5 ;;
    release)
      diagnose=$([ "${DIAGNOSE:-1}" = 0 ] || echo "--diagnose $OUT/release_traces")  # DIAGNOSE=0: timing only
      python3 benchmarks/release_overhead.py --out "$OUT/release_overhead.json" $diagnose ${RELEASE_ARGS:-} 2>&1 \
        | tee "$OUT/release_overhead.log" ;;  # e.g. RELEASE_ARGS="--switch-interval 1e-6"
    codec)
      maps=("int8 m sq, v fp32" "int8 m mf, v fp32" "int8 m fp32, v sq" "int8 m fp32, v mf")
      pairs=("int8 m sq/16, v sq/16" "int8 m mf/16, v mf/16")
      python3 benchmarks/codec_choice.py --part train --bits 8 --select "${pairs[@]}" 2>&1 | tee "$OUT/codec_train.log"
      python3 benchmarks/codec_choice.py --part track --track maps pairs --bits 8 --select "${maps[@]}" "${pairs[@]}" \
        2>&1 | tee "$OUT/codec_track.log" ;;
    ablation)
      python3 benchmarks/kernel_ablation.py --out "$OUT/ablation.json" ${VARIANTS:+--variants $VARIANTS} 2>&1 \
        | tee "$OUT/ablation.log" ;;
    counters)
      rep="$OUT/counters"
      command -v ncu > /dev/null || PATH=$PATH:$(ls -d /opt/nvidia/nsight-compute/*/ 2>/dev/null | tail -1)
      ncu --clock-control none --profile-from-start off --set full -f -o "$rep" \
        python3 benchmarks/kernel_counters.py ${VARIANTS:+--variants $VARIANTS} 2>&1 | tee "$OUT/counters_run.log" | grep -v '^==PROF=='
      ncu -i "$rep.ncu-rep" --page raw --csv > "$OUT/counters_raw.csv" 2> "$OUT/counters_export.err"
      ncu -i "$rep.ncu-rep" --page details --csv > "$OUT/counters_details.csv" 2>> "$OUT/counters_export.err"
      ncu -i "$rep.ncu-rep" --page source --print-source sass --csv --kernel-name regex:_update_kernel \
        --launch-count 1 > "$OUT/counters_update_sass.csv" 2>> "$OUT/counters_export.err"
      python3 benchmarks/kernel_counters.py --summarize "$rep.ncu-rep" 2>&1 | tee "$OUT/counters_summary.txt" ;;
    launch)
      python3 benchmarks/launch_overhead.py --out "$OUT/launch_overhead.json" 2>&1 | tee "$OUT/launch_overhead.log" ;;
    examples)
      timeout 120 python3 examples/finetune_lowvram.py --steps ${EXAMPLE_STEPS:-60} --out /tmp/ex_lowvram \
        --summary-json "$OUT/example_lowvram.json" 2>&1 | tail -30 | tee "$OUT/example_lowvram.log"
      timeout 120 python3 examples/finetune_hf.py --steps ${EXAMPLE_STEPS:-60} 2>&1 | tail -30 | tee "$OUT/example_hf.log" ;;
    *) echo "unknown part: $part"; exit 2 ;;
  esac
done
# standalone on the GPU machine: logs plus one archive (run_pair.sh archives per GPU itself)
[ -n "${SKIP_INSTALL:-}" ] || bash benchmarks/pack_out.sh "$OUT"
