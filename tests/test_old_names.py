"""Names renamed for one vocabulary (README "Glossary", last column) still work and give what the
new names give; none of them warns."""

from __future__ import annotations

import warnings

import pytest
import torch

import ragged as rg
from ragged import fsdp, parallel, spec

MESH = spec.Mesh((1, 2), ("dp", "ep"))
PARAMS = {"router": torch.arange(8.0).view(2, 4), "experts": torch.arange(32.0).view(2, 4, 4)}
SPECS = {"router": None, "experts": {"ep": spec.Shard(0)}}


@pytest.fixture(autouse=True)
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_mesh_plan_names():
    mplan = spec.make_mesh_plan(PARAMS, SPECS, mesh=MESH)
    leaf = mplan.leaf("['experts']")
    assert leaf.local_shape == leaf.part_shape == (1, 4, 4)
    assert mplan.local_shapes() == mplan.part_shapes()
    assert [t.shape for t in rg.pytree.leaves(mplan.local_meta())] == [t.shape for t in rg.pytree.leaves(mplan.part_meta())]
    coords = {"dp": 0, "ep": 1}
    assert torch.equal(leaf.local_index(coords), parallel.part_index(leaf, coords))
    old, new = parallel.local_params(mplan, PARAMS, coords), parallel.parts(mplan, PARAMS, coords)
    assert all(torch.equal(old[k], new[k]) for k in PARAMS)


def test_leaf_layout_spec_is_its_granularity():
    plan = rg.make_plan(PARAMS, {"router": spec.Rows(2), "experts": spec.Blocks(2, 4)}, world_size=2)
    assert [l.spec for l in plan.leaves] == [l.granularity for l in plan.leaves] == [spec.Blocks(2, 4), spec.Rows(2)]


def test_muon_unit_is_muon_matrix():
    load = rg.optim.muon_load(rg.make_plan({"w": torch.empty(8, 8)}, world_size=2))
    assert rg.optim.MuonUnit is rg.optim.MuonMatrix
    assert load["units"] == load["assignments"] and isinstance(load["units"][0], rg.optim.MuonMatrix)


def _mesh_old_names(mc):
    mplan = spec.make_mesh_plan(PARAMS, SPECS, mesh=MESH)
    d = parallel.shard(mplan, PARAMS, mc)
    old, new = parallel.gather(d, mc), rg.gather(mplan, d, mc)  # old form: dbuf, mcomm (fsdp_axis "dp")
    same = all(torch.equal(old[k], new[k]) for k in PARAMS)
    also = parallel.gather(d, mc, fsdp_axis="dp")
    same = same and all(torch.equal(also[k], new[k]) for k in PARAMS)
    g = rg.pytree.map(lambda t: torch.full(t.shape, mc.rank + 1.0), parallel.parts(mplan, PARAMS, mc.coords))
    reduced = parallel.reduce_scatter(mplan, g, mc, op="sum", data_axes=("ep",))
    norm_old, norm_new = parallel.global_norm(mplan, reduced, mc), rg.global_norm(mplan, reduced, mc)
    old_groups, new_groups = parallel.step_data_axes(mplan, mc, ("ep",)), parallel.data_groups(mplan, mc, ("ep",))
    pairs = [(c.world_size, r("['router']")) for c, r in old_groups] == [(g.comm.world_size, g.is_replicated("['router']"))
                                                                        for g in new_groups]
    return same, bool(norm_old == norm_new), pairs


def test_parallel_names():
    for same, norms, pairs in parallel.simulate_mesh(MESH, _mesh_old_names):
        assert same and norms and pairs


def _fsdp_old_names(comm):
    params = {"w": torch.arange(12.0).view(6, 2), "b": torch.ones(2)}
    units = fsdp.make_units(params, world_size=2, groups=lambda p: p)
    shards = fsdp.shard(units, params, comm)
    full = fsdp.gather(units, shards, comm)
    group = fsdp.DataGroup(comm, lambda path: path == "['b']")
    old = fsdp.global_norm(units, shards, comm, data_axes=[(comm, group.is_replicated)])
    new = rg.global_norm(units, shards, comm, data_groups=[group])
    loss_fn = lambda p, x: (x @ p["w"].T + p["b"].sum()).square().mean()  # noqa: E731
    opt = rg.optim.sgd(0.1)
    step = fsdp.make_step(units, loss_fn, opt, comm, data_axes=[(comm, group.is_replicated)])
    _, metrics = step(fsdp.TrainState(shards, opt.init(shards)), torch.ones(2, 2))
    return (all(torch.equal(full[k], params[k]) for k in params), bool(old == new), step.data_axes == step.data_groups,
            isinstance(step.data_groups[0], fsdp.DataGroup), metrics["loss"] > 0)


def test_fsdp_names():
    for checks in rg.collectives.simulate(2, _fsdp_old_names):
        assert all(checks), checks


def test_both_names_at_once_are_refused():
    units = fsdp.make_units({"w": torch.ones(2, 2)}, world_size=1)
    with pytest.raises(rg.RaggedValueError, match=r"pass data_groups= \(data_axes= is its old name\), not both"):
        fsdp.make_step(units, lambda p, x: p["w"].sum(), rg.optim.sgd(0.1), None,
                       data_groups=[(object(), bool)], data_axes=[(object(), bool)])
