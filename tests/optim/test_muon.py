"""Distributed Muon vs single-process torch.optim.Muon (+ AdamW for the rest), simulated ranks."""

import pytest
import torch

import ragged as rg

from tests.optim._muon_cases import LR, MOM, SPECS, STEPS, WD, _grads, _ours, _params, _reference


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("world_size,num_waves", [(1, 1), (2, 1), (2, 3), (4, 4)])
def test_matches_torch_muon(reference, world_size, num_waves):
    results = rg.collectives.simulate(world_size, _ours, num_waves)
    full, load = results[0]
    for k, ref in reference.items():
        # Newton-Schulz runs in bf16, but on the owner it sees the same matrix and runs the same
        # ops as torch.optim.Muon, so the results agree to float64 rounding (measured ~1e-15).
        torch.testing.assert_close(full[k], ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"{k}: {m}")
    for other, _ in results[1:]:
        rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), full, other)
    moved = (full["square"] - _params()["square"]).abs().max()
    assert moved > 0.5 * LR


def test_load_balanced_within_one_matrix():
    params = {f"w{i}": torch.empty(16 * (i % 5 + 1), 64, device="meta") for i in range(13)}
    params["experts"] = torch.empty(8, 64, 32, device="meta")
    for m in (2, 3, 4, 8):
        plan = rg.make_plan(params, world_size=m)
        load = rg.optim.muon_load(plan)
        biggest = max(u.cost for u in load["assignments"])
        assert max(load["flops"]) - min(load["flops"]) <= biggest
        assert sum(load["matrices"]) == 13 + 8


@pytest.mark.parametrize("world_size,max_buffers,num_waves", [(3, 1, 1), (5, "auto", 2), (8, "auto", 3), (7, 1, 4)])
def test_exchange_plan_moves_every_matrix_element_to_its_owner_once(world_size, max_buffers, num_waves):
    """The owner exchange of every rank, from each matrix's ends (no walk over ranks): what rank r sends
    j is what j expects from r, and the pieces each owner receives tile its matrices exactly."""
    from ragged.optim._muon_plan import exchange_waves, muon_matrices

    params = {f"w{i}": torch.empty(7 * (i % 4 + 1), 5 + i, device="meta") for i in range(9)}
    params["experts"] = torch.empty(3, 11, 6, device="meta")
    params["bias"] = torch.empty(13, device="meta")
    plan = rg.make_plan(params, world_size=world_size, max_buffers=max_buffers, align=1)
    (matrices,) = muon_matrices((plan,), rg.optim.default_muon_filter, 5)
    waves = [exchange_waves(plan, r, matrices, num_waves) for r in range(world_size)]
    where = {g: (r, rng.local_offset + g - rng.start)  # global position -> (rank, offset in its shard)
             for r in range(world_size) for rng in plan.shard_ranges(r) for g in range(rng.start, rng.stop)}
    assert len({len(w) for w in waves}) == 1
    for k in range(len(waves[0])):
        for r in range(world_size):
            for j in range(world_size):
                assert waves[r][k].send_splits[j] == waves[j][k].recv_splits[r]
        for r in range(world_size):
            w = waves[r][k]
            # the receive buffer, element by element: (sender j, offset in j's shard), senders in rank order
            recv = []
            for j, n in enumerate(w.recv_splits):
                before = sum(waves[j][k].send_splits[:r])  # j's send buffer holds its parts for ranks < r first
                recv += [(j, o + i) for o, length in waves[j][k].send_spans for i in range(length)][before:before + n]
            got = [None] * w.owned_numel  # each owned element: the (rank, shard offset) it came from
            for r_off, o_off, n in w.recv_spans:
                got[o_off:o_off + n] = recv[r_off:r_off + n]
            for u, off in w.owned:
                assert u.owner == r
                assert got[off:off + u.numel] == [where[g] for g in range(u.start, u.stop)], (r, u.path)
            assert None not in got


def test_rejects_4d_matrix_with_fix():
    params = {"conv": torch.randn(2, 2, 4, 4)}
    plan = rg.make_plan(params, world_size=1)
    d = rg.DBuffer(data=torch.zeros(plan.shard_size), replicated=torch.zeros(0), plan=plan, rank=0)
    with pytest.raises(ValueError, match=r"params\['conv'\] has shape \(2, 2, 4, 4\).*exclude it with muon_filter"):
        rg.optim.muon(0.1, comm=None, muon_filter=lambda leaf: True).init(d)


def test_wrong_comm_size_is_caught_at_init():
    params = {"w": torch.randn(8, 8)}
    plan = rg.make_plan(params, world_size=2)
    d = rg.DBuffer(data=torch.zeros(plan.shard_size), replicated=torch.zeros(0), plan=plan, rank=0)
    with pytest.raises(ValueError, match="world_size=2 but comm is None"):
        rg.optim.muon(0.1, comm=None).init(d)


def _ours_units(comm):
    """The same model split in two FSDP units (one plan each): owners balanced jointly."""
    params = _params()
    units = {"u0": {k: params[k] for k in ("wide", "bias", "norm")},
             "u1": {k: params[k] for k in ("tall", "square", "experts")}}
    plans = {n: rg.make_plan(u, {k: SPECS[k] for k in u}, world_size=comm.world_size) for n, u in units.items()}
    local = {n: rg.shard(plans[n], units[n], comm) for n in units}
    opt = rg.optim.muon(LR, comm=comm, momentum=MOM, weight_decay=WD, adam=rg.optim.adamw(1e-2, weight_decay=WD))
    state = opt.init(local)
    for step in range(STEPS):
        grads = _grads(step)
        g = {n: rg.shard(plans[n], {k: grads[k] for k in units[n]}, comm) for n in units}
        updates, state = opt.update(g, state, local)
        local = rg.apply_updates(local, updates)
    full = {}
    for n in units:
        full.update(rg.gather(local[n], comm))
    return full, rg.optim.muon_load(list(plans.values()))


@pytest.mark.parametrize("world_size", [2, 4])
def test_units_pytree_matches_torch_muon(reference, world_size):
    for full, load in rg.collectives.simulate(world_size, _ours_units):
        for k, ref in reference.items():
            torch.testing.assert_close(full[k], ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"{k}: {m}")
        assert sum(load["matrices"]) == 6
        assert max(load["flops"]) - min(load["flops"]) <= max(u.cost for u in load["assignments"])
        assert load["assignments"] and all(isinstance(u, rg.optim.MuonMatrix) for u in load["assignments"])
