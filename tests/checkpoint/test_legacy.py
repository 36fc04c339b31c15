"""A checkpoint written by an older ragged (every entry kind, no manifest checksum) loads and
consolidations with this one, at its world size and others, bit for bit."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import ragged as rg
from tests.checkpoint._legacy import FIXTURE, SCALARS, legacy_state, model
from tests.checkpoint._util import tree_leaves_by_path

simulate = rg.collectives.simulate


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        elif isinstance(v, float) and math.isnan(v):
            assert math.isnan(b[k]), k
        else:
            assert v == b[k], k


def test_fixture_is_a_legacy_checkpoint():
    manifest = rg.checkpoint.read_manifest(FIXTURE)
    assert "checksum" not in manifest and manifest["world_size"] == 2
    kinds = {e["kind"] for e in manifest["entries"].values()}
    assert kinds == {"dbuffer", "tensor", "per_rank", "quant8", "packed", "plan", "value"}


def test_legacy_consolidate():
    flat = rg.checkpoint.consolidate(FIXTURE)
    for k, v in SCALARS.items():
        assert flat.get(k) == v  # None is an empty pytree node, not an entry
    assert math.isnan(flat["loss"])
    for name, t in model(0).items():
        assert torch.equal(flat[f"params.{name}"], t)
    assert flat["rng@rank1"].tolist() == [10, 11, 12, 13]
    assert flat["adam8.0.moments.w1.mu_codes"].dtype == torch.uint8


@pytest.mark.parametrize("m", [1, 2, 3])
def test_legacy_loads_at_any_world_size_and_round_trips(tmp_path, m):
    """Load the old checkpoint on m ranks, save it again with this ragged: the new consolidation equals
    the old one bit for bit (every kind's data carried exactly)."""
    src = tmp_path / "legacy"
    shutil.copytree(FIXTURE, src)  # the fixture stays read-only
    again = tmp_path / "again"

    def fn(comm):
        state = rg.checkpoint.load(src, legacy_state(comm, seed=1), comm, strict=m == 2)
        assert state["step"] == 7 and math.isnan(state["loss"])
        full = tree_leaves_by_path(rg.gather(state["params"], comm))
        want = tree_leaves_by_path(model(0))
        assert all(torch.equal(full[p], want[p]) for p in want)
        rg.checkpoint.save(again, state, comm)

    if m == 2:
        simulate(m, fn)
    else:  # per-rank values do not move to another number of ranks
        def other(comm):
            like = legacy_state(comm, seed=1)
            del like["rng"]
            state = rg.checkpoint.load(src, like, comm, strict=False)
            rg.checkpoint.save(again, state, comm)

        simulate(m, other)
    old, new = rg.checkpoint.consolidate(src), rg.checkpoint.consolidate(again)
    if m != 2:
        old = {k: v for k, v in old.items() if not k.startswith("rng@")}
    _same(old, new)
    assert "checksum" in rg.checkpoint.read_manifest(again)
