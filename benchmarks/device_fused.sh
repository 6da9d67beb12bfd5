#!/usr/bin/env bash
# One device call: CUDA tests, sanitizers, benchmark. Run from the repository root on the GPU machine:
#   bash benchmarks/device_fused.sh            (writes logs and bench.json under $OUT)
# PYTEST_ARGS (split on spaces), PYTEST_K (a -k expression, spaces allowed), TESTS=0, FRAMEWORKS=0, SANITIZE=0 (SANITIZERS="memcheck"), BENCH=0, BENCH_ARGS, SOAK=1,
# PROFILE=1 (+ PROFILE_KERNELS, PROFILE_OPTIMIZER, PROFILE_PRECISION: exact or fast, PROFILE_SECTIONS: Nsight
# Compute section names),
# HOST_TIMELINE=1 (profile_host.py's timelines, the fast check against the general one, interleaved;
# HOST_OPTIMIZERS, HOST_PARAM_SET) adjust it.
set -u
export PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m cuda -q -rfEs -s -p no:cacheprovider tests/ ${PYTEST_ARGS:-} \
      ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/pytest_cuda.log" 2>&1
  echo "pytest -m cuda: exit $?"; grep -E "^\[|passed|failed|error|^FAILED|^ERROR" "$OUT/pytest_cuda.log" | tail -40
fi
if [ "${FRAMEWORKS:-1}" = 1 ]; then  # the integration tests that need a GPU or timm (not in CPU CI)
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_integrations_timm.py tests/test_integrations_lightning.py \
      > "$OUT/pytest_frameworks.log" 2>&1
  echo "pytest frameworks: exit $?"; tail -3 "$OUT/pytest_frameworks.log"
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in ${SANITIZERS:-memcheck racecheck}; do
    timeout 240 compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/sanitize_fused.py > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; tail -2 "$OUT/sanitizer_$tool.log"
  done
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_fused.py --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
fi
if [ "${SOAK:-0}" = 1 ]; then
  timeout ${SOAK_TIMEOUT:-120} python3 benchmarks/soak.py --device cuda --backends fused --out "$OUT/soak.json" 2>&1 | tail -3
fi
if [ "${HOST_TIMELINE:-0}" = 1 ]; then
  for optimizer in ${HOST_OPTIMIZERS:-velo}; do
    for general in 0 1 0 1; do
      echo "== $optimizer ${HOST_PARAM_SET:-gpt2-medium} general_check=$general" >> "$OUT/host_timelines.txt"
      HOST_GENERAL_CHECK=$general HOST_CPROFILE=0 timeout 120 python3 benchmarks/profile_host.py $optimizer \
          ${HOST_PARAM_SET:-gpt2-medium} >> "$OUT/host_timelines.txt" 2>&1
      echo "host timeline $optimizer general_check=$general: exit $?"
      tail -1 "$OUT/host_timelines.txt"
    done
  done
fi
if [ "${PROFILE:-0}" = 1 ]; then
  for kernel in ${PROFILE_KERNELS:-velo_apply velo_statistics}; do
    sections=${PROFILE_SECTIONS:-"SpeedOfLight Occupancy MemoryWorkloadAnalysis WarpStateStats ComputeWorkloadAnalysis LaunchStats"}
    timeout 180 ncu --clock-control none -k $kernel -s 2 -c 1 $(printf -- '--section %s ' $sections) \
        python3 benchmarks/profile_fused.py ${PROFILE_OPTIMIZER:-velo} gpt2-medium ${PROFILE_PRECISION:-} \
        > "$OUT/ncu_$kernel.txt" 2>&1
    echo "ncu $kernel: exit $?"
    grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Stall|Warp Cycles Per Issued|Theoretical Occ|Block Limit" \
        "$OUT/ncu_$kernel.txt" | head -24
  done
fi
