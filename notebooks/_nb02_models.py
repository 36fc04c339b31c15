from build import code, md

NAME = "02_real_model_padding.ipynb"

CELLS = [
    md("""
# Padding on real models: ragged vs FSDP2, FSDP1, ZeRO-3 and Megatron-FSDP

Every FSDP system pads: each rank must hold the same number of elements. How much it pads depends
on its sharding rule. This notebook plans every FSDP unit of Llama-3-70B, GPT-OSS-120B and
DeepSeek-V3-671B (one unit per decoder layer, plus embeddings and head) using **meta tensors**,
so a 671B-parameter model is planned with no memory, and compares ragged's padding with each
peer's rule applied to the same tensors:

| system | rule (W = shard group size) |
|---|---|
| FSDP2 `Shard(0)` | each tensor's dim 0 padded to a multiple of W |
| FSDP1 | one flat buffer, 16-byte start alignment per tensor, padded to a multiple of W |
| ZeRO-3 | each tensor padded to a multiple of W |
| Megatron-FSDP | buffer padded to a multiple of W x lcm(row sizes) |

FSDP1 and ZeRO-3 pad little but cut rows and quantization blocks anywhere; ragged keeps whole
rows (or 16 / 128-row groups) on one rank and still pads little.
"""),
    code("""
import time
import rich
from rich.table import Table
import ragged as rg
from ragged import spec, models

units = {name: models.model_units(name) for name in models.MODELS}
for name, us in units.items():
    kinds = {}
    for u in us:
        kinds[u.kind] = kinds.get(u.kind, 0) + 1
    total = sum(models.unit_numel(u) for u in us)
    print(f"{name:18s} {total / 1e9:7.1f}B parameters in {len(us)} units {kinds}")
"""),
    md("""
## One decoder layer, many shard-group sizes

The table gives padding as a percentage of the unit's parameters for one layer of each model
(DeepSeek-V3: an MoE layer, 782 tensors; GPT-OSS: its fused 3-D expert tensors), for ragged at
three granularities and for each peer.
"""),
    code("""
layer = {"llama3-70b": units["llama3-70b"][1], "gpt-oss-120b": units["gpt-oss-120b"][1],
         "deepseek-v3-671b": units["deepseek-v3-671b"][4]}
sizes = (8, 32, 64, 128, 256, 1024)
for name, unit in layer.items():
    table = Table("", *[f"W={m}" for m in sizes], title=f"{name}: {unit.name} ({unit.kind})", title_justify="left")
    for n in (1, 16, 128):
        row = [rg.make_plan(unit.params, spec.Rows(n), world_size=m).overhead for m in sizes]
        table.add_row(f"ragged rows:{n}", *[f"{x:.2%}" for x in row])
    for peer in spec.PEERS:
        row = [spec.peer_padding(unit.params, m)[peer].overhead for m in sizes]
        table.add_row(peer, *[f"{x:.2%}" for x in row])
    rich.print(table)
"""),
    md("""
Where ragged loses: Llama-3-70B's dimensions are all multiples of 1024, so FSDP2's per-tensor
`Shard(0)` pads nothing, while ragged's single contiguous buffer must make `S` a multiple of the
rows of the tensors it spans more than twice (lcm of 8192 and 28672 at W=1024): up to 2.9% at
rows:1. That is the price of one zero-copy buffer per unit; it is small at moderate W, and it
buys what FSDP2 cannot do: whole rows or blocks per rank on MoE layers without its padding cliffs.
"""),
    md("""
## A picture of it (Figure 11 of the paper, in text)

GPT-OSS-120B fuses its 128 experts into 3-D tensors; FSDP2 pads dim 0 (128 experts) to a multiple
of W, so at W=256 half of its all-gather is padding. Bars are padding in % (capped at 100):
"""),
    code("""
unit = layer["gpt-oss-120b"]
width = 40
for m in (64, 128, 256, 512):
    rows = {"ragged rows:1": rg.make_plan(unit.params, spec.Rows(1), world_size=m).overhead,
            "ragged rows:16": rg.make_plan(unit.params, spec.Rows(16), world_size=m).overhead}
    rows.update({p: v.overhead for p, v in spec.peer_padding(unit.params, m).items()})
    print(f"W={m}")
    for label, x in rows.items():
        bar = "█" * round(min(x, 1.0) * width)
        print(f"  {label:15s} {bar:{width}s} {x:7.2%}")
"""),
    md("""
## When coarse granules cost a lot, and what fixes it

A tensor longer than `2*S` crosses two rank boundaries, so `S` itself must be a multiple of its
granule. With 128-row granules on one Llama-3-70B layer at W=1024, `S` is far below the MLP
weights' size and the padding explodes. Two fixes: a smaller shard group (HSDP: shard over 64,
replicate over 16) or several layers per FSDP unit (larger `S`):
"""),
    code("""
llama_layer = layer["llama3-70b"]
print(f"one layer, W=1024, rows:128: {rg.make_plan(llama_layer.params, spec.Rows(128), world_size=1024).overhead:.1%}")
print(f"one layer, W=64 (HSDP 16 x 64): {rg.make_plan(llama_layer.params, spec.Rows(128), world_size=64).overhead:.1%}")
for k in (4, 16):
    merged = models.model_units("llama3-70b", layers_per_unit=k)[1]
    print(f"{k} layers per unit ({merged.name}), W=1024: {rg.make_plan(merged.params, spec.Rows(128), world_size=1024).overhead:.1%}")
"""),
    md("""
## Planning a whole model is fast

Every unit of DeepSeek-V3 (63 units, 782 tensors per MoE layer) at W=1024; identical layers reuse
one solve, since plans are pure functions of shapes and specs. `python -m ragged plan --model
deepseek-v3-671b --world-size 1024` prints the same study from the command line.
"""),
    code("""
t0 = time.perf_counter()
plans = [rg.make_plan(u.params, spec.Rows(1), world_size=1024) for u in units["deepseek-v3-671b"]]
elapsed = time.perf_counter() - t0
padding = sum(p.padding for p in plans) / sum(p.numel for p in plans)
print(f"{len(plans)} units planned in {elapsed:.2f} s; whole-model padding {padding:.3%}")
"""),
]
