#!/usr/bin/env bash
# Wheels of lopt's `bench` extra (transformers, matplotlib and their dependencies) for an offline GPU
# machine, in .whl/ (git-ignored; carry it). PY: the device's Python version (default 3.12).
# numpy is left out: the device has it (lopt needs it), and without it the wheels fit the 64 MiB carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
rm -rf .whl
python3 -m pip download --quiet --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl transformers matplotlib
rm -f .whl/numpy-*.whl
if ls .whl | grep -q '^torch-'; then echo "a torch wheel was downloaded: remove it" >&2; exit 1; fi
du -sh .whl
