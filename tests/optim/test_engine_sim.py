"""Optimizers through the real engine (rg.shard / reduce_scatter / gather) on simulated ranks,
against single-process torch.optim on the same global batch (float64)."""

import pytest
import torch

import ragged as rg

from tests.optim._cases import concat_over_ranks
from tests.optim._engine_cases import CASES, SPECS, _adamw8_state, _ours, _params, _reference


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch(name, world_size):
    make_opt, make_torch, clip = CASES[name]
    results = rg.collectives.simulate(world_size, _ours, make_opt)
    ref = _reference(make_torch, world_size, clip)
    for full in results:
        rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12), full, ref)


def _norm(comm):
    params = _params()
    plan = rg.make_plan(params, SPECS, world_size=comm.world_size)
    return rg.optim.tree_norm(rg.shard(plan, params, comm), comm=comm)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_global_norm_counts_replicated_once(world_size):
    want = torch.sqrt(sum((p.double() ** 2).sum() for p in rg.pytree.leaves(_params())))
    for got in rg.collectives.simulate(world_size, _norm):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)



def test_adamw_8bit_state_identical_through_engine():
    """Same check as tests/optim/test_quant8.py, with the engine's shard / reduce_scatter."""
    by_m = {}
    for m in (1, 2, 4):
        results = rg.collectives.simulate(m, _adamw8_state)
        by_m[m] = (concat_over_ranks([per_rank for per_rank, _ in results]), results[0][1])
    for m in (2, 4):
        for path, parts in by_m[1][0].items():
            for k, v in parts.items():
                assert torch.equal(by_m[m][0][path][k], v), (m, path, k)
        rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), by_m[m][1], by_m[1][1])
