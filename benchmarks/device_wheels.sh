#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels `benchmarks/device_checks.sh` installs on a GPU machine
# that reaches nothing: the pinned versions (pyproject.toml) of the packages this project imports whose
# version on a stock CUDA image with PyTorch, transformers and tokenizers may differ. PyTorch itself is not
# among them (its CUDA build is several GB): the checks run on the GPU machine's own PyTorch and say which.
#
#   bash benchmarks/device_wheels.sh [DIR]        # default .whl/ (git-ignored); ~17 MB, for CPython 3.12 x86-64
#
# Pure-Python and abi3 wheels only, so they install on any CPython ≥ 3.10 there.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
pin() { grep -oE "\"$1==[^\"]+\"" pyproject.toml | head -1 | tr -d '"'; }
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" "$(pin transformers)" "$(pin tokenizers)" "$(pin prometheus-client)"
ls -l "$dir"
