#!/usr/bin/env bash
# Regenerate the lock files from pyproject.toml with pip-compile (pip-tools), through pip's own configuration
# (its indexes, find-links and constraints: the files the installs will get), for CPython 3.11 on Linux x86_64:
#   requirements/dev.lock       '.[dev]': what .ci/run and the README install (torch: the CPU wheel pip resolves)
#   requirements/syncer.lock    the images' runtime set '.[kfp,lm-eval,data,mlflow]', CPU torch (images/syncer.Dockerfile)
#   requirements/learner.lock   the same set with PyPI's CUDA torch and its nvidia-* wheels (images/learner.Dockerfile)
# Both image locks hold the dev lock's versions (a constraint). Run from anywhere: requirements/lock.sh
# (`-P NAME` / `--upgrade` are passed to the dev lock's pip-compile; tests/unit/test_lock.py checks the result).
set -euo pipefail
cd "$(dirname "$0")/.."
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools/venv"
"$tools/venv/bin/pip" install -q pip-tools==7.6.2
export CUSTOM_COMPILE_COMMAND="requirements/lock.sh"
compile() {
  # ddiloco names itself in its dev extra (ddiloco[kfp], ...): "unsafe" keeps it out of the lock; setuptools
  # (torch needs it at run time) stays in, hashed.
  "$tools/venv/bin/pip-compile" -q --generate-hashes --strip-extras --unsafe-package ddiloco \
    --no-emit-index-url --no-emit-find-links --no-emit-trusted-host "$@" pyproject.toml
}
compile --extra dev --output-file requirements/dev.lock "$@"
# the images: the dev lock's versions; `torch==X` (no local label) lets each index serve its own build of X
grep -E '^[A-Za-z0-9._-]+==' requirements/dev.lock | sed -E 's/ .*//; s/\+[a-z0-9.]+$//' > "$tools/pins.txt"
images=(--extra kfp --extra lm-eval --extra data --extra mlflow --constraint "$tools/pins.txt" --no-annotate)
compile "${images[@]}" --output-file requirements/syncer.lock
# PyPI alone: no pip configuration (files or PIP_* variables) that adds local find-links holding a CPU torch;
# fast-deps reads each wheel's metadata by range requests instead of downloading the CUDA wheels
(
  unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT
  export PIP_CONFIG_FILE=/dev/null
  compile "${images[@]}" --pip-args "--use-feature=fast-deps" --output-file requirements/learner.lock
)
