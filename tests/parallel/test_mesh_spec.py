"""spec.Shard / Mesh / Placements / make_mesh_plan: values, part shapes, and the errors an
incompatible spec raises (before any tensor or communication is touched)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ragged as rg
from ragged import parallel, spec

MESH = spec.Mesh((2, 2), ("dp", "tp"))


def meta(*shape):
    return torch.empty(*shape, device="meta")


def test_values_are_hashable_leaves():
    a = spec.Placements(dp=spec.Rows(1), tp=spec.Shard(0))
    b = spec.Placements({"tp": spec.Shard(0)}, dp=spec.Rows(1))
    assert a == b and hash(a) == hash(b)
    assert spec.Shard(1) != spec.Shard(1, groups=2)
    assert rg.pytree.leaves({"w": a}) == [a]  # a leaf, not a node
    assert hash(MESH) == hash(spec.Mesh((2, 2), ("dp", "tp")))
    assert [MESH.coords(r) for r in range(4)] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert all(MESH.rank(MESH.coords(r)) == r for r in range(4))


def test_dicts_placements_and_bare_specs_plan_alike():
    params = {"w": meta(8, 4), "b": meta(8)}
    as_dict = spec.make_mesh_plan(params, {"w": {"dp": spec.Rows(2), "tp": spec.Shard(0)}, "b": {"tp": spec.Shard(0)}}, mesh=MESH)
    as_obj = spec.make_mesh_plan(
        params, {"w": spec.Placements(dp=spec.Rows(2), tp=spec.Shard(0)), "b": spec.Placements(tp=spec.Shard(0))}, mesh=MESH
    )
    bare = spec.make_mesh_plan(params, {"w": spec.Placements(dp=spec.Rows(2), tp=spec.Shard(0)), "b": spec.Shard(0)}, mesh=MESH)
    assert as_dict == as_obj == bare
    prefix = spec.make_mesh_plan({"layers": [params, params]}, {"layers": spec.Shard(0)}, mesh=MESH)
    assert all(l.part_shape[0] * 2 == l.shape[0] for l in prefix.leaves)


def test_plan_is_make_plan_of_part_shapes():
    params = {"up": meta(64, 16), "down": meta(16, 64), "norm": meta(16)}
    specs = {"up": {"dp": spec.Blocks(8, 16), "tp": spec.Shard(0)}, "down": {"tp": spec.Shard(1)}, "norm": None}
    mp = spec.make_mesh_plan(params, specs, mesh=MESH, align=1)
    local = {"up": meta(32, 16), "down": meta(16, 32), "norm": meta(16)}
    want = rg.make_plan(local, {"up": spec.Blocks(8, 16), "down": None, "norm": None}, world_size=2, align=1)
    assert mp.plan == want
    assert mp.leaf("['norm']").replicated_on == ("tp",) and mp.leaf("['up']").shards == (("tp", 0, 1, 2),)


def _raises(params, specs, *fragments, mesh=MESH, exc=rg.LayoutError):
    with pytest.raises(exc) as info:
        spec.make_mesh_plan(params, specs, mesh=mesh)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))
    return info.value


def test_error_uneven_split_names_path_shape_rule_fix():
    err = _raises({"layers": [{"w": meta(9, 4)}]}, {"layers": [{"w": {"tp": spec.Shard(0)}}]},
                  "specs['layers'][0]['w']", "(9, 4)", "not a multiple of 2", "Rule: Shard(dim) splits a dimension evenly",
                  "Fix:")
    assert err.path == "['layers'][0]['w']" and err.shape == (9, 4)
    _raises({"qkv": meta(15, 4)}, {"qkv": {"tp": spec.Shard(0, groups=3)}}, "not a multiple of 6", "3 segments x 2 ranks")


def test_error_block_straddles_tp_boundary():
    _raises({"w": meta(64, 48)}, {"w": {"dp": spec.Blocks(64, 16), "tp": spec.Shard(0)}},
            "part shape (32, 48)", "32 rows per part is not a multiple of r = 64", "straddle the 'tp' boundary")
    _raises({"w": meta(64, 48)}, {"w": {"dp": spec.Blocks(16, 16), "tp": spec.Shard(1)}},
            "24 columns per part is not a multiple of c = 16")
    # strided: each of the 3 segments must hold whole tiles (48 rows / 3 segments / 2 ranks = 8 rows per run)
    _raises({"qkv": meta(48, 8)}, {"qkv": {"dp": spec.Blocks(16, 8), "tp": spec.Shard(0, groups=3)}},
            "8 rows per part is not a multiple of r = 16")
    _raises({"e": meta(4, 6, 8)}, {"e": {"dp": spec.Rows(4), "tp": spec.Shard(1)}},
            "holds 3 rows, not a multiple of n = 4")
    _raises({"v": meta(24)}, {"v": {"dp": spec.Elements(8), "tp": spec.Shard(0)}},
            "holds 12 elements, not a multiple of n = 8")
    # fine: whole experts per EP rank, tiles inside; Rows(n) on a column-sharded (row-parallel) weight
    spec.make_mesh_plan({"e": meta(4, 6, 8)}, {"e": {"dp": spec.Blocks(3, 8), "tp": spec.Shard(0)}}, mesh=MESH)
    spec.make_mesh_plan({"w": meta(6, 8)}, {"w": {"dp": spec.Rows(3), "tp": spec.Shard(1)}}, mesh=MESH)


def test_error_misplaced_and_unknown():
    _raises({"w": meta(4, 4)}, {"w": {"dp": spec.Shard(0)}}, "FSDP axis", "spec.Rows(1)")
    _raises({"w": meta(4, 4)}, {"w": {"tp": spec.Rows(1)}}, "not the FSDP axis")
    _raises({"w": meta(4, 4)}, {"w": spec.Placements(xp=spec.Shard(0))}, "['xp']", "does not have")
    _raises({"w": meta(4, 4)}, {"w": {"tp": spec.Shard(2)}}, "(4, 4)", "2 dims")
    mesh3 = spec.Mesh((1, 2, 2), ("dp", "tp", "ep"))
    _raises({"w": meta(4, 4)}, {"w": spec.Shard(0)}, "ambiguous", mesh=mesh3)
    _raises({"w": meta(4, 4)}, {"w": "rows"}, "specs['w']", "not a placement", exc=TypeError)
    with pytest.raises(ValueError, match=re.escape("specs")):
        spec.make_mesh_plan({"w": meta(4, 4)}, {"v": None}, mesh=MESH)


def _bad_shard(mc, mplan):
    try:
        rg.shard(mplan, {"w": torch.zeros(4, 4)}, mc)
    except rg.LayoutError as e:
        return str(e)


def test_wrong_global_shape_raises_before_communication():
    mplan = spec.make_mesh_plan({"w": meta(8, 4)}, spec.Shard(0), mesh=MESH)
    msgs = parallel.simulate_mesh(MESH, _bad_shard, mplan, timeout=5.0)
    assert all("params['w'] has shape (4, 4)" in m and "global shape (8, 4)" in m for m in msgs)


# ---- property: random placements round-trip through shard / gather / full_params / to_global ----
@st.composite
def mesh_cases(draw):
    dp, tp = draw(st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]))
    mesh = spec.Mesh((dp, tp), ("dp", "tp"))
    params, specs = {}, {}
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
        placement = {}
        if draw(st.booleans()):
            d = draw(st.integers(0, ndim - 1))
            groups = draw(st.sampled_from([1, 1, 2]))
            shape[d] *= tp * groups
            placement["tp"] = spec.Shard(d, groups=groups)
        placement["dp"] = draw(st.sampled_from([spec.Rows(1), spec.Elements(1), spec.Replicate()]))
        params[f"p{i}"] = torch.randn(*shape, dtype=torch.float64)
        specs[f"p{i}"] = placement
    return mesh, params, specs


def _property_body(mc, mplan, params):
    d = rg.shard(mplan, params, mc)
    local = rg.gather(mplan, d, mc)
    want = parallel.parts(mplan, params, mc.coords)
    ok = all(torch.equal(a, b) for a, b in zip(rg.pytree.leaves(local), rg.pytree.leaves(want)))
    full = parallel.full_params(mplan, d, mc)
    ok = ok and all(torch.equal(full[k], params[k]) for k in params)
    back = parallel.from_global(mplan, parallel.to_global(mplan, d, mc), mc)
    return ok and torch.equal(back.data, d.data) and torch.equal(back.replicated, d.replicated)


@given(mesh_cases())
def test_property_roundtrips(case):
    mesh, params, specs = case
    mplan = spec.make_mesh_plan(params, specs, mesh=mesh)
    assert all(parallel.simulate_mesh(mesh, _property_body, mplan, params))


def _mismatched(mc):
    shard_dim = 0 if mc.coords["tp"] == 0 else 1  # TP ranks disagree about the placement
    mplan = spec.make_mesh_plan({"w": meta(8, 4)}, {"w": {"tp": spec.Shard(shard_dim)}}, mesh=MESH)
    try:
        rg.shard(mplan, {"w": torch.zeros(8, 4)}, mc)
    except rg.PlanMismatchError as e:
        return str(e)


def test_mismatched_mesh_plans_raise_on_every_rank():
    msgs = parallel.simulate_mesh(MESH, _mismatched, timeout=10.0)
    assert all(m is not None and "different mesh plans" in m and "['w']" in m for m in msgs), msgs


def test_rich_table_lists_every_leaf():
    from rich.console import Console

    mp = spec.make_mesh_plan({"qkv": meta(12, 4), "n": meta(4)}, {"qkv": {"tp": spec.Shard(0, groups=3)}, "n": None}, mesh=MESH)
    console = Console(record=True, width=200)
    console.print(mp)
    text = console.export_text()
    assert "Shard(0, groups=3)" in text and "(6, 4)" in text and "Replicate()" in text and "['n']" in text


@st.composite
def block_cases(draw):
    dp, tp = draw(st.sampled_from([(1, 2), (2, 2), (3, 2), (2, 4), (4, 1)]))
    r, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dim = draw(st.sampled_from([None, 0, 1]))
    groups = draw(st.sampled_from([1, 2])) if dim is not None else 1
    rows = r * draw(st.integers(1, 3)) * (tp * groups if dim == 0 else 1)
    cols = c * draw(st.integers(1, 3)) * (tp * groups if dim == 1 else 1)
    lead = draw(st.sampled_from([(), (2,)]))
    placement = {"dp": spec.Blocks(r, c)}
    if dim is not None:
        placement["tp"] = spec.Shard(dim + len(lead), groups=groups)
    extra = {"v": meta(draw(st.integers(1, 7)))}  # another leaf shares the buffer
    return spec.Mesh((dp, tp), ("dp", "tp")), {"w": meta(*lead, rows, cols), **extra}, {"w": placement, "v": None}


@given(block_cases())
def test_property_global_tiles_never_straddle_any_boundary(case):
    """Map every rank's FSDP piece of a Blocks leaf back to global (matrix, row, col): each
    global r x c tile lies wholly on one rank, for every TP and FSDP coordinate."""
    mesh, params, specs = case
    mp = spec.make_mesh_plan(params, specs, mesh=mesh, align=1)
    leaf = mp.leaf("['w']")
    r, c = leaf.granularity.r, leaf.granularity.c
    R, C = leaf.shape[-2], leaf.shape[-1]
    covered = set()
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        index = parallel.part_index(leaf, coords)
        held = torch.cat([index[p.start : p.stop] for p in mp.plan.local_pieces(coords["dp"]) if p.leaf.index == leaf.index]
                         or [torch.zeros(0, dtype=torch.int64)])
        covered.update(held.tolist())
        tile = (held // (R * C)) * (R * C) + ((held % (R * C)) // C // r) * C + (held % C) // c
        _, counts = torch.unique(tile, return_counts=True)
        assert bool((counts == r * c).all()), (rank, counts.tolist())  # every tile touched is held whole
    assert len(covered) == math.prod(leaf.shape)


def test_part_shapes_part_meta_and_part_index_agree():
    """A leaf's part shape, ``part_shapes()``, ``part_meta()`` and the elements ``part_index``
    picks are one account of what a mesh position holds (moved from tests/test_old_names.py)."""
    params = {"router": torch.arange(8.0).view(2, 4), "experts": torch.arange(32.0).view(2, 4, 4)}
    mplan = spec.make_mesh_plan(params, {"router": None, "experts": {"ep": spec.Shard(0)}},
                                mesh=spec.Mesh((1, 2), ("dp", "ep")))
    leaf = mplan.leaf("['experts']")
    assert leaf.part_shape == (1, 4, 4)
    assert mplan.part_shapes() == {"router": (2, 4), "experts": (1, 4, 4)}
    assert {k: (t.shape, t.device.type) for k, t in mplan.part_meta().items()} == {
        "router": ((2, 4), "meta"), "experts": ((1, 4, 4), "meta")}
    coords = {"dp": 0, "ep": 1}
    got = parallel.parts(mplan, params, coords)
    assert torch.equal(got["experts"], params["experts"][1:]) and torch.equal(got["router"], params["router"])
    assert torch.equal(params["experts"].reshape(-1)[parallel.part_index(leaf, coords)].view(1, 4, 4), got["experts"])
