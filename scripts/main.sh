#!/usr/bin/env bash
# The main job: install what is missing (scripts/install_missing.py: torch==2.13.0 only when there
# is no torch at all; a torch inside >=2.11,<2.15 you have is kept), then train the example GPT with the
# functional FSDP step on 2 gloo ranks (a couple of minutes). It ends with a verdict line and
# exits 1 when the loss did not fall.
#   bash scripts/main.sh                       # defaults embedded in ragged/examples/train.py
#   NPROC=4 bash scripts/main.sh --moe         # any train flag passes through (see --help)
#   PYTHON=/tmp/v/bin/python bash scripts/main.sh                             # another interpreter / venv
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/main.sh  # CPU-only torch when missing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" scripts/install_missing.py
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout, whatever ragged is installed
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m ragged train --nproc-per-node "${NPROC:-2}" "$@"
