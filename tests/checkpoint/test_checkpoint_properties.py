"""Property: save on m1 ranks under one plan, load on m2 ranks under another plan of the same
leaves: every leaf comes back exactly, padding stays zero (random trees, shapes incl. empty and
0-d, granularities incl. blocks and Replicate, world sizes)."""

from __future__ import annotations

import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged as rg
from ragged.testing import strategies as rst
from tests.checkpoint._util import full_leaves, padding_is_zero, tree_leaves_by_path


@st.composite
def _cases(draw):
    params = draw(rst.param_trees(device="cpu", max_leaves=5, shapes=rst.shapes(max_side=6)))
    specs = [draw(rst.spec_trees(params, replicate=True)) for _ in range(2)]
    m = [draw(st.integers(1, 4)) for _ in range(2)]
    strategy = draw(st.sampled_from(["dp", "exact", "naive"]))
    return params, specs, m, strategy


@settings(max_examples=25)
@given(_cases())
def test_save_load_any_plans(case):
    params, (spec_a, spec_b), (m_a, m_b), strategy = case
    plan_a = rg.make_plan(params, spec_a, world_size=m_a, strategy=strategy)
    plan_b = rg.make_plan(params, spec_b, world_size=m_b)
    with tempfile.TemporaryDirectory() as root:
        path = f"{root}/ckpt"
        rg.collectives.simulate(
            m_a, lambda comm: rg.checkpoint.save(path, {"p": rg.shard(plan_a, params, rank=comm.rank)}, comm)
        )

        def load(comm):
            zeros = rg.pytree.map(torch.zeros_like, params)
            return rg.checkpoint.load(path, {"p": rg.shard(plan_b, zeros, rank=comm.rank)}, comm)["p"]

        dbufs = rg.collectives.simulate(m_b, load)
        exported = rg.checkpoint.consolidate(path, prefix="p")
    got, want = full_leaves(dbufs), tree_leaves_by_path(params)
    assert got.keys() == want.keys()
    for p in want:
        assert torch.equal(got[p], want[p]), p
        assert torch.equal(exported[_dotted(p)], want[p])
    assert all(padding_is_zero(d) for d in dbufs)


def _dotted(path):
    from ragged._pytree import path_parts

    return ".".join(path_parts(path))


def test_empty_and_scalar_leaves(tmp_path):
    params = {"a": torch.randn(0, 5), "b": torch.randn(7, 3), "c": torch.randn(()), "e": torch.randn(0)}
    plan3, plan2 = rg.make_plan(params, world_size=3), rg.make_plan(params, world_size=2)
    path = tmp_path / "ckpt"
    rg.collectives.simulate(
        3, lambda comm: rg.checkpoint.save(path, {"p": rg.shard(plan3, params, comm), "t": torch.zeros(0, 2)}, comm)
    )

    def load(comm):
        s = rg.checkpoint.load(path, {"p": rg.shard(plan2, params, comm), "t": torch.ones(0, 2)}, comm)
        return s["p"], s["t"]

    out = rg.collectives.simulate(2, load)
    got = full_leaves([d for d, _ in out])
    for k, v in params.items():
        assert got[f"['{k}']"].shape == v.shape and torch.equal(got[f"['{k}']"], v)
    assert out[0][1].shape == (0, 2)
    assert rg.checkpoint.consolidate(path)["p.a"].shape == (0, 5)
