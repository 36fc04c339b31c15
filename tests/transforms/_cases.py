"""Shared cases of the layout-dispatch tests (simulated in ``test_layouts.py``, 2 gloo ranks in
``tests/distributed/test_fsdp_gloo.py``): each layout through the one verb equals the
per-layout computation it replaces, bit for bit."""

from __future__ import annotations

import torch

import ragged as rg
from ragged import fsdp, spec
from ragged.transforms._gather import gather as gather_plan
from ragged.transforms._reduce_scatter import reduce_scatter as reduce_scatter_plan
from ragged.transforms._shard import shard as shard_plan


def layout_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"emb": r(7, 4), "w": r(6, 4), "b": r(4), "norm": r(4)}


LAYOUT_SPECS = {"emb": spec.Rows(1), "w": spec.Rows(2), "b": None, "norm": spec.Replicate()}


def layout_grads(rank):
    return {k: v * (rank + 1) + 0.5 for k, v in layout_params(1).items()}


def equal_trees(a, b):
    la, lb = rg.pytree.leaves(a, is_leaf=lambda x: isinstance(x, rg.DBuffer)), rg.pytree.leaves(
        b, is_leaf=lambda x: isinstance(x, rg.DBuffer))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, rg.DBuffer):
            assert x.plan == y.plan and x.rank == y.rank
            x, y = (x.data, x.replicated), (y.data, y.replicated)
        else:
            x, y = (x,), (y,)
        for s, t in zip(x, y):
            assert torch.equal(s, t)


def plan_through_verbs(comm):
    params = layout_params()
    plan = rg.make_plan(params, LAYOUT_SPECS, world_size=comm.world_size)
    d = rg.shard(plan, params, comm)
    equal_trees(d, shard_plan(plan, params, comm))
    equal_trees(rg.gather(plan, d, comm), gather_plan(d, comm))
    equal_trees(rg.gather(d, comm), gather_plan(d, comm))  # the contract's form
    equal_trees(rg.gather(d, comm, dtype=torch.float32), gather_plan(d, comm, dtype=torch.float32))
    g = layout_grads(comm.rank)
    equal_trees(rg.reduce_scatter(plan, g, comm, op="sum"), reduce_scatter_plan(plan, g, comm, op="sum"))
    norm = rg.global_norm(plan, d, comm)
    want = torch.sqrt(sum((t.double() ** 2).sum() for t in params.values()))
    torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(norm, rg.optim.tree_norm(d, comm=comm), rtol=1e-12, atol=0)
    return True


def units_through_verbs(comm):
    params = layout_params()
    units = fsdp.make_units(params, world_size=comm.world_size, groups=lambda p: "vectors" if p in ("['b']", "['norm']")
                            else "matrices", specs=lambda p, t: LAYOUT_SPECS[p[2:-2]])
    trees = units.split(params)
    shards = rg.shard(units, params, comm)
    equal_trees(shards, {u.name: shard_plan(u.plan, trees[u.name], comm) for u in units})
    full = rg.gather(units, shards, comm)
    equal_trees(full, units.merge({u.name: gather_plan(shards[u.name], comm) for u in units}))
    equal_trees(full, params)
    g = layout_grads(comm.rank)
    gtrees = units.split(g)
    reduced = rg.reduce_scatter(units, g, comm, op="mean")
    equal_trees(reduced, {u.name: reduce_scatter_plan(u.plan, gtrees[u.name], comm, op="mean") for u in units})
    torch.testing.assert_close(rg.global_norm(units, reduced, comm), rg.optim.tree_norm(reduced, comm=comm),
                               rtol=1e-12, atol=0)
    return True
