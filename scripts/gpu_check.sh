#!/usr/bin/env bash
# The prepared check for a GPU machine (docs/gpu.md): one command of at most 10 minutes, at most 8
# files back from $OUT. The lent machine: Python 3.12 at /opt/torch/.venv/bin/python3 with torch
# 2.11 and no optree, nothing to fetch; a fresh machine may have torch alone. In priority order,
# so that a cut-off run is still worth it:
#   0. what the stages import and this Python lacks (optree, numpy, rich: ragged's; pytest,
#      hypothesis: the tests'), and only that, installed: from the carried wheels offline
#      (.gpu-wheels/, from scripts/gpu_wheels.sh), then from PyPI (scripts/install_missing.py
#      --only); a stage whose imports are still missing is skipped with a one-line reason. The
#      torch, CUDA, driver and GPU found (env.txt);
#   1. cuda-tests: pytest -m cuda: the training step, the quantized wire and 8-bit AdamW over a
#      real single-rank NCCL communicator, nothing turned into a local copy, the ledger checking,
#      and no host sync in the optimizer update (tests/fsdp/test_nccl_cuda.py); the W=1 NCCL step
#      against float64 torch.optim.AdamW with the collectives' streams on and off, bf16 compute /
#      fp32 reduce, the memory harness on the GPU; quantization and 8-bit AdamW bit for bit
#      against the CPU;
#   1b. cuda-2.11-path: tests/fsdp/test_nccl_cuda.py again on torch 2.11's paths
#      (scripts/as_torch_2_11: the old collective names, no storage swap), where torch is newer;
#      on torch 2.11 cuda-tests ran them;
#   2. step-fp32, step-bf16: bench/step.py at W=1 on NCCL, ragged vs FSDP2 vs unsharded: step time
#      (paired ratios with bootstrap CIs) and peak allocated / reserved memory; ragged runs NCCL's
#      shape there (native collectives + the deferred ledger, its default on NCCL), and the report
#      puts NCCL's shape against FSDP2 first (the dry run adds --nccl-shaped to reach that path on gloo);
#   2b. optim-8bit: bench/optim.py's step section on the GPU, rg.optim.adamw_8bit against torch's
#      foreach and fused AdamW (paired ratios with bootstrap CIs);
#   3. memory: bench/memory.py, one rank's peak at W=8 on torch's fake process group, on the GPU;
#   4. calibrate: bench/calibrate.py, the per-call cost of all-gather / reduce-scatter at W=1 NCCL.
# All stages share one deadline (BUDGET seconds, default 420 on the GPU, 1800 with --dry-run;
# then the report): a stage gets at most its own limit and never more than what is left. A
# failing stage does not stop the others; the exit status is non-zero if any failed (a skipped
# one has not), 3 if none ran. OUTDIR gets five files: gpu-check.tar.gz (every log, JUnit and JSON file;
# re-packed after each stage, so a killed run keeps what was done), stages.jsonl, env.txt,
# summary.json, summary.md. The report says in one line what one GPU cannot test and which
# emulated test stands in for it.
#   bash scripts/gpu_check.sh OUTDIR             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run [OUTDIR] # on the CPU: every piece starts, tiny sizes, no CUDA
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x /opt/torch/.venv/bin/python3 ]]; then PY=/opt/torch/.venv/bin/python3
else PY=python3; fi
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT=${1:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d -t ragged-gpu-check.XXXXXX)
START=$SECONDS
BUDGET=${BUDGET:-$((DRY ? 1800 : 420))}  # the device's: 420 s of stages + the report, in the 540 s call
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ! TORCH=$("$PY" -c "import torch; print(torch.__version__)" 2> "$WORK/imports.log"); then
    echo "gpu_check.sh: $PY has no torch ($(tail -n 1 "$WORK/imports.log")); install one inside ragged's range" \
         "(docs/gpu.md): this script installs what ragged adds to torch, never torch" >&2
    exit 2
fi
# 0. what the stages import and this Python lacks, and only that (see the top)
RUNTIME="optree numpy rich"
TESTS="pytest hypothesis"
# shellcheck disable=SC2086
"$PY" scripts/install_missing.py --extra test --only $RUNTIME $TESTS --wheels .gpu-wheels > "$WORK/install.log" 2>&1
grep -E '^(\+ |still missing)' "$WORK/install.log" | sed 's/^/   /'
lacking() {  # the modules of "$@" this Python cannot import, space-separated
    "$PY" - "$@" <<'PYEOF'
import importlib.util, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False
print(" ".join(m for m in sys.argv[1:] if not found(m)))
PYEOF
}
"$PY" - > "$OUT/env.txt" 2>&1 <<'PYEOF'
import importlib.metadata as md, platform, subprocess, sys
import torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"
print(f"python {platform.python_version()} ({sys.executable}); torch {torch.__version__}; CUDA {torch.version.cuda}; "
      + "; ".join(f"{n} {version(n)}" for n in ("optree", "numpy", "rich", "pytest", "hypothesis", "transformers")))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability "
          f"{p.major}.{p.minor}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        print(f"driver (nvidia-smi): {smi}")
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"driver: nvidia-smi did not answer ({e})")
else:
    print("GPU: none visible to torch")
