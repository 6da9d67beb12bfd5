#!/usr/bin/env bash
# One device call of `lopt meta-eval` over several weight sets, one after the other, sharing the AdamW runs
# (--baselines): every evaluation and the shared baselines travel in and out as one archive, refreshed every
# 30 s while the call runs, so a call stopped by its time limit still brings back every run that finished
# (meta-eval keeps each finished run; the next call resumes). Run from the repository root on the GPU machine:
#   ARCHIVE=.devcarry/evals.tgz EVALS="shipped-lr0.1=lopt-small_fc-tiny@0.1 cand=.devcarry/cand@1" \
#       bash benchmarks/device_meta_eval.sh
# then copy $OUT/evals.tgz back over ARCHIVE (carry .devcarry); $OUT/results.tgz holds the reports alone. EVALS: NAME=WEIGHTS@LR entries (WEIGHTS as
# meta-eval takes it; LR the learned optimizer's lr, `default` for its class's); each one's results land in
# NAME/ of the archive. MINUTES (default 8) bounds the call: meta-eval starts no run after it, and a run takes
# up to ~2 minutes (the learned optimizer on mnist1d_mlp_512x7, an H100). EVAL_ARGS adds to every evaluation
# (e.g. "--tasks digits_cnn,wine_mlp"). Two evaluations side by side on one GPU were measured no faster than
# one after the other (docs/meta_training.md §6), so this runs them in sequence. LOPT_META_DATA as in
# device_meta.sh (default .devcarry/meta_data.npz, if present). DEVICE=cpu tries it here.
set -u
export PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lopt-out}; mkdir -p "$OUT"
: "${ARCHIVE:?ARCHIVE=path of the evaluations archive, created when missing}"
: "${EVALS:?EVALS=NAME=WEIGHTS@LR entries, space-separated}"
if [ -z "${LOPT_META_DATA:-}" ] && [ -f .devcarry/meta_data.npz ]; then export LOPT_META_DATA=$PWD/.devcarry/meta_data.npz; fi
started=$(date +%s)
budget=$(( ${MINUTES:-8} * 60 ))
dir=/tmp/lopt-meta-eval
rm -rf "$dir" && mkdir -p "$dir/baselines"
[ -f "$ARCHIVE" ] && tar xzf "$ARCHIVE" -C "$dir"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader
# evals.tgz: everything, to resume from; results.tgz: the reports alone (results.json/.md, curves), small enough to
# come back whatever the runs weigh (the device tool returns files of at most 16 MiB; a full archive of several
# evaluations with their kept runs passed that once and did not come back)
save() {
  tar czf "$OUT/evals.tmp.tgz" -C "$dir" . && mv "$OUT/evals.tmp.tgz" "$OUT/evals.tgz"
  tar czf "$OUT/results.tmp.tgz" -C "$dir" --exclude='*.pt' . && mv "$OUT/results.tmp.tgz" "$OUT/results.tgz"
}
( while sleep 30; do save; done ) &
saver=$!
for entry in $EVALS; do
  name=${entry%%=*}; rest=${entry#*=}; weights=${rest%@*}; lr=${rest##*@}
  minutes=$(python3 -c "print(round(($budget - ($(date +%s) - $started)) / 60, 2))")
  if python3 -c "import sys; sys.exit(0 if $minutes >= 0.5 else 1)"; then
    lr_args=(); [ "$lr" != default ] && lr_args=(--learned-lr "$lr")
    # shellcheck disable=SC2086
    python3 -m lopt.cli meta-eval "$weights" --out "$dir/$name" "${lr_args[@]}" --baselines "$dir/baselines" \
        --device "${DEVICE:-cuda}" --max-minutes "$minutes" --quiet ${EVAL_ARGS:-} > "$OUT/meta_eval_$name.log" 2>&1
    echo "$name: exit $? at $(( $(date +%s) - started )) s"
  else
    echo "$name: no time left in this call; the next call evaluates it"
  fi
  [ -f "$dir/$name/results.md" ] && grep -E "^\|" "$dir/$name/results.md" | tail -n +3
done
kill "$saver" 2> /dev/null; wait "$saver" 2> /dev/null
save
echo "archive: $OUT/evals.tgz ($(du -h "$OUT/evals.tgz" | cut -f1)); copy it back over $ARCHIVE; reports alone: $OUT/results.tgz"
if [ "$(stat -c %s "$OUT/evals.tgz")" -gt $(( 16 * 1024 * 1024 )) ]; then
  echo "evals.tgz is over 16 MiB and will not come back: use results.tgz, and start the next ARCHIVE with fewer evaluations"
fi
