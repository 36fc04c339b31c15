"""SOAP's and Shampoo's state (moments and block matrices) survives world-size changes exactly:
saved at 2 ranks, loaded at 3, trained on, saved, loaded at 1, trained on: bit-identical to one
uninterrupted run at 1 rank (the state itself is the same at every world size)."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import spec
from ragged.checkpoint import CheckpointMismatchError
from tests.optim import _precond_cases as cases

simulate = rg.collectives.simulate
MAKE = {"soap": lambda: cases.make_soap(torch.float32, precondition_1d=True), "shampoo": lambda: cases.make_shampoo(torch.float32)}


def _segment(name, path_in, path_out, m, steps, gs):
    """On ``m`` ranks: a fresh state (or the one at ``path_in``), ``steps`` of ``gs``, saved to ``path_out``."""
    params = cases.edge_params()
    plan = rg.make_plan(params, cases.EDGE_SPECS, world_size=m)

    def fn(comm):
        local = rg.shard(plan, params, comm)
        opt = MAKE[name]()
        state = {"params": local, "opt": opt.init(local)}
        if path_in:
            state = rg.checkpoint.load(path_in, state, comm)
        local, opt_state = state["params"], state["opt"]
        for g in gs[:steps]:
            updates, opt_state = opt.update(rg.shard(plan, g, comm), opt_state, local)
            local = rg.apply_updates(local, updates)
        rg.checkpoint.save(path_out, {"params": local, "opt": opt_state}, comm)
        return local, opt_state

    return cases.whole(plan, simulate(m, fn))


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_state_resharded_2_3_1_is_bit_identical(tmp_path, name):
    params = cases.edge_params()
    gs = cases.grads(params, 7)
    first = _segment(name, None, tmp_path / "a", 2, 3, gs)
    assert first["factors"] and any(v.abs().sum() > 0 for v in first["factors"].values())
    second = _segment(name, tmp_path / "a", tmp_path / "b", 3, 2, gs[3:])
    third = _segment(name, tmp_path / "b", tmp_path / "c", 1, 2, gs[5:])
    straight = cases.run_world(params, cases.EDGE_SPECS, gs, MAKE[name], 1)
    cases.assert_bit_identical(third, straight, f"{name} 2 -> 3 -> 1")
    del second
    whole = rg.checkpoint.consolidate(tmp_path / "c")
    left = whole["opt.factors.w.interior.left_stats"]  # (blocks, 4, 4), band-major: the whole leaf's, for inspection
    assert torch.equal(left, straight["factors"][("left_stats", "['w']", "interior")])


def test_other_blocks_are_refused_by_leaf(tmp_path):
    params = cases.edge_params()
    _segment("shampoo", None, tmp_path / "a", 2, 2, cases.grads(params))
    other = dict(cases.EDGE_SPECS, w=spec.Blocks(2, 5))
    plan = rg.make_plan(params, other, world_size=2)

    def fn(comm):
        local = rg.shard(plan, params, comm)
        rg.checkpoint.load(tmp_path / "a", {"params": local, "opt": MAKE["shampoo"]().init(local)}, comm)

    with pytest.raises(CheckpointMismatchError, match=r"\['w'\]: saved with blocks .* same blocks"):
        simulate(2, fn)
