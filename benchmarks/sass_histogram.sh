#!/usr/bin/env bash
# Opcode histogram of a kernel in every cached lopt cubin (cuobjdump on the GPU machine):
#   bash benchmarks/sass_histogram.sh small_fc_lopt_apply > out.txt
kernel=${1:-small_fc_lopt_apply}
command -v cuobjdump > /dev/null || { echo "cuobjdump is not on PATH (it ships with the CUDA toolkit)" >&2; exit 1; }
for cubin in "${LOPT_KERNEL_CACHE:-$HOME/.cache/lopt/kernels}"/*.cubin; do
  echo "== $cubin"
  cuobjdump -sass -fun "$kernel" "$cubin" 2>&1 | grep -oE '^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_.]+' \
    | awk '{print $NF}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -40
  echo "total: $(cuobjdump -sass -fun "$kernel" "$cubin" 2>&1 | grep -cE '^\s+/\*[0-9a-f]+\*/')"
done
