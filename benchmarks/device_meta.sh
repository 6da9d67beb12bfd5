#!/usr/bin/env bash
# One device call of meta-training: a chunk of a run, resumed where the last call left it, and once the run
# has finished, the held-out suite on its weights (resumable too). Run from the repository root on the GPU
# machine, with the run carried in and brought back as one archive (the device returns few files):
#   RUN=.devcarry/runs/NAME.tgz TRAIN_ARGS="--preset mulo ..." bash benchmarks/device_meta.sh
# then copy $OUT/NAME.tgz back over RUN for the next call (carry .devcarry). MINUTES (default 8) bounds the
# whole call: training gets what is left after the setup, the evaluation what training leaves (at least 1
# minute, else it waits for the next call). EVAL=0 skips the evaluation; EVAL_ARGS adds to it (e.g.
# "--tasks digits_cnn,wine_mlp"). LOPT_META_DATA: the data sets exported by `python -m lopt.meta.data export`
# where scikit-learn is installed (default .devcarry/meta_data.npz, if present). DEVICE=cpu tries it here.
set -u
export PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
: "${RUN:?RUN=path of the run archive, created when missing}"
: "${TRAIN_ARGS:?TRAIN_ARGS=the lopt meta-train options (the same on every call: a changed option is refused)}"
if [ -z "${LOPT_META_DATA:-}" ] && [ -f .devcarry/meta_data.npz ]; then export LOPT_META_DATA=$PWD/.devcarry/meta_data.npz; fi
started=$(date +%s)
budget=$(( ${MINUTES:-8} * 60 ))
name=$(basename "$RUN" .tgz)
dir=/tmp/lopt-meta/$name
rm -rf "$dir" && mkdir -p "$dir"
[ -f "$RUN" ] && tar xzf "$RUN" -C "$dir"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader
left() { echo $(( budget - ($(date +%s) - started) )); }
train_minutes=$(python3 -c "print(max(0.5, ($(left) - 30) / 60))")
# shellcheck disable=SC2086
python3 -m lopt.cli meta-train --device "${DEVICE:-cuda}" --out "$dir" --max-minutes "$train_minutes" --quiet $TRAIN_ARGS \
    > "$OUT/meta_train_$name.log" 2>&1
echo "meta-train: exit $?"; tail -3 "$OUT/meta_train_$name.log"
if [ "${EVAL:-1}" = 1 ] && grep -q "finished" "$OUT/meta_train_$name.log"; then
  eval_minutes=$(python3 -c "print(($(left) - 20) / 60)")
  if python3 -c "import sys; sys.exit(0 if $eval_minutes >= 1 else 1)"; then
    # shellcheck disable=SC2086
    python3 -m lopt.cli meta-eval "$dir" --device "${DEVICE:-cuda}" --max-minutes "$eval_minutes" ${EVAL_ARGS:-} \
        > "$OUT/meta_eval_$name.log" 2>&1
    echo "meta-eval: exit $?"; grep -E "^\||results:|stopped|remaining" "$OUT/meta_eval_$name.log" | tail -30
  else
    echo "meta-eval: no time left in this call; the next call evaluates"
  fi
fi
tar czf "$OUT/$name.tgz" -C "$dir" .
echo "run archive: $OUT/$name.tgz ($(du -h "$OUT/$name.tgz" | cut -f1)); copy it back over $RUN"
