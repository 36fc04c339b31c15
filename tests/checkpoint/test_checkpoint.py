"""Checkpoint save / load / consolidate on the simulated backend (threads; real files, real DCP).

The gloo multi-process versions live in tests/distributed/test_checkpoint_gloo.py.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import ragged as rg
from ragged.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, PerRank
from tests.checkpoint._util import (
    AdamLike,
    full_leaves,
    full_trees,
    make_params,
    make_state,
    padding_is_zero,
    plan_for,
    tree_leaves_by_path,
)

simulate = rg.collectives.simulate


def _save(path, m, granularity="rows", full=None, **kw):
    full = full or full_trees()
    plan = plan_for(full["params"], m, granularity)

    def fn(comm):
        return rg.checkpoint.save(path, make_state(comm.rank, plan, full), comm, **kw)

    return simulate(m, fn)[0], full


def _load(path, m, granularity="rows", full=None, **kw):
    full = full or full_trees()
    plan = plan_for(full["params"], m, granularity)
    # like_state holds other values (seed 99): only its structure and plans matter.
    like_full = full_trees(99)

    def fn(comm):
        like = make_state(comm.rank, plan, like_full, step=0)
        like["lr"], like["name"] = 0.0, ""
        return rg.checkpoint.load(path, like, comm, **kw)

    return simulate(m, fn)


def _assert_state_equals(states, full, step=5):
    for key, ref in (("params", full["params"]), ("mu", full["mu"]), ("nu", full["nu"])):
        dbufs = [s["params"] if key == "params" else getattr(s["opt"][0], key) for s in states]
        got = full_leaves(dbufs)
        want = tree_leaves_by_path(ref)
        assert got.keys() == want.keys()
        for p in want:
            torch.testing.assert_close(got[p], want[p], rtol=0, atol=0, msg=f"{key}{p}")
        assert all(padding_is_zero(d) for d in dbufs)
    for s in states:
        assert s["step"] == step and isinstance(s["step"], int)
        assert int(s["opt"][0].count) == step and s["opt"][0].count.dtype == torch.int64
        if "rng" in s:
            assert torch.equal(s["rng"], torch.Generator().manual_seed(1234).get_state())
        assert s["lr"] == 0.25 and s["name"] == "run-1" and s["nothing"] is None


@pytest.mark.parametrize(
    "m_save, m_load",
    [(1, 1), (2, 2), (3, 3), (4, 2), (2, 4), (2, 1), (4, 1), (1, 3), (3, 4)],
    ids=lambda v: str(v),
)
def test_round_trip_across_world_sizes(tmp_path, m_save, m_load):
    path = tmp_path / "ckpt"
    manifest, full = _save(path, m_save)
    assert manifest["world_size"] == m_save
    states = _load(path, m_load, full=full)
    _assert_state_equals(states, full)


@pytest.mark.parametrize(
    "g_save, g_load",
    [("rows", "elements"), ("rows", "blocks"), ("blocks", "mixed"), ("mixed", "rows"), ("elements", "blocks")],
)
def test_load_into_another_granularity(tmp_path, g_save, g_load):
    path = tmp_path / "ckpt"
    _, full = _save(path, 3, g_save)
    states = _load(path, 2, g_load, full=full)
    assert states[0]["params"].plan != plan_for(full["params"], 3, g_save)
    _assert_state_equals(states, full)


def test_load_into_naive_plan_and_other_order(tmp_path):
    path = tmp_path / "ckpt"
    _, full = _save(path, 4)
    plan = rg.make_plan(full["params"], world_size=3, strategy="naive", align=1)

    def fn(comm):
        like = make_state(comm.rank, plan, full_trees(7))
        return rg.checkpoint.load(path, like, comm)

    _assert_state_equals(simulate(3, fn), full)


def test_each_rank_writes_only_its_pieces(tmp_path):
    """Rank r's data file holds exactly its own pieces (sizes add up to the real data, no
    padding, no other rank's elements): the model is never gathered on one rank."""
    path = tmp_path / "ckpt"
    full = {"params": make_params(0), "mu": make_params(1), "nu": make_params(2)}
    plan = plan_for(full["params"], 4)

    def fn(comm):
        state = {"params": rg.shard(plan, full["params"], rank=comm.rank)}
        return rg.checkpoint.save(path, state, comm)

    manifest = simulate(4, fn)[0]
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    per_file: dict[str, int] = {}
    for index, info in md.storage_data.items():
        chunk = md.state_dict_metadata[index.fqn].chunks[index.index]
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + chunk.sizes[0]
    occupancy = plan.occupancy()
    for r in range(4):
        assert per_file.get(f"__{r}_0.distcp", 0) == occupancy[r]
    assert set(manifest["files"]) == {".metadata", *(f"__{r}_0.distcp" for r in range(4) if occupancy[r])}


