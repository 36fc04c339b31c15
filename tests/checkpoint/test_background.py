"""``rg.checkpoint.save(..., blocking=False)`` on the simulated backend (threads; real files): see
[Note: a save in the background] in ``ragged/checkpoint/_background.py``. A rank killed during a
background save, on gloo: ``tests/distributed/test_checkpoint_faults.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ragged as rg
from ragged.checkpoint import CheckpointError
from ragged.checkpoint import _dcp
from tests.checkpoint._util import full_trees, make_state, plan_for, tree_leaves_by_path

simulate = rg.collectives.simulate


def _state(rank, plan, step):
    return make_state(rank, plan, full_trees(step), step=step)


def _equal(a, b):
    a, b = tree_leaves_by_path(a), tree_leaves_by_path(b)
    return a.keys() == b.keys() and all(torch.equal(x, b[k]) if isinstance(x, torch.Tensor) else x == b[k]
                                        for k, x in a.items())


def test_returns_staged_copies_and_publishes_at_the_next_save(tmp_path):
    plan = plan_for(full_trees()["params"], 2)
    first, second = str(tmp_path / "1"), str(tmp_path / "2")

    def run(comm):
        state = _state(comm.rank, plan, 1)
        handle = rg.checkpoint.save(first, state, comm, blocking=False)
        staged_at_return = (_bytes(_pieces_of(state, comm)), handle.staged_bytes, _bytes(_tensors_of(state)))
        state["params"].data.zero_()  # the step donates its buffers: the copies were taken at the call
        for opt in state["opt"]:
            opt.mu.data.zero_()
        unpublished = os.path.exists(first)
        later = rg.checkpoint.save(second, _state(comm.rank, plan, 2), comm, blocking=False)
        published = os.path.exists(first)  # the next save finished the one in flight
        manifest = later.result()
        loaded = rg.checkpoint.load(first, _state(comm.rank, plan, 0), comm)
        return staged_at_return, unpublished, published, manifest, loaded, handle.result()

    out = simulate(2, run)
    want = simulate(2, lambda comm: _state(comm.rank, plan, 1))
    for r, (staged, unpublished, published, manifest, loaded, first_manifest) in enumerate(out):
        assert not unpublished and published
        assert _equal(loaded, want[r]) and loaded["step"] == 1
        assert manifest["entries"] and first_manifest["files"] == out[0][5]["files"]
        pieces, staged_bytes, state_bytes = staged
        assert pieces <= staged_bytes <= state_bytes  # one host copy of what it writes (and the gaps between)
    blocking = str(tmp_path / "blocking")
    simulate(2, lambda comm: rg.checkpoint.save(blocking, _state(comm.rank, plan, 1), comm))
    data = lambda p: {k: v for k, v in rg.checkpoint.read_manifest(p)["files"].items() if k != ".metadata"}  # noqa: E731
    assert data(first) == data(blocking)  # the same bytes as a blocking save's (.metadata names its directory)


def _pieces_of(state, comm):
    from ragged.checkpoint._save import describe_state, flatten_state

    paths, leaves, _ = flatten_state(state)
    kinds, _ = describe_state(paths, leaves, comm, "state")
    return [pc.tensor for p, leaf, kind in zip(paths, leaves, kinds) for pc in kind.pieces(p, leaf, comm.rank, comm.rank)]


def _tensors_of(state):
    return [t for t in rg.pytree.leaves(rg.pytree.map(lambda d: (d.data, d.replicated) if isinstance(d, rg.DBuffer) else d,
                                                      state, is_leaf=lambda x: isinstance(x, rg.DBuffer)))
            if isinstance(t, torch.Tensor)]


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_an_error_in_the_background_is_raised_on_every_rank(tmp_path, monkeypatch):
    plan = plan_for(full_trees()["params"], 2)
    path = str(tmp_path / "ckpt")

    def fail_on_rank_1(step):  # the writing thread of rank 1 fails once its files are written
        if step == "written" and threading.current_thread().name.endswith("rank 1"):
            raise OSError("disk full")

    monkeypatch.setattr(_dcp, "FAULT", fail_on_rank_1)

    def run(comm):
        handle = rg.checkpoint.save(path, _state(comm.rank, plan, 1), comm, blocking=False)
        errors = []
        for again in (lambda: rg.checkpoint.save(path + "-next", _state(comm.rank, plan, 2), comm, blocking=False),
                      handle.result):  # the next save raises it, and the handle keeps it
            try:
                again()
            except CheckpointError as e:
                errors.append(str(e))
        return errors

    out = simulate(2, run)
    for errors in out:
        assert len(errors) == 2 and errors[0] == errors[1]
        assert "failed on rank 1" in errors[0] and "OSError: disk full" in errors[0]
    assert os.listdir(tmp_path) == []  # nothing published, the hidden directory removed


def test_the_interpreter_exit_publishes_the_save_in_flight(tmp_path):
    path = str(tmp_path / "ckpt")
    code = textwrap.dedent(f"""
        import torch, ragged as rg
        rg.checkpoint.save({path!r}, {{"x": torch.arange(4.0), "step": 9}}, rg.checkpoint.SingleProcess(), blocking=False)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    got = rg.checkpoint.load(path, {"x": torch.zeros(4), "step": 0}, rg.checkpoint.SingleProcess())
    assert got["step"] == 9 and got["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
