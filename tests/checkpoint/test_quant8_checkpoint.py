"""8-bit Adam state (codes + per-block scales) survives a world-size change exactly."""

from __future__ import annotations

import re

import pytest
import torch

import ragged as rg
from ragged import spec
from ragged.checkpoint import CheckpointMismatchError
from ragged.optim._quant8 import adam8bit_leaf_state
from tests.checkpoint import _train

simulate = rg.collectives.simulate
OPT = "adamw_8bit"
MIN = _train.MIN_SIZE_8BIT
# Same blocks for the quantized leaves, other layout for the rest (b1 sharded by elements,
# b2 sharded instead of replicated): codes still carry over.
SPECS_OTHER = {"w1": spec.Blocks(2, 16), "b1": spec.Elements(1), "w2": spec.Elements(32), "b2": spec.Rows(1)}


def _leaf_state(comm, state):
    """This rank's 8-bit state per leaf (codes, scales, fp32 moments)."""
    moments = state["opt"][0].moments
    moments = moments.moments if isinstance(moments, rg.checkpoint.Quant8) else moments
    return {k: {n: t.clone() for n, t in v.items()} for k, v in adam8bit_leaf_state(moments, state["params"], min_size=MIN).items()}


def _concat(per_rank, replicated=("['b2']",)):
    """Whole-leaf state: each leaf's parts concatenated over ranks in rank order."""
    out = {}
    for leaf in sorted({leaf for r in per_rank for leaf in r}):
        ranks = [r for r in per_rank if leaf in r]
        ranks = ranks[:1] if leaf in replicated else ranks
        out[leaf] = {part: torch.cat([r[leaf][part] for r in ranks]) for part in ranks[0][leaf]}
    return out


def _trained_and_saved(path, m, steps=3):
    def fn(comm):
        state = _train.train(comm, _train.init_state(comm, "blocks8", opt=OPT), steps, OPT)
        to_save = dict(state, opt=rg.checkpoint.bind_quant8(state["opt"], state["params"], min_size=MIN))
        rg.checkpoint.save(path, to_save, comm)
        return _leaf_state(comm, state)

    return _concat(simulate(m, fn))


def _loaded(path, m, specs="blocks8"):
    def fn(comm):
        like = _train.init_state(comm, specs, opt=OPT, seed=3)
        like["opt"] = rg.checkpoint.bind_quant8(like["opt"], like["params"], min_size=MIN)
        state = rg.checkpoint.load(path, like, comm)
        state["opt"] = rg.checkpoint.unbind(state["opt"])
        return _leaf_state(comm, state)

    return simulate(m, fn)


@pytest.mark.parametrize("m_save, m_load", [(4, 2), (4, 1), (2, 4), (1, 3)])
def test_8bit_state_survives_world_size_change_exactly(tmp_path, m_save, m_load):
    path = tmp_path / "ckpt"
    saved = _trained_and_saved(path, m_save)
    assert saved["['w1']"]["mu_codes"].dtype == torch.uint8 and saved["['w1']"]["mu_scales"].numel() == 3  # (6, 16) in 2x16 tiles
    assert (saved["['w1']"]["mu_codes"] != saved["['w1']"]["mu_codes"][0]).any()  # real, varied codes
    loaded = _concat(_loaded(path, m_load))
    assert loaded.keys() == saved.keys()
    for leaf in saved:
        for part in saved[leaf]:
            assert torch.equal(loaded[leaf][part], saved[leaf][part]), (leaf, part)


def test_8bit_state_into_another_layout_with_the_same_blocks(tmp_path):
    path = tmp_path / "ckpt"
    saved = _trained_and_saved(path, 4)
    loaded = _concat(_loaded(path, 2, SPECS_OTHER), replicated=())
    for leaf in ("['w1']", "['w2']"):
        for part in saved[leaf]:
            assert torch.equal(loaded[leaf][part], saved[leaf][part]), (leaf, part)
    exported = rg.checkpoint.consolidate(path)
    torch.testing.assert_close(exported["opt.0.moments.w1.mu_codes"].reshape(-1), saved["['w1']"]["mu_codes"], rtol=0, atol=0)
    torch.testing.assert_close(exported["opt.0.moments.w2.nu_scales"], saved["['w2']"]["nu_scales"], rtol=0, atol=0)
    torch.testing.assert_close(exported["opt.0.moments.b1.mu"], saved["['b1']"]["mu"], rtol=0, atol=0)