def test_per_rank_values(tmp_path):
    path = tmp_path / "ckpt"

    def save_fn(comm):
        return rg.checkpoint.save(path, {"rng": PerRank(torch.arange(3) + 10 * comm.rank)}, comm)

    simulate(3, save_fn)

    def load_fn(comm):
        return rg.checkpoint.load(path, {"rng": PerRank(torch.zeros(3, dtype=torch.int64))}, comm)["rng"].value

    got = simulate(3, load_fn)
    assert [g.tolist() for g in got] == [[10 * r, 10 * r + 1, 10 * r + 2] for r in range(3)]
    with pytest.raises(CheckpointMismatchError, match=re.escape("a PerRank value saved by 3 ranks cannot load on 2 ranks")):
        simulate(2, load_fn)
    exported = rg.checkpoint.consolidate(path)
    assert exported["rng@rank2"].tolist() == [20, 21, 22]


def test_consolidate_writes_one_file_that_loads_into_a_module(tmp_path):
    path = tmp_path / "ckpt"
    _, full = _save(path, 3, "blocks")
    out = tmp_path / "model.pt"
    flat = rg.checkpoint.consolidate(path, out)
    assert flat["step"] == 5 and flat["lr"] == 0.25 and flat["name"] == "run-1"
    torch.testing.assert_close(flat["params.layers.1.w"], full["params"]["layers"][1]["w"], rtol=0, atol=0)
    torch.testing.assert_close(flat["opt.0.mu.emb"], full["mu"]["emb"], rtol=0, atol=0)
    assert torch.load(out, weights_only=True).keys() == flat.keys()

    # prefix= gives a state dict an nn.Module accepts.
    model = torch.nn.Module()
    model.emb = torch.nn.Parameter(torch.zeros(10, 6))
    model.head = torch.nn.Parameter(torch.zeros(6, 4))
    model.gain = torch.nn.Parameter(torch.zeros(()))
    model.layers = torch.nn.ModuleList()
    for shape in [(7, 5), (3, 8)]:
        layer = torch.nn.Module()
        layer.w = torch.nn.Parameter(torch.zeros(shape))
        layer.b = torch.nn.Parameter(torch.zeros(shape[1]))
        model.layers.append(layer)
    model.load_state_dict(rg.checkpoint.consolidate(path, prefix="params"))
    torch.testing.assert_close(model.layers[0].w.detach(), full["params"]["layers"][0]["w"], rtol=0, atol=0)


