#!/usr/bin/env bash
# The main job on a fresh CPU machine: install ragged (torch 2.13.0) and train the example GPT
# with the functional FSDP step on 2 gloo ranks (a couple of minutes; no downloads but packages).
#   bash scripts/main.sh                       # defaults embedded in ragged/examples/train.py
#   NPROC=4 bash scripts/main.sh --moe         # any train flag passes through (see --help)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e . 2>&1 | grep -v "Running pip as the 'root' user" || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" -m ragged.examples.train "$@"
