#!/usr/bin/env bash
# The prepared check for a machine with one CUDA GPU (issue 18), in well under 8 minutes:
#   1. the CUDA tests (pytest -m cuda): W=1 NCCL through the real step against torch.optim.AdamW
#      in float64, the collectives on their own streams, the same result without side streams,
#      bf16 compute with fp32 reductions, the fake-process-group memory harness on the GPU;
#   2. bench/step.py at W=1 on CUDA (NCCL): ragged vs FSDP2 vs unsharded, step time (paired
#      ratios with bootstrap CIs) and peak allocated / reserved memory, fp32 and bf16;
#   3. bench/memory.py: one rank's peak memory at W=8 on torch's fake process group, on the GPU
#      (dense, moe, moe-few; activation checkpointing on and off);
#   4. everything as JSON and markdown under OUTDIR (summary.json, summary.md, per-stage logs).
# Every stage runs under its own time limit; a failing stage does not stop the others; the exit
# status is non-zero if any failed.
#   bash scripts/gpu_check.sh OUTDIR             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run [OUTDIR] # on the CPU: every piece starts, tiny sizes, no CUDA
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT=${1:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ $DRY == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA device here; run it on the GPU machine, or check the pieces with --dry-run" >&2
    exit 2
fi
: > "$OUT/stages.jsonl"

stage() {  # stage NAME SECONDS COMMAND...: runs COMMAND with a time limit, logs to OUT/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 3 "$OUT/$name.log" | sed 's/^/   /'
    printf '{"stage": "%s", "rc": %d, "seconds": %d, "command": "%s"}\n' "$name" "$rc" "$((SECONDS - t0))" "$*" \
        >> "$OUT/stages.jsonl"
    echo "   -> rc=$rc in $((SECONDS - t0)) s"
}

if [[ $DRY == 1 ]]; then  # the same pieces, sized for a CPU in about a minute
    stage cuda-tests 300 "$PY" -m pytest -q -m cuda -rs tests --junitxml "$OUT/cuda-tests.xml" -p no:cacheprovider
    stage step-fp32 200 "$PY" bench/step.py --model tiny --world 1 --repeats 2 --warmup 1 --backend gloo \
        --json "$OUT/step.jsonl" --markdown
    stage memory 300 "$PY" bench/memory.py --models tiny --world 8 --checkpointing on --warmup 1 \
        --json "$OUT/memory.jsonl" --markdown
else
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
    stage cuda-tests 150 "$PY" -m pytest -q -m cuda -rs tests --junitxml "$OUT/cuda-tests.xml" -p no:cacheprovider
    stage step-fp32 90 "$PY" bench/step.py --model dense --world 1 --repeats 9 --warmup 2 \
        --json "$OUT/step.jsonl" --markdown
    stage step-bf16 90 "$PY" bench/step.py --model dense --world 1 --repeats 9 --warmup 2 --policy bf16 \
        --json "$OUT/step.jsonl" --markdown
    stage memory 240 "$PY" bench/memory.py --models dense moe moe-few --world 8 --checkpointing on off --warmup 1 \
        --json "$OUT/memory.jsonl" --markdown
fi
stage report 60 "$PY" scripts/gpu_report.py "$OUT" --dry-run $DRY
cat "$OUT/summary.md" 2>/dev/null | head -n 60
! grep -q '"rc": [1-9]' "$OUT/stages.jsonl"
