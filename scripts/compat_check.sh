#!/usr/bin/env bash
# The whole suite on another torch of the supported range, in a Python 3.12 venv (docs/gpu.md).
# Not part of CI: the registry's Linux torch wheel is the CUDA build (a few GB; it runs on the CPU).
#   bash scripts/compat_check.sh [VERSION] [PYTEST ARGS...]    # VERSION default 2.11.0
#   COMPAT_DIR=/tmp/ragged-compat (venvs and logs; reused when run again)
# Steps, each timed:
#   1. the venv (pyenv's Python 3.12.1) with torch==VERSION and the GPU machine's packages but no
#      optree, as on that machine (the device tool's KINDS.md);
#   2. the GPU check's set-up reproduced: scripts/gpu_wheels.sh, the size of what the device call
#      would carry (the working tree + .gpu-wheels; limit 64 MiB), then
#      scripts/gpu_check.sh --dry-run with that venv's Python: optree installed from the carried
#      wheels offline (install_missing.py --only ... --wheels), every stage started tiny on the CPU;
#   3. scripts/test.sh with that Python (install_missing.py adds optree, the test extra and
#      ragged itself), the whole suite; its last line is the passed / failed / skipped count.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-2.11.0}
shift || true
DIR=${COMPAT_DIR:-/tmp/ragged-compat}
VENV=$DIR/py3.12-torch$V
PY=$VENV/bin/python
LOG=$DIR/compat-$V.log
mkdir -p "$DIR"
T0=$SECONDS
say() { echo "compat_check [$((SECONDS - T0)) s]: $*" | tee -a "$LOG"; }
: > "$LOG"
unset PYTHONPATH

[[ -x $PY ]] || PYENV_VERSION=${PYENV_PY:-3.12.1} python3.12 -m venv "$VENV"
"$PY" -m pip install -q --disable-pip-version-check "torch==$V" numpy rich safetensors "transformers>=5" peft \
    pytest hypothesis "setuptools>=68" >> "$LOG" 2>&1
"$PY" -m pip uninstall -q -y optree >> "$LOG" 2>&1 || true
if "$PY" -c "import optree" 2> /dev/null; then say "error: optree is still importable in $VENV"; exit 1; fi
say "1. venv $VENV: $("$PY" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")'), no optree"

bash scripts/gpu_wheels.sh >> "$LOG" 2>&1
carried=$( (git ls-files -co --exclude-standard -z; find .gpu-wheels -type f -print0) | du -cb --files0-from=- | tail -n 1 | cut -f1)
say "2. what the device call carries (working tree + .gpu-wheels): $((carried / 1024)) KiB of 65536 KiB"
if ((carried >= 64 * 1024 * 1024)); then say "error: over the device tool's 64 MiB"; exit 1; fi
rm -rf "$DIR/gpu-dry-run-$V"
if PYTHON=$PY bash scripts/gpu_check.sh --dry-run "$DIR/gpu-dry-run-$V" >> "$LOG" 2>&1; then
    say "2. gpu_check.sh --dry-run passed ($DIR/gpu-dry-run-$V: $(ls "$DIR/gpu-dry-run-$V" | tr '\n' ' '))"
else
    say "2. gpu_check.sh --dry-run FAILED (rc $?); see $LOG"; dry_failed=1
fi

set +e
PYTHON=$PY bash scripts/test.sh "$@" 2>&1 | tee "$DIR/suite-$V.log" | tail -n 40 >> "$LOG"
rc=${PIPESTATUS[0]}
set -e
say "3. the suite (rc $rc): $(tail -n 1 "$DIR/suite-$V.log")"
say "disk: venv $(du -sh "$VENV" | cut -f1), pip cache $(du -sh "$(PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip cache dir)" 2>/dev/null | cut -f1)"
say "total $((SECONDS - T0)) s; log: $LOG, suite log: $DIR/suite-$V.log"
exit $((rc != 0 || ${dry_failed:-0}))