PYEOF
cat "$OUT/env.txt"
if [[ $DRY == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA device here; run it on the GPU machine, or check the pieces with --dry-run" >&2
    exit 2
fi
cp "$OUT/env.txt" "$WORK/env.txt"
: > "$WORK/stages.jsonl"

pack() {  # everything so far into OUT (atomic: a run killed mid-pack keeps the previous archive)
    cp "$WORK/stages.jsonl" "$OUT/stages.jsonl"
    tar czf "$OUT/.gpu-check.tar.gz" -C "$WORK" --exclude imports.log . && \
        mv "$OUT/.gpu-check.tar.gz" "$OUT/gpu-check.tar.gz"
}

skip() {  # skip NAME REASON: the stage does not run; one line here and in stages.jsonl
    echo "== $1: skipped, $2"
    printf '{"stage": "%s", "rc": 0, "seconds": 0, "skipped": "%s"}\n' "$1" "$2" >> "$WORK/stages.jsonl"
    pack
}

stage() {  # [NEEDS=MODULES] stage NAME SECONDS COMMAND...: runs COMMAND with a time limit (capped by
    # the deadline), or skips it when a module it imports is missing (NEEDS; default: ragged's)
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - (SECONDS - START))) t0=$SECONDS rc lack
    # shellcheck disable=SC2086
    lack=$(lacking ${NEEDS:-$RUNTIME})
    if [[ -n $lack ]]; then
        skip "$name" "it imports $lack, which $PY lacks (not in .gpu-wheels/ and PyPI not reached: install.log)"
        return
    fi
    if ((left < limit)); then limit=$left; fi
    if ((limit < 10)); then
        echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left"
        printf '{"stage": "%s", "rc": 124, "seconds": 0, "command": "skipped: budget spent"}\n' "$name" >> "$WORK/stages.jsonl"
        pack
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    tail -n 3 "$WORK/$name.log" | sed 's/^/   /'
    printf '{"stage": "%s", "rc": %d, "seconds": %d, "command": "%s"}\n' "$name" "$rc" "$((SECONDS - t0))" "$*" \
        >> "$WORK/stages.jsonl"
    echo "   -> rc=$rc in $((SECONDS - t0)) s"
    pack
}

cuda_tests() {  # cuda_tests NAME SECONDS [PYTEST ARGS]: pytest -m cuda, then torch 2.11's paths where torch is newer
    local name=$1 limit=$2; shift 2
    NEEDS="$RUNTIME $TESTS" stage "$name" "$limit" "$PY" -m pytest -q -m cuda -rs tests --junitxml "$W/$name.xml" "$@"
    if [[ $(printf '%s\n' 2.13 "${TORCH%%+*}" | sort -V | head -n 1) == 2.13 ]]; then  # torch >= 2.13
        PYTHONPATH="$ROOT/scripts/as_torch_2_11:$PYTHONPATH" NEEDS="$RUNTIME $TESTS" stage cuda-2.11-path "$((limit / 2))" \
            "$PY" -m pytest -q -m cuda -rs tests/fsdp/test_nccl_cuda.py --junitxml "$W/cuda-2.11-path.xml" "$@"
    else
        skip cuda-2.11-path "torch $TORCH here: $name ran torch 2.11's paths"
    fi
}

W=$WORK
if [[ $DRY == 1 ]]; then  # the same pieces, sized for a CPU
    cuda_tests cuda-tests 300
    stage step-fp32 200 "$PY" bench/step.py --model tiny --world 1 --repeats 2 --warmup 1 --backend gloo \
        --nccl-shaped --json "$W/step.jsonl" --markdown
    stage optim-8bit 200 "$PY" bench/optim.py --sections step --only-8bit --hidden 128 --iters 2 \
        --json "$W/optim-step.json"
    stage memory 300 "$PY" bench/memory.py --models tiny --world 8 --checkpointing on --warmup 1 \
        --json "$W/memory.jsonl" --markdown
    stage calibrate 200 "$PY" bench/calibrate.py --sizes-mib 1 --iters 3 --backend gloo --json "$W/calibrate.jsonl"
else
    nvidia-smi > "$W/nvidia-smi.txt" 2>&1 || true
    cuda_tests cuda-tests 180
    stage step-fp32 75 "$PY" bench/step.py --model dense --world 1 --repeats 9 --warmup 2 \
        --json "$W/step.jsonl" --markdown
    stage step-bf16 75 "$PY" bench/step.py --model dense --world 1 --repeats 9 --warmup 2 --policy bf16 \
        --json "$W/step.jsonl" --markdown
    stage optim-8bit 40 "$PY" bench/optim.py --sections step --only-8bit --device cuda --iters 15 \
        --json "$W/optim-step.json"
    stage memory 100 "$PY" bench/memory.py --models dense moe moe-few --world 8 --checkpointing on off --warmup 1 \
        --json "$W/memory.jsonl" --markdown
    stage calibrate 45 "$PY" bench/calibrate.py --sizes-mib 1 16 256 --iters 20 --json "$W/calibrate.jsonl"
fi
BUDGET=$((BUDGET + 60)) stage report 60 "$PY" scripts/gpu_report.py "$W" --dry-run $DRY
cp "$W/summary.json" "$W/summary.md" "$OUT/" 2>/dev/null
pack
rm -rf "$WORK"
cat "$OUT/summary.md" 2>/dev/null | head -n 80
if ! grep -q '"command"' "$OUT/stages.jsonl"; then
    echo "gpu_check.sh: no stage ran (each one's reason is above and in stages.jsonl)" >&2
    exit 3
fi
! grep -q '"rc": [1-9]' "$OUT/stages.jsonl"
