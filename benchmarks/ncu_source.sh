#!/usr/bin/env bash
# Nsight Compute's counters per SASS instruction of one kernel (executed instructions, stall samples,
# shared-memory and L1 wavefronts), exported as CSV beside the kernel's summary sections:
#   bash benchmarks/ncu_source.sh small_fc_lopt_apply small_fc_lopt gpt2-medium fast > $OUT/summary.txt
# (the fourth argument: small_fc_lopt's precision, exact or fast; none for VeLO).
# Writes $OUT/sass_<kernel>.csv (the report itself stays in /tmp: it is large; benchmarks/ncu_by_opcode.py sums it per opcode).
set -u
kernel=$1 optimizer=$2 param_set=$3 precision=${4:-}
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
report=/tmp/ncu_$kernel
export PYTHONPATH=. HF_HUB_OFFLINE=1
timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k "$kernel" -s 2 -c 1 -f -o "$report" \
    --section SourceCounters --section InstructionStats --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --section WarpStateStats --section LaunchStats --section Occupancy \
    python3 benchmarks/profile_fused.py "$optimizer" "$param_set" $precision > /dev/null 2>&1
echo "ncu: exit $?"
ncu -i "$report.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$kernel.csv" 2>&1
ncu -i "$report.ncu-rep" --page details --print-details all 2>&1
