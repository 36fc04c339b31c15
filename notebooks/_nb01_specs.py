from build import code, md

NAME = "01_specs_and_layouts.ipynb"

CELLS = [
    md("""
# Specs and layouts: what a ragged layout does, before you spend a cluster on it

ragged shards a model's parameters like FSDP / ZeRO-3: every rank keeps 1/m of them and gathers the
rest when needed. Unlike FSDP2's even `Shard(0)` or ZeRO-3's flat element cut, ragged lets you say
**what must stay whole** on one rank (an element, k rows, a 32x32 quantization tile) and then plans
all tensors of one unit into **one flat communication buffer** so that no such block is ever cut.

This notebook composes sharding specs, plans them on a simulated mesh, draws the buffer per rank,
and shows what changes with the granularity and the number of ranks. Everything here is pure:
planning touches no tensor data and communicates nothing.
"""),
    code("""
import torch
import rich
import ragged as rg
from ragged import spec
from ragged.testing import assert_trees_all_close

torch.manual_seed(0)
params = {
    "attn": {"qkv": torch.randn(192, 64), "out": torch.randn(64, 64)},
    "mlp": {"up": torch.randn(256, 64), "down": torch.randn(64, 256)},
    "norm": torch.randn(64),
}
{k: {kk: tuple(v.shape) for kk, v in d.items()} if isinstance(d, dict) else tuple(d.shape) for k, d in params.items()}
"""),
    md("""
## The default: row granularity

With no specs, every leaf may be cut between rows (`spec.Rows(1)`; a row is the last dimension,
a 1-D tensor has one element per row). `make_plan` orders the leaves (key-sorted tree order, or a
better order it finds), places each at an aligned offset and picks the smallest shard size `S`
for which no row is cut. `plan.padding` counts the zero elements that this costs.
"""),
    code("""
plan = rg.make_plan(params, world_size=4)
rich.print(plan)
"""),
    md("""
`rg.visualize` draws each rank's `S` elements, one colour per leaf (`·` is padding), like
`jax.debug.visualize_array_sharding`:
"""),
    code("""
rich.print(rg.visualize(plan))
"""),
    md("""
## Composing spec trees

A spec tree is a pytree **or a prefix** of the parameter tree: one spec for a whole subtree, or a
spec per leaf. Here attention weights are cut at 4-row granularity, the MLP keeps 8x8 tiles whole
(`Blocks(8, 8)`: what a block-wise quantizer or optimizer needs), one leaf gets an override, and
the norm is replicated on every rank (outside the sharded buffer).
"""),
    code("""
specs = {
    "attn": spec.Rows(4),
    "mlp": {"up": spec.Blocks(8, 8), "down": spec.Rows(16)},   # per-leaf override inside the subtree
    "norm": spec.Replicate(),
}
plan = rg.make_plan(params, specs, world_size=4)
rich.print(rg.visualize(plan, details=True))
"""),
    md("""
Every rank holds exactly `S` elements, each leaf is contiguous in the global buffer, and no
granule crosses a rank boundary. These are invariants of every plan; we can check them directly:
"""),
    code("""
S = plan.shard_size
for leaf in plan.leaves:
    cuts = [k * S - leaf.offset for k in range(1, plan.world_size) if leaf.offset < k * S < leaf.stop]
    assert all(c % leaf.granule == 0 for c in cuts)
    print(f"{leaf.path:18s} shape={str(leaf.shape):9s} granule={leaf.granule:4d} cut at elements {cuts}")
print("replicated:", [l.path for l in plan.replicated])
"""),
    md("""
## Granularity and world size

Coarser granules and more ranks both cost padding: a leaf longer than `2*S` crosses two rank
boundaries, so `S` itself must be a multiple of its granule. The table shows the padding of the
same parameters for several granularities and world sizes; `naive` is plain concatenation (what
DeepSpeed / FSDP1 do), which pads least but cuts blocks.
"""),
    code("""
from rich.table import Table

table = Table("granularity", *[f"m={m}" for m in (2, 4, 8, 16)], title="padding (% of parameters)")
for name, g in [("Elements(1)", spec.Elements(1)), ("Rows(1)", spec.Rows(1)), ("Rows(8)", spec.Rows(8)),
                ("Blocks(16, 16)", spec.Blocks(16, 16))]:
    cells = []
    for m in (2, 4, 8, 16):
        p = rg.make_plan(params, {"attn": g, "mlp": g, "norm": spec.Rows(1)}, world_size=m)
        cells.append(f"{p.overhead:.1%}")
    table.add_row(name, *cells)
naive = [rg.make_plan(params, spec.Rows(1), world_size=m, strategy="naive") for m in (2, 4, 8, 16)]
table.add_row("naive concat", *[f"{p.overhead:.1%} ({p.split_blocks} rows cut)" for p in naive])
rich.print(table)
"""),
    md("""
## Sharding for real, on a simulated mesh

`rg.collectives.simulate(m, fn)` runs `fn(comm)` on m threads of this process, each with its own
rank: the same code that runs under `torchrun` with gloo or NCCL. `rg.shard` keeps this rank's
`S` elements in a `DBuffer`; `dbuf.views()` gives its pieces of every leaf, rows kept as rows, as
zero-copy views; `rg.gather` all-gathers one flat buffer and returns full tensors that are views
into it.
"""),
    code("""
plan = rg.make_plan(params, specs, world_size=4)

def round_trip(comm):
    local = rg.shard(plan, params, comm)
    pieces = {path: tuple(v.shape) for path, v in zip(*rg.pytree.flatten_with_path(local.views())[:2]) if v.numel()}
    full = rg.gather(local, comm)
    same_storage = full["attn"]["qkv"].untyped_storage().data_ptr() == full["mlp"]["up"].untyped_storage().data_ptr()
    return local.data.numel(), pieces, same_storage, full

results = rg.collectives.simulate(4, round_trip)
for rank, (n, pieces, shared, _) in enumerate(results):
    print(f"rank {rank}: {n} elements, pieces {pieces}, gathered leaves share one buffer: {shared}")
for _, _, _, full in results:
    assert_trees_all_close(full, params)
print("gather(shard(params)) == params on every rank")
"""),
    md("""
## When a spec does not fit

Errors name the key path, the shape, the rule and the fix, and they are raised while planning,
before any communication:
"""),
    code("""
for bad_specs in ({"attn": spec.Rows(4), "mlp": spec.Rows(1), "norm": spec.Blocks(4, 4)},
                  {"attn": spec.Rows(4), "mlp": spec.Rows(1)}):
    try:
        rg.make_plan(params, bad_specs, world_size=4)
    except (ValueError, TypeError) as err:
        print(type(err).__name__ + ":", err, "\\n")
"""),
]
