"""The performance page, from the benchmarks' own JSON: record a run, render ``docs/performance.md``.

``record`` runs one benchmark command with ``--json`` added, and writes what it produced to
``bench/results/NAME.json`` together with where it ran: the commit (and whether ``ragged/`` or
``bench/`` had uncommitted changes), the CPU count, the torch and Python versions, the command
and the date. ``render`` turns every committed result into its tables, each under one header
line naming commit, machine, command and date; the prose of the page lives here, next to the
renderers, and quotes no figure that is not in a table. ``tests/bench/test_report.py`` checks
that ``docs/performance.md`` is exactly this script's output for the committed results.

Usage::

    python3 bench/report.py record plan -- python3 bench/plan.py --world-sizes 1024 --strategies dp auto
    python3 bench/report.py render            # writes docs/performance.md
    python3 bench/report.py render --check    # exit 1 when docs/performance.md is not up to date

A result's renderer is chosen by the benchmark script in its command (``bench/plan.py`` ->
:func:`plan_tables`); a result with no renderer is an error, not a silent omission.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "bench", "results")
PAGE = os.path.join(ROOT, "docs", "performance.md")
OPTIMIZERS_PAGE = os.path.join(ROOT, "docs", "optimizers.md")  # its SOAP / Shampoo tables: a block (below)
QUANTIZATION_PAGE = os.path.join(ROOT, "docs", "quantization.md")  # its measured tables: a block
CHECKPOINT_PAGE = os.path.join(ROOT, "docs", "checkpointing.md")  # the background save's table: a block
BLOCK_END = "<!-- End of the generated tables. -->"


# ---- record ---------------------------------------------------------------------------------
def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


JSON_LINES = {"bench/step.py", "bench/memory.py"}  # their --json appends one object per line (run or cell)


def record(name: str, command: list[str]) -> dict:
    """Runs ``command`` (a benchmark, ``--json PATH`` appended) and returns the result record."""
    import torch

    script = next((a for a in command if a.startswith("bench/") and a.endswith(".py")), None)
    if script is None:
        raise SystemExit(f"record {name}: the command names no bench/*.py script: {shlex.join(command)}")
    commit = _git("rev-parse", "--short=10", "HEAD")  # the code that runs: taken before, checked after
    dirty = _git("status", "--porcelain", "--", "ragged", script)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        started = datetime.datetime.now(datetime.timezone.utc)
        subprocess.run([*command, "--json", out], cwd=ROOT, check=True)
        with open(out) as f:
            text = f.read()
    if script in JSON_LINES:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        data = json.loads(text)
    changed = _git("rev-parse", "--short=10", "HEAD") != commit and _git("diff", "--stat", commit, "--", "ragged", script)
    return {
        "name": name, "script": script, "command": shlex.join(command),
        "commit": commit, "uncommitted_changes": bool(dirty or changed),
        "date": started.date().isoformat(),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "cuda": torch.cuda.is_available()},
        "data": data,
    }


# ---- render: one function per benchmark script -------------------------------------------------
def header(result: dict) -> str:
    """The one line above each table: commit, machine, command, date."""
    m = result["machine"]
    commit = result["commit"] + (" with uncommitted changes" if result["uncommitted_changes"] else "")
    device = "CUDA" if m["cuda"] else "CPU only"
    return (f"*commit `{commit}`, {m['cpus']} CPUs ({device}), torch {m['torch']}, Python {m['python']}; "
            f"`{result['command']}`; {result['date']}*")


def plan_tables(result: dict) -> list[str]:
    """``bench/plan.py``: the planner's time on whole models at the largest m."""
    timing = result["data"]["timing"]  # {"dp llama3-70b rows:1": median seconds, ...}
    cells = result["data"]["cells"]
    m = max(c["m"] for c in cells)
    strategies = list(dict.fromkeys(k.split(" ")[0] for k in timing))
    models = list(dict.fromkeys(k.split(" ")[1] for k in timing))
    grans = list(dict.fromkeys(k.split(" ")[2] for k in timing))
    lines = [f"| whole model, m = {m}, median seconds, " + " / ".join(strategies) + " | " + " | ".join(grans) + " |",
             "|---|" + "---|" * len(grans)]
    for model in models:
        vals = [" / ".join(f"{timing[f'{s} {model} {g}']:.3f}" for s in strategies) for g in grans]
        lines.append(f"| {model} | " + " | ".join(vals) + " |")
    return ["\n".join(lines)]


