"""One verb, any layout (simulated ranks): ``rg.shard`` / ``rg.gather`` / ``rg.reduce_scatter`` /
``rg.global_norm`` of a ``LayoutPlan``, ``fsdp.Units`` and ``spec.MeshPlan`` equal the per-layout
computations they replace, bit for bit; misuse is refused with the fix."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import fsdp, parallel, spec
from ragged.transforms._gather import gather as gather_plan
from ragged.transforms._reduce_scatter import reduce_scatter as reduce_scatter_plan
from ragged.transforms._shard import shard as shard_plan
from tests.transforms._cases import LAYOUT_SPECS as SPECS
from tests.transforms._cases import equal_trees, layout_grads, layout_params, plan_through_verbs, units_through_verbs


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plan_through_the_verbs(world_size):
    assert all(rg.collectives.simulate(world_size, plan_through_verbs))


@pytest.mark.parametrize("world_size", [1, 2])
def test_units_through_the_verbs(world_size):
    assert all(rg.collectives.simulate(world_size, units_through_verbs))


# The FSDP axis is "fsdp" and comes second: the verbs take it from the mesh plan.
MESH = spec.Mesh((2, 2), ("tp", "fsdp"))


def _mesh_body(mc):
    params = layout_params()
    specs = {"emb": {"tp": spec.Shard(1)}, "w": {"fsdp": spec.Rows(1), "tp": spec.Shard(0)}, "b": None,
             "norm": {"fsdp": spec.Replicate()}}
    mplan = spec.make_mesh_plan(params, specs, mesh=MESH, fsdp_axis="fsdp")
    parts = parallel.parts(mplan, params, mc.coords)
    d = rg.shard(mplan, params, mc)
    equal_trees(d, shard_plan(mplan.plan, parts, mc["fsdp"]))
    equal_trees(rg.gather(mplan, d, mc), gather_plan(d, mc["fsdp"]))
    equal_trees(rg.gather(mplan, d, mc), parts)
    g = parallel.parts(mplan, layout_grads(mc.rank), mc.coords)
    equal_trees(rg.reduce_scatter(mplan, g, mc, op="sum"), reduce_scatter_plan(mplan.plan, g, mc["fsdp"], op="sum"))
    want = torch.sqrt(sum((t.double() ** 2).sum() for t in params.values()))
    torch.testing.assert_close(rg.global_norm(mplan, d, mc), want, rtol=1e-12, atol=0)
    return True


def test_mesh_plan_through_the_verbs_on_its_own_fsdp_axis():
    assert all(parallel.simulate_mesh(MESH, _mesh_body))


def test_one_verb_one_name():
    """The verbs live in ``rg`` only: ``fsdp`` and ``parallel`` hold no second name for them."""
    for ns in (fsdp, parallel):
        assert not any(hasattr(ns, verb) for verb in ("shard", "gather", "reduce_scatter", "global_norm")), ns


def _misuse(comm):
    params = layout_params()
    plan = rg.make_plan(params, SPECS, world_size=comm.world_size)
    other = rg.make_plan(params, world_size=comm.world_size)
    units = fsdp.make_units(params, world_size=comm.world_size)
    d = rg.shard(plan, params, comm)
    said = []
    for call in (lambda: rg.shard({"not": "a layout"}, params, comm),
                 lambda: rg.gather(other, d, comm),
                 lambda: rg.shard(units, params, rank=0),
                 lambda: rg.gather(d, params, comm),
                 lambda: rg.reduce_scatter(d, params, comm),
                 lambda: rg.global_norm(plan, rg.shard(other, params, comm), comm),
                 lambda: rg.gather(units, rg.shard(units, params, comm), comm, out=torch.empty(1)),
                 lambda: rg.gather(d, comm, torch.float64),
                 lambda: rg.gather(plan, d, comm, torch.float64),
                 lambda: rg.gather({"not": "a layout"}, d, comm),
                 lambda: rg.gather(plan, d)):
        try:
            call()
            said.append(None)
        except rg.RaggedError as e:
            said.append(str(e))
    return said


def test_misuse_is_refused_with_the_fix():
    said = rg.collectives.simulate(2, _misuse)[0]
    assert "the layout must be a LayoutPlan (rg.make_plan), fsdp.Units (rg.fsdp.make_units) or" in said[0], said[0]
    assert "not of the plan given" in said[1] and "gather(dbuf, comm)" in said[1], said[1]
    assert "rank= is for a LayoutPlan" in said[2], said[2]
    assert "the call is gather(dbuf, comm, *, dtype=None, out=None) (two positional arguments), got 3" in said[3], said[3]
    assert "A DBuffer carries its plan: reduce_scatter(dbuf.plan, ...)" in said[4], said[4]
    assert "grads must be a DBuffer of the plan" in said[5], said[5]
    assert "out= is for one DBuffer of a LayoutPlan" in said[6], said[6]
    # one call shape per type of the first argument; dtype (and op) are keywords, never sniffed
    assert "got 3. With a layout first it is gather(layout, shards, comm); pass a dtype as dtype=." in said[7], said[7]
    assert "gather(layout, shards, comm, *, dtype=None) (three positional arguments)" in said[8], said[8]
    assert "got 4 positional argument(s), the first a LayoutPlan." in said[8], said[8]
    assert "the layout must be a LayoutPlan" in said[9] and said[9].startswith("gather:"), said[9]
    assert "got 2 positional argument(s), the first a LayoutPlan." in said[10], said[10]


def test_positional_op_or_dtype_is_a_type_error():
    plan = rg.make_plan(layout_params(), world_size=1)
    with pytest.raises(TypeError, match="takes 3 positional arguments but 4 were given"):
        rg.reduce_scatter(plan, layout_grads(0), None, "sum")
    with pytest.raises(TypeError, match="takes 2 positional arguments but 3 were given"):
        rg.gather_start(rg.shard(plan, layout_params(), rank=0), None, torch.float64)
