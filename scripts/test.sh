#!/usr/bin/env bash
# Install what is missing for ragged and its test extras (scripts/install_missing.py: torch==2.13.0
# only when there is no torch at all; a torch inside >=2.11,<2.15 you have is kept), then run the whole suite:
# unit, property, doctest, multi-process gloo tests, README blocks and notebooks.
#   bash scripts/test.sh                  # what CI runs (.ci/run)
#   bash scripts/test.sh tests/test_cli.py -x     # pytest arguments pass through
#   PYTHON=/tmp/v/bin/python bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" scripts/install_missing.py --extra test
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout (gloo workers and notebook kernels too)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest -q "$@"
