#!/usr/bin/env bash
# The checks that need a CUDA device, as one command on a GPU machine (at most 560 s: its steps' limits), from
# any directory:
#   tests       pytest -m gpu tests/gpu (CPU-vs-CUDA loss parity, bf16, pinned snapshots, fused AdamW
#               restore, compile, FSDP2 in bf16, download deltas applied on the device, Hugging Face
#               models on CUDA, the default local run with evaluation and SFT on the GPU)
#   gpt-350m    benchmarks/learner_throughput.py --preset 350m --precision bf16 --seconds 60 (tokens/s, MFU,
#               the learner's overhead against a plain loop on the same model and batches)
#   llama-350m  the same with --hf-arch llama --seconds 30: a transformers Llama of that size (the overhead
#               test on a Hugging Face model, issue 27's GPU tier)
#
#   bash benchmarks/device_checks.sh [STEP ...]      # default: all three, in that order
#
# The machine needs PyTorch with CUDA and the packages this project imports; it needs no network. Wheels in
# .whl/ (`benchmarks/device_wheels.sh`, fetched beforehand where PyPI is reachable: this project's pins of
# transformers, tokenizers and prometheus-client) are installed into a private directory ahead of the
# machine's own packages; its PyTorch is used as it is, and versions.json says which. Each step runs under
# its own time limit and a failing step does not stop the next. Everything lands in $OUT (default
# ./device-out), at most 7 files: versions.json, nvidia-smi.txt, STEP.log per step, tests.xml (pytest's
# junit XML) and summary.json (each step's exit status, seconds and, for a benchmark, its JSON result line).
# Exit status: how many steps failed.
#
# DEVICE_CHECKS_QUICK=1 runs the same steps at tiny sizes for a few seconds on whatever device there is: a
# check of this script and of the installed packages before spending GPU time, not a measurement.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/device-out}
py=${PYTHON:-python3}
quick=${DEVICE_CHECKS_QUICK:-0}
declare -A limit=([tests]=250 [gpt-350m]=180 [llama-350m]=130)  # 560 s: one call of at most 600 s
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests gpt-350m llama-350m)
for step in "${steps[@]}"; do
  if [ -z "${limit[$step]:-}" ]; then
    echo "error: unknown step $step (choose tests, gpt-350m, llama-350m)" >&2
    exit 102
  fi
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d /tmp/ddiloco-site.XXXXXX)
  trap 'rm -rf "$site"' EXIT
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl ||
    { echo "error: the wheels in .whl/ did not install (see above)" >&2; exit 100; }
  export PYTHONPATH="$site:$PYTHONPATH"
fi

"$py" - "$out/versions.json" <<'EOF' || { echo "error: PyTorch or this package does not import" >&2; exit 101; }
import json, platform, sys

import safetensors, tokenizers, torch, transformers

import ddiloco  # noqa: F401  (from this checkout)

cuda = torch.cuda.is_available()
v = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "gpu": torch.cuda.get_device_name() if cuda else None,
    "gpus": torch.cuda.device_count() if cuda else 0,
    "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
    "transformers": transformers.__version__,
    "tokenizers": tokenizers.__version__,
    "safetensors": safetensors.__version__,
}
json.dump(v, open(sys.argv[1], "w"), indent=1)
print(json.dumps(v))
EOF

command -v nvidia-smi >/dev/null && nvidia-smi >"$out/nvidia-smi.txt" 2>&1

if [ "$quick" = 1 ]; then
  gpt=(--preset tiny --seconds 3 --repeats 1 --warmup 1)
  llama=("${gpt[@]}")
else  # the Llama measures 30 s: a 350m model's setup on the CPU takes ~40 s of its limit
  gpt=(--preset 350m --precision bf16 --seconds 60)
  llama=(--preset 350m --precision bf16 --seconds 30)
fi
failed=0
results=()
for step in "${steps[@]}"; do
  case $step in
    tests) cmd=("$py" -m pytest -m gpu tests/gpu -q -p no:cacheprovider --junitxml "$out/tests.xml") ;;
    gpt-350m) cmd=("$py" benchmarks/learner_throughput.py "${gpt[@]}") ;;
    llama-350m) cmd=("$py" benchmarks/learner_throughput.py "${llama[@]}" --hf-arch llama) ;;
  esac
  echo "== $step: ${cmd[*]} (limit ${limit[$step]} s)"
  t0=$(date +%s)
  timeout --kill-after=15 "${limit[$step]}" "${cmd[@]}" >"$out/$step.log" 2>&1
  rc=$?
  seconds=$(($(date +%s) - t0))
  tail -n 5 "$out/$step.log"
  last=$(grep -E '^\{' "$out/$step.log" | tail -n 1)  # a benchmark's result: its last line
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  echo "== $step: exit $rc after $seconds s"
  results+=("\"$step\": {\"exit\": $rc, \"seconds\": $seconds, \"result\": ${last:-null}}")
done
(IFS=,; printf '{"quick": %s, %s}\n' "$([ "$quick" = 1 ] && echo true || echo false)" "${results[*]}") \
  >"$out/summary.json"
cat "$out/summary.json"
exit "$failed"
