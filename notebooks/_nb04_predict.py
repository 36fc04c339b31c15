from build import code, md

NAME = "04_predict_at_scale.ipynb"

CELLS = [
    md("""
# Memory and step time at 1K .. 10K devices, before you have them

A ragged training step *lowers* on abstract inputs (`step.lower()`, like `jax.jit(f).lower(...)`):
no processes, no memory, any world size. `python -m ragged plan --predict` does it for a bundled
model and reports, per rank:

* **derived from the step** (exact against real steps in `tests/predict/test_lower.py`): the
  persistent state by category, every collective's calls and bytes, the runtime's buffers at
  each point of the program;
* **assumed, and labelled so in the output**: the model's activations (an analytic estimate from
  Korthikanti et al. 2022, with or without full recomputation) and the hardware the step time is
  priced on (H100 SXM peak, an MFU, NVLink / InfiniBand bandwidths, NCCL's ring latency model).
  Every constant is a command-line option; none of them is a measurement.

Here: GPT-OSS-120B (36 MoE layers of 128 experts, top-4), fp32 master weights, bf16 gathers,
AdamW, 1 x 4096 tokens per rank, activation checkpointing, from 1,024 to 10,240 ranks as one FSDP
shard group (`fsdp`) and as 8 replica groups (`hsdp:8`, HSDP). One command lowers all ten
configurations and ranks those that fit 40 GiB per device (`--sweep --memory 40`).
"""),
    code("""
import json
import subprocess
import sys

import rich
from rich.bar import Bar
from rich.table import Table

sizes = [1024, 2048, 4096, 8192, 10240]
cmd = [sys.executable, "-m", "ragged", "plan", "--model", "gpt-oss-120b", "--world-size", *map(str, sizes),
       "--predict", "--mesh", "fsdp", "hsdp:8", "--dtype", "fp32", "--checkpointing",
       "--sweep", "--memory", "40", "--json"]
sweep = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
rows = sorted(sweep["ranked"] + sweep["dropped"], key=lambda r: (r["mesh"], r["world_size"]))
print("python -m ragged", " ".join(cmd[3:]))
print(f"{len(rows)} configurations, lowered in {sum(r['build_seconds'] + r['lower_seconds'] for r in rows):.1f} s")
"""),
    md("""
## Memory and step time vs world size

Per rank. The persistent state (parameter shards and AdamW's moments) shrinks as 1/W of the shard
group; the peak adds the gathered units, the gradient buffers and the activations, which do not
shrink with W (every rank computes on full layers and its own 4096 tokens). The step time is
`lowered.estimate_time(...)`: compute from the model's flops, collectives on an alpha-beta link
per mesh axis, overlapped in the program's issue order.
"""),
    code("""
gib = 2**30
top_mem = max(r["peak_bytes"] for r in rows) / gib
top_time = max(r["time"]["seconds"] for r in rows)
chart = Table("W", "mesh", "persistent GiB", "", "peak GiB", "", "step s", "",
              title="gpt-oss-120b per rank (bars: memory against the largest peak, time against the slowest step)", title_justify="left")
for r in rows:
    state, peak, seconds = r["persistent_bytes"] / gib, r["peak_bytes"] / gib, r["time"]["seconds"]
    chart.add_row(f"{r['world_size']:,}", r["mesh"], f"{state:.2f}", Bar(top_mem, 0, state, width=16, color="green"),
                  f"{peak:.2f}", Bar(top_mem, 0, peak, width=16, color="yellow"),
                  f"{seconds:.2f}", Bar(top_time, 0, seconds, width=16, color="red"))
rich.print(chart)
"""),
    md("""
## Where the step's time goes

`compute` is the flops at peak x MFU; the collectives' columns are the time each kind keeps its
link busy; `exposed` is what compute did not hide. The shard group's link crosses nodes here
(InfiniBand), and its per-call latency grows with the group (a ring of `n` ranks takes `n - 1`
steps): that is what HSDP's smaller shard group saves, at the price of 8x the state per rank.
"""),
    code("""
parts = Table("W", "mesh", "step s", "compute s", "all-gather s", "reduce-scatter s", "all-reduce s", "exposed s",
              "shard link alpha ms", title="the step's parts (ASSUMED hardware)", title_justify="left")
for r in rows:
    t = r["time"]
    parts.add_row(f"{r['world_size']:,}", r["mesh"], f"{t['seconds']:.2f}", f"{t['compute']:.2f}",
                  *(f"{t['comm'].get(k, 0.0):.2f}" for k in ("all_gather", "reduce_scatter", "all_reduce")),
                  f"{t['exposed_comm']:.2f}", f"{t['links']['shard']['alpha'] * 1e3:.2f}")
rich.print(parts)
"""),
    md("""
## Which configuration to run on 40 GiB per device

The same run ranked the configurations whose predicted peak fits the budget, fastest predicted
step first (ties broken by memory):
"""),
    code("""
for i, r in enumerate(sweep["ranked"], 1):
    print(f"{i:2d}. W={r['world_size']:>6,} {r['mesh']:7s} step {r['time']['seconds']:6.2f} s, "
          f"peak {r['peak_bytes'] / gib:6.2f} GiB")
for r in sweep["dropped"]:
    print(f"dropped: W={r['world_size']:,} {r['mesh']}: peak {r['peak_bytes'] / gib:.2f} GiB > 40 GiB")
"""),
    md("""
## What those numbers assume

Every line below is printed by the command too; change any constant with its option
(`--peak-tflops`, `--mfu`, `--ib-bandwidth`, `--seq-len`, ... see `python -m ragged plan --help`).
"""),
    code("""
for line in rows[0]["assumed"]:
    print("-", line)
"""),
]
