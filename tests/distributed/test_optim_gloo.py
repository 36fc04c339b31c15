"""The optimizers on real gloo process groups (2 and 4 ranks, a 2 x 2 HSDP mesh), against single-process
torch.optim / single-rank references / references written from the papers (float64 where the optimizer allows)."""


import pytest
import torch


import ragged as rg
from bench._counts import CommCounter
from tests.distributed._harness import TRANSPORTS, comm, mesh, workers_2_and_4
from tests.optim import _engine_cases as sim
from tests.optim import _precond_cases as cases
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


PRECOND = {"soap": cases.make_soap, "shampoo": cases.make_shampoo}


def _rank_grads(step: int, index: int) -> dict:
    return cases.grads(cases.exact_params(), 1, seed=1000 * step + index)[0]


_COUNTER: list = []


def _torch_counter() -> CommCounter:
    """One counter per worker process, patched onto torch's ProcessGroup once."""
    if not _COUNTER:
        _COUNTER.append(CommCounter())
        _COUNTER[0].install_torch("update")
    return _COUNTER[0]


def _precond_train(name: str, hsdp: bool, options: tuple):
    options = dict(options)
    c = rg.collectives.from_torch(mesh((2, 2)), **options) if hsdp else comm(**options)
    index, total = c.replica_rank * c.world_size + c.rank, c.world_size * c.num_replicas
    params = cases.exact_params()
    plan = rg.make_plan(params, cases.EXACT_SPECS, world_size=c.world_size)
    counter = _torch_counter()
    counter.reset()
    out = {}
    for run in ("train", "same"):  # per-rank gradients, averaged; or the same gradients on every rank
        local = rg.shard(plan, params, c)
        opt = PRECOND[name]()
        state = opt.init(local)
        for step in range(cases.STEPS):
            full = _rank_grads(step, index) if run == "train" else cases.grads(params)[step]
            g = rg.reduce_scatter(plan, full, c, op="mean")  # "same": the mean of 2 or 4 equal values is exact
            counter.active = "update"
            updates, state = opt.update(g, state, local)
            counter.active = None
            local = rg.apply_updates(local, updates)
        out[run] = rg.gather(local, c) if run == "train" else (local, state)
    if index == 0:  # the one-rank run, in a worker (one thread, as the ranks)
        out["one"] = cases.run_world(params, cases.EXACT_SPECS, cases.grads(params), PRECOND[name], 1)
    out["calls"] = dict(counter.calls)
    out["index"] = index
    return out


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("where", ["w2", "w4", "hsdp-2x2"])
@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_soap_shampoo_exact_invariant_and_silent(workers2, workers4, name, where, transport):
    """SOAP and Shampoo on 2 and 4 ranks and a 2 x 2 HSDP mesh, in both transports: float64 training
    (gradients reduce-scattered) equals the single-process references written from the papers within
    1e-10; given the same gradients, every rank's parameters and state are bit-identical to a
    one-rank run; ``opt.update`` issues no collective at the torch.distributed boundary."""
    pool, hsdp = (workers2, False) if where == "w2" else (workers4, where == "hsdp-2x2")
    results = sorted(pool.run(_precond_train, name, hsdp, tuple(TRANSPORTS[transport].items())), key=lambda r: r["index"])
    total = len(results)
    params = cases.exact_params()
    mean = [{k: sum(_rank_grads(s, i)[k] for i in range(total)) / total for k in params} for s in range(cases.STEPS)]
    want = cases.reference(name, params, mean)
    for r in results:
        assert r["calls"] == {}, f"rank {r['index']}: the update issued {r['calls']}"
        for k, v in want.items():
            torch.testing.assert_close(r["train"][k], v, rtol=1e-10, atol=1e-10, msg=lambda m: f"{k}: {m}")
    shard_group = total // 2 if hsdp else total
    plan = results[0]["same"][0].plan
    for replica in range(total // shard_group):
        ranks = [r["same"] for r in results[replica * shard_group:(replica + 1) * shard_group]]
        cases.assert_bit_identical(cases.whole(plan, ranks), results[0]["one"], f"{name} replica {replica}")