def test_8bit_codes_refused_into_other_blocks(tmp_path):
    path = tmp_path / "ckpt"
    _trained_and_saved(path, 2)
    other = {"w1": spec.Blocks(2, 32), "b1": None, "w2": spec.Rows(1), "b2": spec.Replicate()}
    with pytest.raises(CheckpointMismatchError) as info:
        _loaded(path, 2, other)
    text = str(info.value)
    assert re.search(r"like_state\['opt'\]\[0\]\.moments\['w1'\]: saved with 8-bit blocks \(2, 16\), like_state's optimizer keeps 8-bit blocks \(2, 32\)", text)
    assert "moments['w2']: saved with 8-bit blocks (1, 32), like_state's optimizer keeps fp32 moments" in text


@pytest.mark.parametrize("m_before, m_after", [(4, 2), (2, 4), (2, 2)])
def test_8bit_resume_equals_uninterrupted(tmp_path, m_before, m_after):
    path = tmp_path / "ckpt"
    _trained_and_saved(path, m_before)

    def second(comm):
        like = _train.init_state(comm, "blocks8", opt=OPT, seed=5)
        like["opt"] = rg.checkpoint.bind_quant8(like["opt"], like["params"], min_size=MIN)
        state = rg.checkpoint.load(path, like, comm)
        state["opt"] = rg.checkpoint.unbind(state["opt"])
        return _train.full_params(comm, _train.train(comm, state, 3, OPT))

    def uninterrupted(comm):
        return _train.full_params(comm, _train.train(comm, _train.init_state(comm, "blocks8", opt=OPT), 6, OPT))

    resumed, reference = simulate(m_after, second)[0], simulate(m_after, uninterrupted)[0]
    for k in reference:
        torch.testing.assert_close(resumed[k], reference[k], msg=k)


def test_8bit_elements_blocks_split_across_ranks(tmp_path):
    """An Elements(32) leaf cut between ranks at different block offsets (4 ranks: every 64
    elements; 3 ranks: every 96) keeps codes and scales exactly."""
    params = {"v": torch.randn(256, generator=torch.Generator().manual_seed(0))}
    specs = {"v": spec.Elements(32)}
    tx = rg.optim.adamw_8bit(1e-2, min_size=32)
    path = tmp_path / "ckpt"

    def leaf_state(local, state):
        return {k: v.clone() for k, v in adam8bit_leaf_state(state[0].moments, local, min_size=32)["['v']"].items()}

    def save(comm):
        plan = rg.make_plan(params, specs, world_size=comm.world_size)
        assert all(p.start % 32 == 0 for p in plan.local_pieces(comm.rank))
        local = rg.shard(plan, params, comm)
        state = tx.init(local)
        for seed in range(2):
            grads = {"v": torch.randn(256, generator=torch.Generator().manual_seed(10 + seed))}
            _, state = tx.update(rg.shard(plan, grads, comm), state, local)
        rg.checkpoint.save(path, {"opt": rg.checkpoint.bind_quant8(state, local, min_size=32)}, comm)
        return leaf_state(local, state), [p.start for p in plan.local_pieces(comm.rank)]

    def load(comm):
        plan = rg.make_plan(params, specs, world_size=comm.world_size)
        local = rg.shard(plan, params, comm)
        like = {"opt": rg.checkpoint.bind_quant8(tx.init(local), local, min_size=32)}
        state = rg.checkpoint.unbind(rg.checkpoint.load(path, like, comm)["opt"])
        return leaf_state(local, state), [p.start for p in plan.local_pieces(comm.rank)]

    saved, loaded = simulate(4, save), simulate(3, load)
    assert [s[1] for s in saved] != [l[1] for l in loaded] and any(s[1] not in ([], [0]) for s in saved)
    for part in saved[0][0]:
        before = torch.cat([s[0][part] for s in saved])
        after = torch.cat([l[0][part] for l in loaded])
        assert torch.equal(before, after), part
    assert saved[0][0]["mu_scales"].numel() == 2 and torch.cat([s[0]["mu_scales"] for s in saved]).numel() == 8