def test_files_are_plain_dcp(tmp_path):
    """The DCP files read back without ragged (format_utils.dcp_to_torch_save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp_path / "ckpt"
    _, full = _save(path, 2)
    dcp_to_torch_save(str(path), str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    torch.testing.assert_close(plain["['params']['emb']"], full["params"]["emb"].reshape(-1), rtol=0, atol=0)


# ---- safety ---------------------------------------------------------------------------------
def _saved(tmp_path, m=2):
    path = tmp_path / "ckpt"
    _, full = _save(path, m)
    return path, full


def _like_one(m=2, granularity="rows", params=None):
    params = params if params is not None else make_params(5)
    plan = plan_for(params, m, granularity)
    return plan, params


def test_existing_path_is_refused_and_overwrite_replaces(tmp_path):
    path, full = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="already exists. Pass overwrite=True"):
        _save(path, 2)
    other = full_trees(3)
    _save(path, 2, full=other, overwrite=True)
    _assert_state_equals(_load(path, 2, full=other), other)
    assert [n for n in os.listdir(tmp_path) if n != "ckpt"] == []  # no temporary or old copies left


def test_failed_save_publishes_nothing(tmp_path):
    """A rank failing while writing (its shard is a meta tensor with no data) makes every rank
    raise; nothing appears at the path and the temporary directory is removed."""
    path = tmp_path / "ckpt"
    params = make_params(0)
    plan = plan_for(params, 2)

    def fn(comm):
        d = rg.shard(plan, params, rank=comm.rank)
        if comm.rank == 1:
            d = d.replace(data=torch.empty(plan.shard_size, device="meta"))
        return rg.checkpoint.save(path, {"params": d}, comm)

    with pytest.raises(CheckpointError, match="failed on rank 1"):
        simulate(2, fn)
    assert os.listdir(tmp_path) == []


def test_unsupported_leaf_is_refused_before_communication(tmp_path):
    def fn(comm):
        if comm.rank == 0:  # rank 1 never joins: the round rank 0 joins with its error fails, it raises that error
            rg.checkpoint.save(tmp_path / "x", {"opt": {"sched": object()}}, comm)

    with pytest.raises(TypeError, match=re.escape("state['opt']['sched'] is a object, which a checkpoint cannot hold")):
        simulate(2, fn)


def test_ranks_with_different_plain_tensors_are_refused(tmp_path):
    def fn(comm):
        rg.checkpoint.save(tmp_path / "x", {"noise": torch.full((2,), float(comm.rank))}, comm)

    with pytest.raises(CheckpointError, match=re.escape("state['noise'] (tensor) holds different values on rank 0 and rank 1")):
        simulate(2, fn)
    assert not (tmp_path / "x").exists()


def _load_params(path, m, params, granularity="rows", **kw):
    plan = plan_for(params, m, granularity)

    def fn(comm):
        like = make_state(comm.rank, plan, {"params": params, "mu": params, "nu": params})
        return rg.checkpoint.load(path, like, comm, **kw)

    return simulate(m, fn)


def test_other_shapes_are_refused_with_paths(tmp_path):
    path, _ = _saved(tmp_path)
    params = make_params(5)
    params["layers"][1]["w"] = torch.zeros(4, 8)
    with pytest.raises(CheckpointMismatchError) as info:
        _load_params(path, 2, params)
    text = str(info.value)
    assert "like_state['params']['layers'][1]['w']: saved shape (3, 8), expected shape (4, 8)" in text
    assert "like_state['opt'][0].mu['layers'][1]['w']: saved shape (3, 8), expected shape (4, 8)" in text


def test_other_model_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    params = make_params(5)
    del params["head"]
    params["proj"] = torch.zeros(6, 4)
    with pytest.raises(CheckpointMismatchError) as info:
        _load_params(path, 2, params)
    text = str(info.value)
    assert "like_state['params']['head']: saved (shape (6, 4)) but like_state's plan has no such leaf" in text
    assert "like_state['params']['proj']: like_state's plan has this leaf (shape (6, 4)) but the checkpoint does not" in text


def test_other_dtype_and_kind_are_refused(tmp_path):
    path, _ = _saved(tmp_path)
    params = rg.pytree.map(lambda t: t.double(), make_params(5))
    with pytest.raises(CheckpointMismatchError, match=re.escape("like_state['params']: saved dtype float32, expected float64")):
        _load_params(path, 2, params)
    plan = plan_for(make_params(5), 2)

    def fn(comm):
        like = make_state(comm.rank, plan, full_trees(5))
        like["step"] = torch.tensor(0)
        like["opt"] = (like["opt"][0]._replace(count=torch.zeros(2, dtype=torch.int64)),)
        return rg.checkpoint.load(path, like, comm)

    with pytest.raises(CheckpointMismatchError) as info:
        simulate(2, fn)
    assert "like_state['step']: saved a value, like_state has a tensor" in str(info.value)
    assert "like_state['opt'][0].count: saved shape (), expected shape (2,)" in str(info.value)


def test_missing_and_extra_entries(tmp_path):
    path, full = _saved(tmp_path)
    plan = plan_for(full["params"], 2)

    def fn(comm, strict):
        like = make_state(comm.rank, plan, full_trees(5))
        del like["rng"]
        return rg.checkpoint.load(path, like, comm, strict=strict)

    with pytest.raises(CheckpointMismatchError, match=re.escape("like_state['rng']: the checkpoint holds this entry but like_state does not")):
        simulate(2, fn, True)
    states = simulate(2, fn, False)  # strict=False skips the entry
    assert "rng" not in states[0]


def _corrupt_file(path):
    return sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove", "metadata", "manifest", "unpublished"])
def test_damaged_checkpoints_are_refused_and_live_state_untouched(tmp_path, damage):
    path, full = _saved(tmp_path)
    name = _corrupt_file(path)
    target = path / name
    if damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
        expect = (CheckpointCorruptError, "truncated or extended")
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
        expect = (CheckpointCorruptError, "different sha256")
    elif damage == "remove":
        target.unlink()
        expect = (CheckpointCorruptError, f"file '{name}' is missing")
    elif damage == "metadata":
        (path / ".metadata").write_bytes(b"garbage")
        expect = (CheckpointCorruptError, "file '.metadata' has")
    elif damage == "manifest":
        text = (path / "manifest.json").read_text()
        (path / "manifest.json").write_text(text[: len(text) // 3])
        expect = (CheckpointCorruptError, "manifest.json' is unreadable")
    else:
        (path / "manifest.json").unlink()
        expect = (CheckpointCorruptError, "is not a published ragged checkpoint")

    plan = plan_for(full["params"], 2)
    likes = [make_state(r, plan, full_trees(42)) for r in range(2)]
    before = [d.data.clone() for d in (likes[0]["params"], likes[1]["params"])]

    def fn(comm):
        return rg.checkpoint.load(path, likes[comm.rank], comm)

    with pytest.raises(expect[0], match=re.escape(expect[1])):
        simulate(2, fn)
    for like, b in zip(likes, before):
        assert torch.equal(like["params"].data, b)
    with pytest.raises(expect[0]):
        rg.checkpoint.consolidate(path)


def test_load_returns_new_tensors(tmp_path):
    path, full = _saved(tmp_path)
    plan = plan_for(full["params"], 2)
    likes = [make_state(r, plan, full_trees(42)) for r in range(2)]
    before = [l["params"].data.clone() for l in likes]
    states = simulate(2, lambda comm: rg.checkpoint.load(path, likes[comm.rank], comm))
    for like, state, b in zip(likes, states, before):
        assert torch.equal(like["params"].data, b)
        assert state["params"].data.untyped_storage().data_ptr() != like["params"].data.untyped_storage().data_ptr()


@pytest.mark.parametrize("reader", ["consolidate", "load", "read_manifest", "pretrained", "fsdp2"])
def test_a_missing_path_is_file_not_found_naming_it(tmp_path, reader):
    """A typo in a path is a FileNotFoundError (rg.checkpoint.CheckpointNotFoundError) naming the
    path, not a damaged checkpoint."""
    path = tmp_path / "nope"
    call = {"consolidate": lambda: rg.checkpoint.consolidate(path),
            "load": lambda: rg.checkpoint.load(path, {"x": torch.zeros(2)}, rg.checkpoint.SingleProcess()),
            "read_manifest": lambda: rg.checkpoint.read_manifest(path),
            "pretrained": lambda: rg.checkpoint.pretrained(path),
            "fsdp2": lambda: rg.checkpoint.fsdp2(path)}[reader]
    with pytest.raises(FileNotFoundError) as info:
        call()
    err = info.value
    assert isinstance(err, rg.checkpoint.CheckpointNotFoundError) and not isinstance(err, CheckpointCorruptError)
    assert repr(str(path)) in str(err) and "does not exist" in str(err)


def test_ranks_passing_different_like_states_fail_together(tmp_path):
    path, full = _saved(tmp_path)
    plans = [plan_for(full["params"], 2, "rows"), plan_for(full["params"], 2, "elements")]

    def fn(comm):
        return rg.checkpoint.load(path, make_state(comm.rank, plans[comm.rank], full), comm)

    with pytest.raises(CheckpointMismatchError, match="ranks passed different like_state trees"):
        simulate(2, fn)


def test_dbuffer_of_another_rank_is_refused(tmp_path):
    params = make_params(0)
    plan = plan_for(params, 2)

    def fn(comm):
        d = rg.shard(plan, params, rank=1 - comm.rank)
        rg.checkpoint.save(tmp_path / "x", {"params": d}, comm)

    with pytest.raises(ValueError, match=re.escape("state['params'] is a DBuffer of rank 1, but this process is rank 0")):
        simulate(2, fn)


def test_named_tuple_state_types(tmp_path):
    """A NamedTuple of another type with the same fields is another tree: refused."""
    path, full = _saved(tmp_path)

    from typing import NamedTuple

    class OtherState(NamedTuple):
        count: torch.Tensor
        mu: object
        nu: object

    plan = plan_for(full["params"], 2)

    def fn(comm):
        like = make_state(comm.rank, plan, full)
        like["opt"] = (OtherState(*like["opt"][0]),)
        return rg.checkpoint.load(path, like, comm)

    with pytest.raises(CheckpointMismatchError, match="tree structure differs"):
        simulate(2, fn)
    assert AdamLike._fields == OtherState._fields


def test_hsdp_save_writes_one_replica_and_loads_anywhere(tmp_path):
    """HSDP (2 replicas x 2 shards): replica 0 writes the shards, replica 1 only takes part;
    the checkpoint loads on HSDP again, on 4 plain ranks and on 1 rank."""
    path = tmp_path / "ckpt"
    full = full_trees()
    plan = plan_for(full["params"], 2)

    def save(comm):
        state = make_state(comm.rank, plan, full)
        state["rng"] = PerRank(torch.full((2,), 10 * comm.replica_rank + comm.rank))
        return rg.checkpoint.save(path, state, comm)

    manifest = simulate(4, save, mesh_shape=(2, 2))[0]
    assert manifest["replicas"] == 2 and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    # replica 1's files hold only its PerRank values (2 int64 each, plus torch.save framing)
    sizes = {n: f["size"] for n, f in manifest["files"].items()}
    assert sizes["__2_0.distcp"] < sizes["__0_0.distcp"] / 4

    def load_hsdp(comm):
        like = make_state(comm.rank, plan, full_trees(9), step=0)
        like["rng"] = PerRank(torch.zeros(2, dtype=torch.int64))
        like["lr"], like["name"] = 0.0, ""
        return rg.checkpoint.load(path, like, comm)

    states = simulate(4, load_hsdp, mesh_shape=(2, 2))
    assert [s["rng"].value.tolist() for s in states] == [[0, 0], [1, 1], [10, 10], [11, 11]]
    for replica in (states[:2], states[2:]):
        for s in replica:
            s.pop("rng")
        _assert_state_equals(replica, full)
    with pytest.raises(CheckpointMismatchError, match="a PerRank value saved by 4 ranks cannot load on 2 ranks"):
        simulate(2, lambda comm: rg.checkpoint.load(path, {"rng": PerRank(torch.zeros(2, dtype=torch.int64))}, comm, strict=False))
    for m in (4, 1):
        plan_m = plan_for(full["params"], m, "elements")

        def load(comm):
            like = make_state(comm.rank, plan_m, full_trees(9), step=0)
            like["lr"], like["name"] = 0.0, ""
            del like["rng"]  # per-rank values do not move to another number of processes
            return rg.checkpoint.load(path, like, comm, strict=False)

        _assert_state_equals(simulate(m, load), full)


def test_truncation_is_caught_without_verify(tmp_path):
    """verify=False skips the sha256 pass but still compares every file's size."""
    path, full = _saved(tmp_path)
    target = path / _corrupt_file(path)
    target.write_bytes(target.read_bytes()[:-1])
    plan = plan_for(full["params"], 2)

    def fn(comm):
        return rg.checkpoint.load(path, make_state(comm.rank, plan, full), comm, verify=False)

    with pytest.raises(CheckpointCorruptError, match="truncated or extended"):
        simulate(2, fn)


