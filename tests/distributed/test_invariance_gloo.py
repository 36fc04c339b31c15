"""The chunked step (``fsdp.make_step(..., chunks=4)``) on real gloo processes, in both transports:
every step's loss, the final parameters and the optimizer state at W = 2 and 4 and HSDP 2 x 2
equal W = 1 bit for bit (dense and MoE; AdamW with clipping, 8-bit AdamW, SOAP), and a run saved
at W = 2 and resumed at W = 4 equals the run that never stopped.

One pool of 4 workers serves the module (see tests/fsdp/_invariance_cases.py): rank 0 trains W=1
alone while ranks 2 and 3 train W=2, then all four train W=4 and HSDP 2 x 2. The other world sizes
and the rest of what the step goes through run simulated in tests/fsdp/test_invariance.py.
"""

from __future__ import annotations

import pytest

import ragged as rg
from ragged import fsdp
from tests.distributed._harness import both_transports, comm, group, mesh, rank, workers_fixture
from tests.distributed._harness import transport as transport_options
from tests.fsdp import _invariance_cases as ic

pytestmark = pytest.mark.distributed

workers4 = workers_fixture(4)
transport = both_transports()


def _sub(ranks):
    """The comm of ``ranks`` on its members, else None (collective: every rank calls it)."""
    g = group(ranks)
    return rg.collectives.from_torch(g, **transport_options()) if rank() in ranks else None


def _world_sizes(kind, opt, control=False):
    alone, pair = _sub((0,)), _sub((2, 3))
    out = {}
    if alone is not None:
        out["W=1"] = ic.train(alone, kind, opt)
    if pair is not None:
        out["W=2"] = ic.train(pair, kind, opt)
        if control:  # the default step at W=2, contiguous rows: not W=1's numbers (the test can fail)
            out["control"] = ic.train(pair, kind, opt, chunks=None)
    out["W=4"] = ic.train(comm(), kind, opt)
    out["HSDP 2x2"] = ic.train(rg.collectives.from_torch(mesh((2, 2)), **transport_options()), kind, opt)
    return out


@pytest.mark.parametrize("kind, opt", [("dense", "adamw+clip"), ("dense", "adamw_8bit"), ("dense", "soap"),
                                       ("moe", "adamw+clip"), ("moe", "adamw_8bit"), ("moe", "soap")])
def test_every_world_size_gives_the_numbers_of_one_rank(workers4, kind, opt):
    control = (kind, opt) == ("dense", "adamw+clip")
    results = workers4.run(_world_sizes, kind, opt, control, timeout=300)
    ref = results[0]["W=1"]
    assert ref[0][0] != ref[0][1]  # the steps trained
    for r, res in enumerate(results):
        for key, got in res.items():
            if key == "control":
                assert not ic.same(got, ref), "the default step at W=2 gave W=1's numbers: the test cannot fail"
            else:
                assert ic.same(got, ref), f"rank {r}, {key}: {ic.difference(got, ref)}"


def _resume(path):
    """Rank 1 trains 2 steps alone; ranks 2, 3 train step 0 at W=2 and save; all four load at W=4
    and train step 1."""
    alone, pair = _sub((1,)), _sub((2, 3))
    opt, out = "adamw_8bit", {}
    if alone is not None:
        out["W=1"] = ic.train(alone, "dense", opt)
    if pair is not None:
        losses, _, _, state, units = ic.train(pair, "dense", opt, steps=1, return_state=True)
        bound = rg.checkpoint.bind_quant8(state.opt_state, fsdp.trainable_shards(units, state.shards), min_size=64)
        rg.checkpoint.save(path, {"shards": state.shards, "opt": bound, "losses": losses}, pair)
    comm().barrier()  # the others wait for the checkpoint to be published
    c = comm()
    _, _, _, like, units = ic.train(c, "dense", opt, steps=0, return_state=True)
    bound = rg.checkpoint.bind_quant8(like.opt_state, fsdp.trainable_shards(units, like.shards), min_size=64)
    loaded = rg.checkpoint.load(path, {"shards": like.shards, "opt": bound, "losses": [0.0]}, c)
    state = fsdp.TrainState(loaded["shards"], rg.checkpoint.unbind(loaded["opt"]))
    losses, full, opt_state = ic.train(c, "dense", opt, steps=1, state=state, start=1)
    out["resumed at W=4"] = (loaded["losses"] + losses, full, opt_state)
    return out


def test_a_run_saved_at_two_ranks_resumes_at_four_with_the_numbers_of_one(workers4, tmp_path):
    results = workers4.run(_resume, str(tmp_path / "ckpt"), timeout=300)
    ref = results[1]["W=1"]
    for r, res in enumerate(results):
        got = res["resumed at W=4"]
        assert ic.same(got, ref), f"rank {r}: {ic.difference(got, ref)}"
