#!/usr/bin/env bash
# One device call: CUDA tests, sanitizers, benchmark. Run from the repository root on the GPU machine:
#   bash benchmarks/device_small_fc_lopt.sh            (writes logs and bench.json under $OUT)
set -u
export PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
python3 -m pytest -m cuda -q -rA tests/ ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_cuda.log" | tail -40
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/sanitize_small_fc_lopt.py > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; tail -3 "$OUT/sanitizer_$tool.log"
  done
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/bench_small_fc_lopt.py --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
# PROFILE=1: Nsight Compute on the apply and statistics kernels (ViT-B/16), PROFILE_DEFINES picks a variant;
# besides the sections, the tensor/ALU/FMA/LSU pipe utilisation and the stall reasons per issued instruction.
PIPES="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
PIPES="$PIPES,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"
PIPES="$PIPES,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
PIPES="$PIPES,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__issue_active.avg.pct_of_peak_sustained_active"
PIPES="$PIPES,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
if [ "${PROFILE:-0}" = 1 ]; then
  for kernel in ${PROFILE_KERNELS:-small_fc_lopt_apply small_fc_lopt_feature_stats}; do
    ncu --clock-control none -k $kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --metrics "$PIPES" \
        python3 benchmarks/profile_small_fc_lopt.py vit-b16 "${PROFILE_DEFINES:-}" > "$OUT/ncu_$kernel.txt" 2>&1
    echo "ncu $kernel: exit $?"; grep -E "Duration|Issue Slots|pipe_|stalled|inst_executed.sum|wavefronts" "$OUT/ncu_$kernel.txt" \
        | awk '$NF+0 > 0.05 || /Duration|Issue|sum/' | head -60
  done
fi
