#!/usr/bin/env bash
# One device call on 2 GPUs (NCCL): FSDP2 against one GPU on a GPT-2-small-sized model (random init,
# no dropout, nothing downloaded), for SmallFCLOpt and VeLO and, as the yardstick, fused AdamW.
# Run from the repository root on a machine with 2 GPUs:
#   bash benchmarks/device_distributed.sh --backend auto   (the fused backends on the shards: the records)
#   bash benchmarks/device_distributed.sh                  (lopt's naive backend)
# Writes distributed_gpt2_small_<backend>.json, .txt (the table) and .log under $OUT. NCCL_NVLS_ENABLE,
# TORCH_SYMM_MEM_DISABLE_MULTICAST and NVSHMEM_DISABLE_NVLS are left as the environment sets them.
set -u
export PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
BACKEND=naive
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND="$2"; shift 2 ;;
    *) echo "usage: $0 [--backend naive|fused|auto]" >&2; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
torch.cuda.nccl.version(), 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
NAME="$OUT/distributed_gpt2_small_$BACKEND"
# GPT-2 small: 12 layers, 768 wide, 148 tensors; global batch 8 x 128 tokens, 6 steps per run.
timeout 290 torchrun --standalone --nproc-per-node 2 benchmarks/bench_distributed.py --backend "$BACKEND" \
  --n-layer 12 --n-embd 768 --n-head 12 --seq 128 --batch 8 --steps 6 --json "$NAME.json" > "$NAME.log" 2>&1
status=$?
grep -v -E "Warning|warn\(|^W[0-9]{4}|\*\*\*\*" "$NAME.log" | tail -20
echo "exit $status; results in $NAME.json and $NAME.txt"
exit $status
