"""Checkpoints of multi-buffer plans: saved with one buffer count, loaded with another (and
another world size / granularity), on the simulated backend with real files and real DCP;
consolidation of a multi-buffer checkpoint into one file. The gloo version is in
tests/distributed/test_buffers_gloo.py."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from tests.checkpoint._util import full_leaves, full_trees, make_state, padding_is_zero, plan_for, tree_leaves_by_path

simulate = rg.collectives.simulate


def _plan(params, m, granularity, buffers):
    plan = plan_for(params, m, granularity)
    if buffers == "granule":
        return rg.testing.with_buffers(plan)
    if buffers == "leaf":
        return rg.testing.with_buffers(plan, [[l.path] for l in reversed(plan.leaves)])
    return plan


def _round_trip(tmp_path, save, load):
    (m_save, g_save, b_save), (m_load, g_load, b_load) = save, load
    full = full_trees()
    path = tmp_path / "ckpt"
    splan = _plan(full["params"], m_save, g_save, b_save)
    simulate(m_save, lambda c: rg.checkpoint.save(path, make_state(c.rank, splan, full), c))
    lplan = _plan(full["params"], m_load, g_load, b_load)
    like_full = full_trees(99)

    def fn(comm):
        return rg.checkpoint.load(path, make_state(comm.rank, lplan, like_full, step=0), comm)

    states = simulate(m_load, fn)
    for key in ("params", "mu", "nu"):
        dbufs = [s["params"] if key == "params" else getattr(s["opt"][0], key) for s in states]
        assert dbufs[0].plan == lplan
        got, want = full_leaves(dbufs), tree_leaves_by_path(full[key])
        assert got.keys() == want.keys()
        for p in want:
            torch.testing.assert_close(got[p], want[p], rtol=0, atol=0, msg=f"{key}{p}")
        assert all(padding_is_zero(d) for d in dbufs)
    return splan, lplan


@pytest.mark.parametrize(
    "save, load",
    [
        ((3, "rows", "granule"), (3, "rows", "one")),
        ((3, "rows", "one"), (3, "rows", "leaf")),
        ((2, "rows", "leaf"), (4, "rows", "granule")),
        ((4, "blocks", "granule"), (2, "mixed", "leaf")),
        ((3, "mixed", "leaf"), (1, "rows", "one")),
        ((2, "elements", "granule"), (3, "blocks", "granule")),
    ],
    ids=str,
)
def test_save_with_one_buffer_count_load_with_another(tmp_path, save, load):
    splan, lplan = _round_trip(tmp_path, save, load)
    assert (splan.num_buffers, lplan.num_buffers) != (1, 1)


def test_consolidate_a_multi_buffer_checkpoint(tmp_path):
    full = full_trees()
    plan = _plan(full["params"], 3, "rows", "leaf")
    path = tmp_path / "ckpt"
    simulate(3, lambda c: rg.checkpoint.save(path, {"params": rg.shard(plan, full["params"], rank=c.rank)}, c))
    exported = rg.checkpoint.consolidate(path, prefix="params")
    from ragged._pytree import path_parts

    want = {".".join(path_parts(p)): t for p, t in tree_leaves_by_path(full["params"]).items()}
    assert exported.keys() == want.keys()
    for k, t in want.items():
        assert torch.equal(exported[k], t), k
