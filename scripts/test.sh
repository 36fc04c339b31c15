#!/usr/bin/env bash
# Installs ragged with its test extras (CPU torch 2.13.0) and runs the whole suite:
# unit, property, doctest, multi-process gloo tests and notebooks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 2>&1 | grep -v "Running pip as the 'root' user" || true
python3 -m pip install -q -e '.[test]' 2>&1 | grep -v "Running pip as the 'root' user" || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python3 -m pytest -q "$@"
