#!/usr/bin/env bash
# Downloads, where pip reaches the registry, the wheels the GPU machine lacks into .gpu-wheels/
# (gitignored), for its Python 3.12 on x86-64; scripts/gpu_check.sh installs them there offline
# (scripts/install_missing.py --only ... --wheels .gpu-wheels: pip --no-index, what is missing
# only). See docs/gpu.md.
#   bash scripts/gpu_wheels.sh        # then: du -sh .gpu-wheels (carried; the device's limit is 64 MiB)
#
# What is missing there: the third-party modules that ragged, its tests and bench/ import
# (torch, optree, numpy, rich, pytest, hypothesis, transformers; peft and safetensors in the
# Hugging Face tests) against the device's package list (the device tool's KINDS.md, read
# 2026-11-17): only optree. Its one requirement, typing-extensions, is there. The version is
# the one this machine's tests run with, so both sides import the same optree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WANT=${GPU_WHEELS:-"optree==$("$PY" -c 'import optree; print(optree.__version__)')"}
rm -rf .gpu-wheels && mkdir -p .gpu-wheels
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu-wheels $WANT
ls -l .gpu-wheels
du -sh .gpu-wheels