def test_unbound_packed_state_is_refused_with_the_fix(tmp_path):
    """rg.optim.muon's AdamW part is packed (compact multi_transform label): saving it unbound
    raises before any communication and names the fix."""
    from tests.checkpoint import _train

    def fn(comm):
        state = _train.init_state(comm, opt="muon")
        rg.checkpoint.save(tmp_path / "x", state, comm)

    with pytest.raises(ValueError, match=re.escape("rg.checkpoint.bind_muon(opt_state)")):
        simulate(1, fn)

    def other_labels(comm):  # binding with labels the optimizer was not built with
        state = _train.init_state(comm, opt="muon")
        rg.checkpoint.bind_muon(state["opt"], muon_filter=lambda leaf: False)

    with pytest.raises(ValueError, match="the labels function differs"):
        simulate(1, other_labels)


def test_ranks_saving_different_states_fail_together(tmp_path):
    params = make_params(0)
    plans = [plan_for(params, 2, "rows"), plan_for(params, 2, "elements")]

    def fn(comm):
        rg.checkpoint.save(tmp_path / "x", {"params": rg.shard(plans[comm.rank], params, rank=comm.rank)}, comm)

    with pytest.raises(CheckpointError, match=re.escape("state['params'] differs between rank 0 (DBuffer float32, plan")):
        simulate(2, fn)

    def other_tree(comm):
        state = {"a": torch.zeros(2)} if comm.rank == 0 else {"b": torch.zeros(2)}
        rg.checkpoint.save(tmp_path / "y", state, comm)

    with pytest.raises(CheckpointError, match=re.escape("rank 1's state has another tree than rank 0's (paths only on rank 0: [\"['a']\"]")):
        simulate(2, other_tree)
    assert os.listdir(tmp_path) == []
