#!/usr/bin/env bash
# lopt bench on a GPU machine, in one device call (about 5 minutes on an H100). From the repository root:
#   LOPT_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/device_bench.sh
# Writes 8 files under $OUT: step.{json,md,png} (step mode, GPT-2 medium, every optimizer and AdamW),
# iteration.{json,md,png} (zero_grad + forward + backward + step of GPT-2 medium at 8x1024 tokens and
# ViT-B/16 at batch 64, bfloat16 autocast), curves.png (loss curves, their numbers are in iteration.json)
# and lopt_bench.log (everything printed). TESTS=1 adds the CUDA tests of tests/test_bench.py.
# Needs transformers and matplotlib (timm too, for ViT-B/16). Where they are missing and the machine is
# offline, carry wheels: `bash benchmarks/fetch_bench_wheels.sh` fills .whl/ here; pass carry=[".whl"].
set -u
export PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_OFFLINE=1
export LOPT_COMMIT=${LOPT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
LOG="$OUT/lopt_bench.log"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  torch_before=$(python3 -c "import torch; print(torch.__version__)")
  if ! python3 -c "import transformers, matplotlib" 2>/dev/null; then
    if [ -d .whl ]; then
      echo "installing transformers and matplotlib from .whl/ (offline)"
      python3 -m pip install --quiet --no-index --find-links .whl transformers matplotlib 2>&1 | tail -3
    else
      echo "transformers or matplotlib missing and no .whl/ carried: iteration mode and the plots will say so"
    fi
  fi
  torch_after=$(python3 -c "import torch; print(torch.__version__)")
  [ "$torch_before" = "$torch_after" ] || echo "WARNING: torch changed from $torch_before to $torch_after"
  python3 - <<'PY'
import importlib
for name in ("torch", "cupy", "transformers", "timm", "torchvision", "matplotlib"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:
        print(name, "unavailable:", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
PY
  params=gpt2-medium
  python3 -c "import timm" 2>/dev/null && params=gpt2-medium,vit-b16
  echo "== step mode: GPT-2 medium, every optimizer, AdamW (fused) beside =="
  timeout 170 python3 -m lopt.cli bench --quiet --json "$OUT/step.json" --markdown "$OUT/step.md" --plot "$OUT/step.png"
  echo "exit $?"
  echo "== iteration mode ($params) and loss curves (gpt2-4x256, 200 steps) =="
  timeout 400 python3 -m lopt.cli bench --quiet --mode iteration --optimizer all --params "$params" \
      --plot "$OUT/iteration.png" --curves "$OUT/curves.png" --json "$OUT/iteration.json" \
      --markdown "$OUT/iteration.md"
  echo "exit $?"
  if [ "${TESTS:-0}" = 1 ]; then  # TESTS=1: also the CUDA tests of lopt bench (about a minute)
    python3 -m pytest -m cuda -q -rA tests/test_bench.py 2>&1 | tail -15
  fi
} 2>&1 | tee "$LOG"