def padding_tables(result: dict) -> list[str]:
    """``bench/padding.py``: whole-model padding per policy and peer, and per layer kind."""
    from bench.padding import markdown

    rows = result["data"]
    world_sizes = sorted({r["m"] for r in rows})
    whole, kinds = markdown(rows, world_sizes).split("\n\n")
    return [whole, kinds]


def memory_tables(result: dict) -> list[str]:
    """``bench/memory.py``: one rank's peak on the fake process group, per (model, AC, W)."""
    from bench.memory import markdown, row

    return [markdown([row(c["model"], c["checkpointing"], c, c.get("units", "default")) for c in result["data"]])]


def step_tables(result: dict) -> list[str]:
    """``bench/step.py``: one table per run (model, W, policy, optimizer), and where its time goes."""
    from bench.step import markdown, profile_markdown

    return [t for summary in result["data"] for t in (markdown(summary), profile_markdown(summary)) if t]


def parallel_tables(result: dict) -> list[str]:
    """``bench/parallel.py``: FSDP x TP / EP padding on the parts' shapes."""
    lines = ["| model | axis | FSDP granularity | FSDP m | ragged, 1 buffer | ragged, auto | buffers (max) | FSDP2 |",
             "|---|---|---|---|---|---|---|---|"]
    errors = list(dict.fromkeys(r["error"] for r in result["data"] if r["error"]))
    for r in result["data"]:
        if r["error"]:
            lines.append(f"| {r['model']} | {r['axis']} | {r['gran']} | {r['m']} | refused [{errors.index(r['error']) + 1}] "
                         "| - | - | - |")
        else:
            lines.append(f"| {r['model']} | {r['axis']} | {r['gran']} | {r['m']} | {r['1']:.2%} | {r['auto']:.2%} | "
                         f"{r['buffers']} | {r['fsdp2']:.2%} |")
    lines += [""] + [f"[{i}] {e}" for i, e in enumerate(errors, 1)]
    return ["\n".join(lines)]


def quant8_tables(result: dict) -> list[str]:
    """``bench/quant8.py``: 8-bit AdamW state and results at every world size vs the first."""
    lines = ["| W | optimizer | quantization blocks | blocks unlike the first W | state MiB/rank | params: max abs diff | "
             "params changed | state codes equal the first W's |", "|---|---|---|---|---|---|---|---|"]
    for r in result["data"]:
        same = "-" if r["codes_equal"] is None else ("yes" if r["codes_equal"] else "**no**")
        unlike = "-" if r["blocks_unlike"] is None else f"{r['blocks_unlike']:,}"
        lines.append(f"| {r['world']} | {r['optimizer']} | {r['blocks']:,} | {unlike} | "
                     f"{r['state_bytes'] / 2**20:.2f} | {r['max_abs_diff']:.2e} | {r['changed']:.3%} | {same} |")
    return ["\n".join(lines)]


def quant_tables(result: dict) -> list[str]:
    """``bench/quant.py``: bytes and step time per gather / reduce format, or the convergence run."""
    from bench.quant import markdown

    data = result["data"]
    if "convergence" in data:
        c = data["convergence"]
        final = c["final_mean10"]
        return ["| W | steps | fp8 tiles | final loss fp32 (mean of last 10) | fp8 gather + fp8 reduce-scatter | relative |\n"
                "|---|---|---|---|---|---|\n"
                f"| {c['world']} | {c['steps']} | {c['fp8_block'][0]} x {c['fp8_block'][1]} | {final['fp32']:.4f} | "
                f"{final['fp8+rs']:.4f} | {c['rel_diff']:+.2%} |"]
    return [markdown(cell) for cell in data["cells"]]


