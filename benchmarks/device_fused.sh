#!/usr/bin/env bash
# One device call: CUDA tests, sanitizers, benchmark. Run from the repository root on the GPU machine:
#   bash benchmarks/device_fused.sh            (writes logs and bench.json under $OUT)
# PYTEST_ARGS, SANITIZE=0, BENCH=0, BENCH_ARGS, PROFILE=1 (+ PROFILE_KERNELS, PROFILE_OPTIMIZER) adjust it.
set -u
export PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m cuda -q -rfEs -s -p no:cacheprovider tests/ ${PYTEST_ARGS:-} > "$OUT/pytest_cuda.log" 2>&1
  echo "pytest -m cuda: exit $?"; grep -E "^\[|passed|failed|error|^FAILED|^ERROR" "$OUT/pytest_cuda.log" | tail -40
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/sanitize_fused.py > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; tail -2 "$OUT/sanitizer_$tool.log"
  done
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_fused.py --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
fi
if [ "${PROFILE:-0}" = 1 ]; then
  for kernel in ${PROFILE_KERNELS:-velo_apply velo_statistics}; do
    timeout 120 ncu --clock-control none -k $kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats \
        python3 benchmarks/profile_fused.py ${PROFILE_OPTIMIZER:-velo} gpt2-medium > "$OUT/ncu_$kernel.txt" 2>&1
    echo "ncu $kernel: exit $?"
    grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Stall|Warp Cycles Per Issued|Theoretical Occ|Block Limit" \
        "$OUT/ncu_$kernel.txt" | head -24
  done
fi
