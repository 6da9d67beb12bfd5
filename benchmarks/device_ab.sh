#!/usr/bin/env bash
# bench_fused.py on several trees of lopt, one after the other on one GPU machine, each in its own process beside
# fused AdamW: a kernel change against its base, measured in one call (timings across calls and machines do not
# compare). Two steps:
#   here:        bash benchmarks/device_ab.sh export main my-branch HEAD~1 ...
#                (git archive of each revision's lopt/, cuda_src/, benchmarks/ and weights/ into .devcarry/ab/<i>-<rev>)
#   on the GPU:  BENCH_ARGS="--optimizers celo2 --param-sets gpt2-medium --naive-steps 0 --steps 10 --only-fast" \
#                    bash benchmarks/device_ab.sh run        (carry .devcarry)
# `run` benches the trees in order, then the first one again (ROUNDS=2, the default: the machine's drift between
# the first tree's two runs is the noise to read the others against), and prints each tree's rows with
# bench_fused.py's kernel split; the records (ab_<tree>_<round>.json, and each run's log) go to $OUT/ab.tgz.
set -u
dir=${AB_DIR:-.devcarry/ab}
case "${1:-}" in
  export)
    shift
    [ $# -gt 0 ] || { echo "usage: bash benchmarks/device_ab.sh export REV [REV ...]" >&2; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir"
    index=0
    for rev in "$@"; do
      name="$index-$(echo "$rev" | tr -c 'A-Za-z0-9._\n-' '_')"
      mkdir -p "$dir/$name"
      git archive "$rev" lopt cuda_src benchmarks weights | tar x -C "$dir/$name" || exit 1
      echo "$dir/$name: $(git rev-parse --short "$rev")" | tee -a "$dir/TREES"
      index=$((index + 1))
    done
    ;;
  run)
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
    [ -f "$dir/TREES" ] || { echo "no trees under $dir: export them first (and carry .devcarry)" >&2; exit 2; }
    nvidia-smi --query-gpu=name --format=csv,noheader
    cat "$dir/TREES"
    trees=$(ls -d "$dir"/*/ | sort -V)
    first=$(echo "$trees" | head -1)
    order=$trees
    for round in $(seq 2 "${ROUNDS:-2}"); do order="$order $first"; done
    round=0
    for tree in $order; do
      name=$(basename "$tree")
      round=$((round + 1))
      # (the record names the tree's commit: the copy has no history of its own)
      commit=$(grep -F "$dir/$name:" "$dir/TREES" | tail -1 | awk '{print $2}')
      (cd "$tree" && LOPT_COMMIT="$commit" PYTHONPATH=. timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_fused.py \
          --out "$OUT/ab_${name}_$round.json" ${BENCH_ARGS:-} > "$OUT/ab_${name}_$round.log" 2>&1)
      echo "== $name (run $round): exit $?"
      # (the table's rows, and under each fused row bench_fused.py's split of its kernels, largest first)
      grep -E "^[a-z_0-9]+ +(fused|naive)|^    [a-z]" "$OUT/ab_${name}_$round.log" | grep -v "^    captured" | cut -c1-220
    done
    # (one archive: the device tool brings back only a few files per call)
    (cd "$OUT" && tar czf ab.tgz ab_*.json ab_*.log && rm -f ab_*.json ab_*.log)
    ;;
  *)
    echo "usage: bash benchmarks/device_ab.sh export REV [REV ...] | run" >&2
    exit 2
    ;;
esac
