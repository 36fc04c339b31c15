"""The optimizers on real gloo process groups (2 and 4 ranks), against single-process
torch.optim / single-rank references (float64 where the optimizer allows)."""


import pytest
import torch


import ragged as rg
from tests.distributed._harness import comm, workers_2_and_4
from tests.optim import _engine_cases as sim
from tests.optim._cases import concat_over_ranks
from tests.optim import _muon_cases as muon_tests

pytestmark = pytest.mark.distributed

workers2, workers4, workers = workers_2_and_4()


def _engine_case(name):
    return sim._ours(comm(), sim.CASES[name][0])


@pytest.mark.parametrize("name", ["adamw", "clip+adamw", "sgd-nesterov"])
def test_matches_torch_optim(workers, name):
    results = workers.run(_engine_case, name)
    ref = sim._reference(sim.CASES[name][1], workers.world_size, sim.CASES[name][2])
    for full in results:
        rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12), full, ref)


def _adamw8():
    return sim._adamw8_state(comm())


def test_adamw_8bit_state_bit_identical_to_one_rank(workers):
    (ref_state, ref_params), = rg.collectives.simulate(1, sim._adamw8_state)
    results = workers.run(_adamw8)
    state = concat_over_ranks([per_rank for per_rank, _ in results])
    assert state.keys() == ref_state.keys()
    for path, parts in ref_state.items():
        for k, v in parts.items():
            assert torch.equal(state[path][k], v), (path, k)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), results[0][1], ref_params)


def _muon(num_waves):
    return muon_tests._ours(comm(), num_waves)


def test_muon_matches_torch_muon(workers):
    results = workers.run(_muon, 3)
    ref = muon_tests._reference()
    for full, load in results:
        for k in ref:
            torch.testing.assert_close(full[k], ref[k], rtol=1e-10, atol=1e-10, msg=lambda m: f"{k}: {m}")
        biggest = max(u.cost for u in load["assignments"])
        assert max(load["flops"]) - min(load["flops"]) <= biggest