def optim_tables(result: dict) -> list[str]:
    """``bench/optim.py --sections step``: one optimizer step per method, paired against torch's AdamW
    (``--sections precond-step precond-balance``: :func:`precond_tables`)."""
    d = result["data"]
    if "sections" in d:
        return precond_tables(result)
    lines = [f"| method ({d['numel'] / 1e6:.1f}M fp32 params, {d['leaves']} leaves, {d['device']}, 1 thread, "
             f"{d['iters']} rounds) | ms (median) | paired vs torch foreach [95% CI] | paired vs torch fused [95% CI] | "
             "page faults / step |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        cells = [f"{r[f'paired_{k}']:.2f}x [{r[f'ci_{k}'][0]:.2f}-{r[f'ci_{k}'][1]:.2f}]" for k in ("foreach", "fused")]
        lines.append(f"| {r['method']} | {r['ms']:.1f} | " + " | ".join(cells) + f" | {r['page_faults']:,.0f} |")
    return ["\n".join(lines)]


def predict_time_tables(result: dict) -> list[str]:
    """``bench/predict.py --time``: the step time predicted from W = 1 pieces vs measured on gloo, per model."""
    from bench._predict_time import markdown

    return [table for model in result["data"] for table in markdown(model)]


def import_time_tables(result: dict) -> list[str]:
    """``bench/import_time.py``: ``import ragged`` over ``import torch``, paired, and ``--help``."""
    from bench.import_time import markdown

    return [markdown(result["data"])]


def precond_tables(result: dict) -> list[str]:
    """``bench/optim.py --sections precond-step precond-balance``: SOAP / Shampoo step times and refresh balance."""
    out = []
    for sec in result["data"]["sections"]:
        if sec["section"] == "precond-step":
            lines = [f"| one step, {sec['numel'] / 1e6:.1f}M fp32 params, Blocks({sec['block']}, {sec['block']}), 1 thread "
                     f"| ms (median of {sec['iters']}) | vs rg.optim.adamw (paired) |", "|---|---|---|"]
            lines += [f"| {r['method']} | {r['ms']:.1f} | {r['vs_adamw']:.2f}x |" for r in sec["rows"]]
        elif sec["section"] == "precond-balance":
            lines = [f"| model | optimizer | W | blocks per rank | refresh GFLOP per rank (model) | max / mean | refresh ms "
                     f"per rank (median of {sec['iters']}) | max / mean |", "|---|---|---|---|---|---|---|---|"]
            for r in sec["rows"]:
                ms = [sorted(s)[len(s) // 2] * 1e3 for s in r["seconds"]]
                lines.append(f"| {r['model']} | {r['optimizer']} | {r['world_size']} | {' / '.join(map(str, r['blocks']))} | "
                             f"{' / '.join(f'{f / 1e9:.1f}' for f in r['flops'])} | {r['flops_ratio']:.3f} | "
                             f"{' / '.join(f'{t:.0f}' for t in ms)} | {r['time_ratio']:.3f} |")
        else:
            raise SystemExit(f"bench/optim.py result: no renderer for section {sec['section']!r}")
        out.append("\n".join(lines))
    return out


def background_save_tables(result: dict) -> list[str]:
    """``bench/background_save.py``: a save after every step, in the background and blocking, against none."""
    from bench.background_save import markdown

    return markdown(result["data"])


def convergence_tables(result: dict) -> list[str]:
    """``bench/convergence.py``: steps to reach AdamW's final loss."""
    from bench.convergence import markdown

    return [markdown(result["data"])]


def invariance_tables(result: dict) -> list[str]:
    """``bench/invariance.py``: the chunked step against the default one, and the reductions."""
    from bench.invariance import markdown

    return markdown(result["data"])


RENDERERS = {"bench/invariance.py": invariance_tables, "bench/import_time.py": import_time_tables, "bench/predict.py": predict_time_tables, "bench/plan.py": plan_tables, "bench/padding.py": padding_tables, "bench/memory.py": memory_tables,
             "bench/step.py": step_tables, "bench/parallel.py": parallel_tables, "bench/quant8.py": quant8_tables,
             "bench/quant.py": quant_tables,
             "bench/optim.py": optim_tables, "bench/convergence.py": convergence_tables,
             "bench/background_save.py": background_save_tables}

PRECOND_RESULTS = ["precond", "convergence"]
QUANT_RESULTS = ["quant", "quant-convergence"]
CHECKPOINT_RESULTS = ["checkpoint-background"]
PRECOND_PROSE = """\
`rg.optim.soap` and `rg.optim.shampoo` ([optimizers.md](optimizers.md#soap-and-shampoo)) precondition each
`Blocks(b, b)` tile on the rank that holds it, so a step communicates nothing and a refresh (SOAP: one
power iteration and a QR per side; Shampoo: an eigendecomposition per side) costs O(b^3) per block on its
owner. `bench/optim.py --sections precond-step`: one step on one thread of the fp32 matrices and norms of the
`step` section, each method's refresh steps and other steps timed apart, interleaved with `rg.optim.adamw`
(paired ratios). `--sections precond-balance`: the refresh step of every rank of the dense and MoE GPTs of
`bench/step.py` (one unit per block and the rest): a flop model of every block each rank computes (the zero
slots of batches cut by a rank boundary included) and each rank's `opt.update` timed in one process, rank
after rank (the update communicates nothing, so a rank's time is its own). `bench/convergence.py`: the main
job (`python -m ragged train`, 2 gloo ranks) with AdamW, SOAP and Shampoo, steps until the trailing mean
loss reaches AdamW's final one."""

INVARIANCE_RESULTS = ["invariance"]
INVARIANCE_PROSE = """\
`bench/invariance.py` ([invariance.md](invariance.md)) trains the GPT of `bench/step.py` (AdamW with
global-norm clipping, 2 sequences of 256 tokens per rank in 2 micro-batches) with the default step
(`micro_batches=2`) and the chunked one (`chunks=2 * W`) side by side on the same global batch: one step of
each per repeat, the order alternating, warm-up excluded, times the max over ranks; paired = the median over
repeats of chunked / default in one repeat, with a bootstrap 95% interval. Memory: the largest rise of
allocated bytes during one profiled step of each (in processes of its own), the difference of
`step.lower()`'s peaks (no activations, so only the reduction differs: the chunked step's receive rows and
sums), and the step's `peak_shard_bytes` metric (reduced gradient shards alive at once: the accumulation
buffers), default -> chunked, with whether the lowering predicted it exactly. The second table times one
unit's gradient reduced three ways: gloo's native reduce-scatter, the chunked step's tree (an all-to-all of
the same bytes), and exact int64 sums (twice the bytes and an all-reduce of the max first), which would serve
every world size."""

# The page: (heading, prose before the tables, result names in order). The prose says what is
# measured and how; every figure is in a table.
SECTIONS = [
    ("Padding on real model shapes", """\
What every rank all-gathers on top of the parameters, `(m * per-rank elements - elements) / elements`,
for the bundled models (one FSDP unit per decoder layer, plus embedding and head; bf16; meta tensors,
so no memory): ragged with one buffer per unit (`max_buffers=1`), one buffer per distinct granule
(each planned by `dp`: a baseline the planner's search must not lose to) and `max_buffers="auto"`
(with the buffers it chose: most per unit / total), next to the rules of FSDP2 and Megatron-FSDP
(`rg.spec.peer_padding`; FSDP1 and ZeRO-3 cut rows and blocks anywhere and pad almost nothing).
The second table is the paper's Figure 11 view: the worst layer of each decoder-layer kind, one
buffer / `"auto"`. Deterministic: the same command gives the same table on any machine.
[planning.md](planning.md) explains the cells where coarse granules stay expensive.""", ["padding"]),
    ("Import time", """\
`bench/import_time.py`: fresh interpreters in turn, bytecode cached (as an installed package has
it): `import torch` alone and `import ragged` (torch included), each timed inside the interpreter;
`python -m ragged --help` and `python -c "import torch"` timed from outside. The paired column is
the median over repeats of the difference within one repeat. `torch.compile`'s dynamo and inductor,
DTensor, `torch.distributed.checkpoint`, transformers and safetensors are imported when used, never
by `import ragged` (the last row; tests/test_import.py checks it).""", ["import-time"]),
    ("Planning time", """\
The time to plan every unit of a whole model at the largest shard group, cold caches, one pinned core,
median of the runs, for the default single-buffer planner (`dp`) and for `max_buffers="auto"`. Plans do
not depend on the machine (the search has a deterministic work budget); only their time does.""", ["plan"]),
    ("FSDP x TP / EP padding", """\
Padding of the FSDP plan of each leaf's *part* (what one TP or EP position holds, Megatron-style
placements: experts `Shard(0)` on "ep", column- and row-parallel matrices on "tp"), whole model, one
unit per layer; FSDP2 is `Shard(0)` per parameter on the same part shapes. Deterministic.""", ["parallel"]),
    ("8-bit AdamW: state at every world size", """\
The dense GPT's parameters and the same gradients for a few steps at each world size, with 8-bit AdamW
quantized per local shard (FSDP2 + torchao style: 1024-element blocks of each rank's piece) and with
ragged's `Blocks(32, 32)` (the plan's tiles, which no rank boundary cuts); results compared bit for bit
with the first world size. Deterministic.""", ["quant8"]),
    ("8-bit AdamW: the step against torch's AdamW", """\
One optimizer step on one thread over the same fp32 parameters (four decoder layers at hidden 512,
`Blocks(32, 32)` on the matrices): torch's `AdamW` with `foreach=True` and with `fused=True` on the
per-leaf tensors, and `rg.optim.adamw_8bit` on the DBuffer, functional and with `donate=True` (in
place, as torch's; ours include `apply_updates`). The methods alternate within each round; the
paired ratio is the median over rounds of method / torch's step in the same round, with a bootstrap
95% interval. Page faults: the minor faults of one step, memory paged in fresh. torch's foreach step
allocates its temporaries each time; in this process glibc hands them back to the system between
steps, and how much of that a training process pays depends on its allocator (with
`MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` set high glibc keeps the memory and the foreach
step pays none).""", ["optim-step"]),
    ("Memory at large W: one rank on torch's fake process group", """\
Each cell is two fresh processes (one per method) that join a W-rank fake process group as one rank:
collectives return at once and move no data, every allocation is real. ragged (`rg.fsdp` step, AdamW,
`donate=True`) and FSDP2 (`fully_shard` per block and root, `torch.optim.AdamW`) train the GPT of
`bench/step.py` (batch 2 x 256 tokens per rank, fp32), activation checkpointing of every block in both
when AC is on. Peak = the largest live total of the CPU allocator's events during the measured step,
counted from before the method is built (`bench/_measure.LiveBytes`); state = the live total at the
step's start. "rest / largest block" is the gathered size of the largest non-block unit and of the
largest block; "saved activations" are the unsharded model's tensors saved for backward. MoE routing
depends on values, which the fake group leaves as garbage, so MoE peaks can move slightly.""", ["memory", "memory-large"]),
    ("Training step: ragged vs FSDP2 (gloo, CPU)", """\
`bench/step.py` trains the GPT of `ragged.examples.gpt` (seq 256, batch 2 per rank, AdamW, the same
initial weights and batches for every method) with **ragged** (`rg.fsdp`, every block and the rest as
units, `adamw(donate=True)`, which the step follows), **fsdp2** (`fully_shard` on every block and
the root, `torch.optim.AdamW(foreach=True)`) and **local** (the unsharded model on each rank, no
communication: the compute floor). Each repeat runs one step of every method on the same batch, the
order alternating; warm-up is excluded; times are the max over ranks. The paired ratio is the median
over repeats of ragged / FSDP2 within one repeat (it cancels most of the drift of a shared machine),
with a bootstrap 95% interval. Peak = bytes kept between steps + the largest rise during one profiled
step; copies = host time of the copies made for communication in one profiled step on rank 0. On a
machine shared with other jobs the times are noisy; the memory and byte columns are not. The LoRA
run (`--lora`) fine-tunes the HF Llama with peft's adapters (r=8 on q and v, the base frozen) in
every method; its last line checks ragged's reduce-scatter bytes and optimizer state against what
the adapters alone need. **ragged-nccl-shaped** (`--nccl-shaped`) is the same ragged step over the
transport NCCL uses (`from_torch(handshake="deferred")`: gloo's native
collectives and the deferred ledger instead of the per-call headers), timed in the same repeats;
**ragged-nccl-shaped-p2p** is that deferred step with gloo's native all-gather and reduce-scatter
replaced, in the benchmark only, by the header transport's algorithm (`bench/_raw.py`). Its ratio to
ragged is what the deferred path itself costs; ragged-nccl-shaped / ragged-nccl-shaped-p2p is what
gloo's native collectives cost the host (a clone of the input and a full all-reduce per
reduce-scatter, a staging buffer and a copy-out per all-gather, on the cores that compute, where
NCCL runs its kernels on the GPU). The CPU column counts every thread of a rank's process; "gloo's
threads" is its part on gloo's own threads (the TCP loop, the native collectives' workers).
**local+collectives** (`--floor`) is the unsharded step with every collective of ragged's previous
step replayed beside it, raw, on a thread of its own (`bench/_raw.py`): local+collectives / local is
what moving ragged's bytes costs on cores that all compute, which no schedule or overlap removes on
this machine, and ragged / local+collectives is what ragged adds beyond it (the replay's step still
runs the whole optimizer, which ragged shards). The last table of a run is the console's profile:
CPU and page faults per step, and the exclusive host time of each labelled range in one profiled
step on rank 0 (`ragged::step` is the model's compute with ragged's interception).""",
     ["step", "step-moe", "step-lora"]),
    ("Quantized communication: bytes and step time (gloo, CPU)", """\
`bench/quant.py` ([quantization.md](quantization.md)) runs one step of every method side by side on the
same batch, order alternating, warm-up excluded, times the max over ranks: ragged with an fp32 and a
bf16 gather, with an fp8 (128 x 128 tiles), int8 (32 x 32) and MXFP8 (1 x 32) gather in fp32 compute,
with an fp8 gather plus an fp8 reduce-scatter, and FSDP2 in bf16. Bytes: every torch ProcessGroup call
of one step on rank 0 (ragged over NCCL's transport, so each collective is counted as its kind); the
paired ratio is the median over repeats of the method's time / the fp32 gather's in the same repeat.
The convergence run trains the example GPT (`python -m ragged train`'s model) with fp32 and with an fp8
gather plus an fp8 reduce-scatter on the same batches.""", QUANT_RESULTS),
    ("Step time: predicted before the run vs measured (gloo, CPU)", """\
`bench/predict.py --time` (method: [predict.md](predict.md#step-time-against-the-measured-gloo-step))
predicts the W = 2 and W = 4 step of each model in up to eight configurations from pieces measured
at W = 1 (per-unit forward, backward, optimizer update; the W = 1 collectives' local copies taken
out) and an alpha-beta line fitted on gloo at W (with the share of a collective's time its CPU work
takes), then measures the same steps (each configuration alone, in its own processes); err = (predicted - measured) / measured; Kendall's tau of the
predicted order of the configurations against the measured one. Three ways to treat the
collectives: beside compute (the default of `estimate_time`), holding the compute queue, and
holding it for their CPU share (`overlap=1 - cpu_share`).""", ["predict-time"]),
    ("SOAP and Shampoo: step time, refresh balance, convergence (CPU)", PRECOND_PROSE, PRECOND_RESULTS),
    ("Checkpointing every step in the background (gloo, CPU)", """\
`bench/background_save.py` ([checkpointing.md](checkpointing.md)) trains the GPT of `bench/step.py` with
`rg.fsdp` and AdamW and saves after every step: in the background (`blocking=False`, `result()` after the
last step), blocking, or not at all, each repeat running every method in turn, order alternating, times
the slowest rank's; the paired ratio is the median over repeats of method / no checkpoint within one
repeat. Memory: the rise of rank 0's peak RSS over one step, and over one step and one background save.""",
     CHECKPOINT_RESULTS),
    ("The same numbers at every world size: what chunks= costs (gloo, CPU)", INVARIANCE_PROSE, INVARIANCE_RESULTS),
]


def load_results(directory: str = RESULTS) -> dict[str, dict]:
    out = {}
    for entry in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if entry.endswith(".json"):
            with open(os.path.join(directory, entry)) as f:
                out[entry[: -len(".json")]] = json.load(f)
    return out


def render(results: dict[str, dict]) -> str:
    """The whole page for ``results`` (``{name: record}``); sections whose results are absent are left out."""
    placed = {n for _, _, names in SECTIONS for n in names}
    unplaced = sorted(set(results) - placed)
    if unplaced:
        raise SystemExit(f"bench/results has results no section of bench/report.py places: {unplaced}")
    out = ["# Performance", "",
           "<!-- Generated by `python3 bench/report.py render` from bench/results/*.json; do not edit. -->", "",
           "Every table below is rendered from a benchmark's own JSON output, committed under `bench/results/`",
           "(`python3 bench/report.py record NAME -- COMMAND` ran the command and saved it). The line above each",
           "table says where and how it was measured. Timing tables from a shared CPU machine are noisy; re-run",
           "the command for your own figures. How each quantity is taken: `bench/_measure.py`; the compared",
           "methods: `bench/_methods.py`. Measurements on a GPU: [gpu.md](gpu.md). Predicted against measured",
           "(memory at W = 8..256, the gloo step at W = 2, 4 and the ranking of configurations):",
           "[predict.md](predict.md).", ""]
    for title, prose, names in SECTIONS:
        present = [n for n in names if n in results]
        if not present:
            continue
        out += [f"## {title}", "", prose, ""]
        for name in present:
            result = results[name]
            renderer = RENDERERS.get(result["script"])
            if renderer is None:
                raise SystemExit(f"bench/results/{name}.json: no renderer for {result['script']}")
            for table in renderer(result):
                out += [header(result), "", table, ""]
    return "\n".join(out).rstrip("\n") + "\n"


def block_start(names: list[str]) -> str:
    """The marker that opens a page's generated block of the results ``names``."""
    return f"<!-- Generated by `python3 bench/report.py render` from bench/results ({', '.join(names)}); do not edit. -->"


def render_block(results: dict[str, dict], names: list[str]) -> str:
    """The tables of the results ``names`` for a page of docs/ (SOAP / Shampoo's in optimizers.md, the quantized
    collectives' in quantization.md), between its markers."""
    out = [block_start(names), ""]
    present = [n for n in names if n in results]
    if not present:
        out += ["*Not recorded yet: the commands are above.*", ""]
    for name in present:
        for table in RENDERERS[results[name]["script"]](results[name]):
            out += [header(results[name]), "", table, ""]
    return "\n".join(out + [BLOCK_END])


def with_block(text: str, block: str) -> str:
    """``text`` (a page of docs/) with its generated tables replaced by ``block`` (whose first line is its marker)."""
    start_marker = block.split("\n", 1)[0]
    start, end = text.find(start_marker), text.find(BLOCK_END)
    if start < 0 or end < start:
        raise SystemExit(f"the page lacks the markers {start_marker!r} ... {BLOCK_END!r}")
    return text[:start] + block + text[end + len(BLOCK_END):]


INVARIANCE_PAGE = os.path.join(ROOT, "docs", "invariance.md")  # its measured tables: a block
BLOCK_PAGES = {OPTIMIZERS_PAGE: PRECOND_RESULTS, QUANTIZATION_PAGE: QUANT_RESULTS, CHECKPOINT_PAGE: CHECKPOINT_RESULTS,
               INVARIANCE_PAGE: INVARIANCE_RESULTS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run a benchmark with --json and save bench/results/NAME.json")
    rec.add_argument("name")
    rec.add_argument("command", nargs=argparse.REMAINDER, help="-- python3 bench/SCRIPT.py ARGS")
    ren = sub.add_parser("render", help="write docs/performance.md (and the generated tables of docs/optimizers.md, "
                                        "docs/quantization.md and docs/invariance.md) from bench/results/*.json")
    ren.add_argument("--check", action="store_true", help="do not write: exit 1 when the page is not up to date")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        result = record(args.name, command)
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote bench/results/{args.name}.json")
        return 0
    results = load_results()
    pages = {PAGE: render(results)}
    for path, names in BLOCK_PAGES.items():
        with open(path) as f:
            pages[path] = with_block(f.read(), render_block(results, names))
    for path, text in pages.items():
        if args.check:
            with open(path) as f:
                if f.read() != text:
                    print(f"{os.path.relpath(path, ROOT)} is not the rendering of bench/results: run python3 bench/report.py render")
                    return 1
            continue
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
