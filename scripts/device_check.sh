#!/usr/bin/env bash
# The device check of issue 20: on a GPU or TPU, about 4 minutes, random
# SmolLM2-135M-shaped weights made on the device (no checkpoint, no tokenizer,
# nothing installed: the package is imported from this checkout). Writes
# device_check.json under --output-dir (default $OUT, else runs/device_check)
# and prints a short summary; exit status 1 when a check fails.
#   scripts/device_check.sh              # on the device
#   scripts/device_check.sh --dry-run    # the same code on CPU, tiny shapes (what CI runs)
# Other flags: --dtype, --impls xla,pallas, --budget-s 240, --tie-gap (python -m eagle_jax.benchmarks.device_check --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
exec "$PY" -m eagle_jax.benchmarks.device_check "$@"
