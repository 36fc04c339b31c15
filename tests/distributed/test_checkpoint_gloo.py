"""Checkpoints on real gloo process groups: save on 4 / 2 ranks, load on 2 / 4 / 1 ranks (other
plans too), resumed training equals uninterrupted training, damaged checkpoints refused.

One pool of 4 worker processes serves the module; 2- and 1-rank runs use subgroups
(``group([0, 1])``, ``group([0])``), whose ranks 2..3 / 1..3 sit the run out.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import ragged as rg
from tests.distributed._harness import both_transports, comm, group, mesh, rank, workers_fixture
from tests.distributed._harness import transport as transport_options

pytestmark = pytest.mark.distributed

workers4 = workers_fixture(4)
transport = both_transports()

_GROUPS = {4: None, 2: (0, 1), 1: (0,)}


def _comm_of(m: int):
    """The comm of the first ``m`` ranks (None on ranks outside it). Collective: every rank calls it."""
    if _GROUPS[m] is None:
        return comm()
    g = group(_GROUPS[m])
    return rg.collectives.from_torch(g, **transport_options()) if rank() < m else None


def _round_trip_save(path, m, granularity):
    from tests.checkpoint._util import full_trees, make_state, plan_for

    c = _comm_of(m)
    if c is None:
        return None
    full = full_trees(0)
    plan = plan_for(full["params"], m, granularity)
    manifest = rg.checkpoint.save(path, make_state(c.rank, plan, full), c)
    return sorted(manifest["files"])


def _round_trip_load(path, m, granularity):
    """Loads on ``m`` ranks and checks against the full reference on every rank: each rank's
    pieces must equal the reference's elements at the plan's offsets."""
    from tests.checkpoint._util import full_trees, make_state, padding_is_zero, plan_for, tree_leaves_by_path

    c = _comm_of(m)
    if c is None:
        return None
    full = full_trees(0)
    plan = plan_for(full["params"], m, granularity)
    state = rg.checkpoint.load(path, make_state(c.rank, plan, full_trees(99), step=0) | {"lr": 0.0, "name": ""}, c)
    checked = 0
    for key, dbuf in (("params", state["params"]), ("mu", state["opt"][0].mu), ("nu", state["opt"][0].nu)):
        want = tree_leaves_by_path(full[key])
        assert padding_is_zero(dbuf)
        for piece in plan.local_pieces(c.rank):
            got = dbuf.data[piece.local_offset : piece.local_offset + piece.numel]
            torch.testing.assert_close(got, want[piece.leaf.path].reshape(-1)[piece.start : piece.stop], rtol=0, atol=0)
            checked += piece.numel
        for leaf in plan.replicated:
            torch.testing.assert_close(dbuf.replicated[leaf.offset : leaf.stop].view(leaf.shape), want[leaf.path], rtol=0, atol=0)
        # and the engine's gather gives the whole tree back
        gathered = rg.gather(dbuf, c)
        for p, t in tree_leaves_by_path(gathered).items():
            torch.testing.assert_close(t, want[p], rtol=0, atol=0)
    assert state["step"] == 5 and int(state["opt"][0].count) == 5 and state["name"] == "run-1"
    return checked


@pytest.mark.parametrize(
    "m_save, g_save, loads",
    [
        (4, "rows", [(2, "rows"), (1, "rows"), (2, "elements")]),
        (2, "blocks", [(4, "mixed"), (1, "blocks")]),
    ],
    ids=["4->2,1", "2->4,1"],
)
def test_reshard_round_trips(workers4, tmp_path, m_save, g_save, loads):
    path = str(tmp_path / "ckpt")
    files = workers4.run(_round_trip_save, path, m_save, g_save)
    assert files[0] == sorted([".metadata", *(f"__{r}_0.distcp" for r in range(m_save))])
    from tests.checkpoint._util import full_trees, plan_for

    params = full_trees(0)["params"]
    total = 3 * sum(t.numel() for t in rg.pytree.leaves(params))  # params, mu, nu
    for m, g in loads:
        checked = workers4.run(_round_trip_load, path, m, g)
        replicated = 3 * sum(l.numel for l in plan_for(params, m, g).replicated)
        # every sharded element was compared on exactly one rank
        assert sum(c for c in checked if c is not None) == total - replicated


def _resume(path, m_before, m_after, granularity, steps):
    from tests.checkpoint import _train

    out = {}
    c = _comm_of(m_before)
    if c is not None:
        state = _train.train(c, _train.init_state(c), steps[0])
        rg.checkpoint.save(path, state, c)
    comm().barrier()  # ranks outside the saving group wait for the checkpoint to be published
    c = _comm_of(m_after)
    if c is not None:
        like = _train.init_state(c, granularity, seed=7)
        state = _train.train(c, rg.checkpoint.load(path, like, c), steps[1])
        out["resumed"], out["step"] = _train.full_params(c, state), state["step"]
        ref = _train.train(c, _train.init_state(c), steps[0] + steps[1])
        out["reference"] = _train.full_params(c, ref)
    return out


@pytest.mark.parametrize(
    "m_before, m_after, granularity", [(4, 2, "elements"), (2, 4, "blocks"), (2, 1, "rows")], ids=["4->2", "2->4", "2->1"]
)
def test_resumed_training_equals_uninterrupted(workers4, tmp_path, m_before, m_after, granularity):
    from tests.checkpoint import _train

    results = workers4.run(_resume, str(tmp_path / "ckpt"), m_before, m_after, granularity, (3, 3))
    first = results[0]
    assert first["step"] == 6
    initial = _train.model_params(0)
    for k, ref in first["reference"].items():
        assert not torch.allclose(ref, initial[k])
        torch.testing.assert_close(first["resumed"][k], ref, msg=k)
    for other in results[1:m_after]:
        for k in first["resumed"]:
            torch.testing.assert_close(other["resumed"][k], first["resumed"][k], rtol=0, atol=0)


def _load_damaged(path, expect):
    from tests.checkpoint._util import full_trees, make_state, plan_for

    c = comm()
    full = full_trees(0)
    like = make_state(c.rank, plan_for(full["params"], 4), full_trees(3))
    before = like["params"].data.clone()
    try:
        rg.checkpoint.load(path, like, c)
    except rg.checkpoint.CheckpointError as exc:
        assert torch.equal(like["params"].data, before)
        return type(exc).__name__, str(exc)
    return None


def test_damaged_checkpoint_refused_on_every_rank(workers4, tmp_path):
    path = str(tmp_path / "ckpt")
    workers4.run(_round_trip_save, path, 4, "rows")
    victim = os.path.join(path, "__2_0.distcp")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 3] ^= 0x01
    open(victim, "wb").write(bytes(data))
    results = workers4.run(_load_damaged, path, None)
    # the rank that hashed the file reports it; all four raise the same error type
    assert {r[0] for r in results} == {"CheckpointCorruptError"}
    assert all(re.search(r"file '__2_0\.distcp' has a different sha256", r[1]) for r in results)


def test_other_shapes_refused_on_every_rank(workers4, tmp_path):
    path = str(tmp_path / "ckpt")
    workers4.run(_round_trip_save, path, 4, "rows")
    results = workers4.run(_load_other_shapes, path)
    assert all(r[0] == "CheckpointMismatchError" for r in results)
    assert all("like_state['params']['emb']: saved shape (10, 6), expected shape (12, 6)" in r[1] for r in results)


def _load_other_shapes(path):
    from tests.checkpoint._util import full_trees, make_state, plan_for

    c = comm()
    full = full_trees(0)
    for key in full:
        full[key]["emb"] = torch.zeros(12, 6)
    like = make_state(c.rank, plan_for(full["params"], 4), full)
    try:
        rg.checkpoint.load(path, like, c)
    except rg.checkpoint.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


def _quant8_save_load(path, m_save, m_load):
    """8-bit Adam: train on m_save ranks, save; load on m_load ranks; return each rank's
    per-leaf state before and after (the test concatenates over ranks)."""
    from ragged.optim._quant8 import adam8bit_leaf_state
    from tests.checkpoint import _train

    opt, mn = "adamw_8bit", _train.MIN_SIZE_8BIT
    out = {}
    c = _comm_of(m_save)
    if c is not None:
        state = _train.train(c, _train.init_state(c, "blocks8", opt=opt), 3, opt)
        rg.checkpoint.save(path, dict(state, opt=rg.checkpoint.bind_quant8(state["opt"], state["params"], min_size=mn)), c)
        out["saved"] = adam8bit_leaf_state(state["opt"][0].moments, state["params"], min_size=mn)
    comm().barrier()  # ranks outside the saving group wait for the checkpoint to be published
    c = _comm_of(m_load)
    if c is not None:
        like = _train.init_state(c, "blocks8", opt=opt, seed=3)
        like["opt"] = rg.checkpoint.bind_quant8(like["opt"], like["params"], min_size=mn)
        state = rg.checkpoint.load(path, like, c)
        moments = rg.checkpoint.unbind(state["opt"])[0].moments
        out["loaded"] = adam8bit_leaf_state(moments, state["params"], min_size=mn)
    return out


@pytest.mark.parametrize("m_save, m_load", [(4, 2), (2, 4)], ids=["4->2", "2->4"])
def test_8bit_state_exact_across_world_sizes(workers4, tmp_path, m_save, m_load):
    results = workers4.run(_quant8_save_load, str(tmp_path / "ckpt"), m_save, m_load)

    def whole(key):
        per_rank = [r[key] for r in results if key in r]
        leaves = sorted({leaf for r in per_rank for leaf in r if leaf != "['b2']"})  # b2 is replicated
        return {leaf: {part: torch.cat([r[leaf][part] for r in per_rank if leaf in r]) for part in next(r[leaf] for r in per_rank if leaf in r)} for leaf in leaves}

    saved, loaded = whole("saved"), whole("loaded")
    assert saved.keys() == loaded.keys() and saved["['w1']"]["mu_codes"].dtype == torch.uint8
    for leaf in saved:
        for part in saved[leaf]:
            assert torch.equal(saved[leaf][part], loaded[leaf][part]), (leaf, part)


def _hsdp_save_then_load(path):
    """Save on a 2x2 HSDP mesh (replica 0 writes), load on the mesh and on 4 plain ranks."""
    from tests.checkpoint._util import full_trees, make_state, plan_for, tree_leaves_by_path

    hsdp = rg.collectives.from_torch(mesh((2, 2)), **transport_options())
    full = full_trees(0)
    plan = plan_for(full["params"], 2)
    manifest = rg.checkpoint.save(path, make_state(hsdp.rank, plan, full), hsdp)
    out = {"files": sorted(manifest["files"]) if manifest else None}
    for name, c, m in (("hsdp", hsdp, 2), ("plain", comm(), 4)):
        state = rg.checkpoint.load(path, make_state(c.rank, plan_for(full["params"], m, "elements"), full_trees(8)), c)
        got = tree_leaves_by_path(rg.gather(state["opt"][0].nu, c))
        want = tree_leaves_by_path(full["nu"])
        out[name] = all(torch.equal(got[p], want[p]) for p in want) and state["step"] == 5
    return out


def test_hsdp_save_and_load(workers4, tmp_path):
    results = workers4.run(_hsdp_save_then_load, str(tmp_path / "ckpt"))
    files = results[0]["files"]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert all(os.path.getsize(tmp_path / "ckpt" / f) == 0 for f in files[3:])  # replica 1 wrote nothing
    assert all(r["hsdp"] and r["plain"] for r in results)
