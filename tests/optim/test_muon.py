"""Distributed Muon vs single-process torch.optim.Muon (+ AdamW for the rest), simulated ranks."""

import pytest
import torch

import ragged as rg
from ragged import spec

STEPS = 4
LR, WD, MOM = 0.02, 0.1, 0.9


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        "wide": r(24, 40),
        "tall": r(48, 16),  # rows > cols: NS on the transpose, lr scaled by sqrt(3)
        "square": r(32, 32),
        "experts": r(3, 16, 24),  # each expert is its own Muon matrix
        "bias": r(40),  # AdamW
        "norm": r(16),  # Replicate, AdamW
    }


SPECS = {"wide": spec.Rows(1), "tall": spec.Rows(4), "square": spec.Blocks(8, 8), "experts": spec.Rows(2),
         "bias": spec.Elements(1), "norm": spec.Replicate()}


def _grads(step):
    g = torch.Generator().manual_seed(77 + step)
    return rg.pytree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), _params())


def _reference():
    params = _params()
    mats, rest = [], []
    leaves = {}
    for k, v in params.items():
        if v.ndim == 2:
            leaves[k] = [v.clone().requires_grad_(True)]
            mats += leaves[k]
        elif v.ndim == 3:
            leaves[k] = [e.clone().requires_grad_(True) for e in v]
            mats += leaves[k]
        else:
            leaves[k] = [v.clone().requires_grad_(True)]
            rest += leaves[k]
    o1 = torch.optim.Muon(mats, lr=LR, weight_decay=WD, momentum=MOM, nesterov=True, ns_steps=5)
    o2 = torch.optim.AdamW(rest, lr=1e-2, weight_decay=WD)
    for step in range(STEPS):
        grads = _grads(step)
        for k, ps in leaves.items():
            gs = [grads[k]] if len(ps) == 1 else list(grads[k])
            for p, g in zip(ps, gs):
                p.grad = g.clone()
        o1.step()
        o2.step()
    return {k: (ps[0] if len(ps) == 1 else torch.stack(ps)).detach() for k, ps in leaves.items()}


def _ours(comm, num_waves):
    params = _params()
    plan = rg.make_plan(params, SPECS, world_size=comm.world_size)
    local = rg.shard(plan, params, comm)
    opt = rg.optim.muon(LR, comm=comm, momentum=MOM, weight_decay=WD,
                        adam=rg.optim.adamw(1e-2, weight_decay=WD), num_waves=num_waves)
    state = opt.init(local)
    for step in range(STEPS):
        g = rg.shard(plan, _grads(step), comm)
        updates, state = opt.update(g, state, local)
        local = rg.apply_updates(local, updates)
    return rg.gather(local, comm), rg.optim.muon_load(plan)


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
        biggest = max(u.cost for u in load["units"])
        assert max(load["flops"]) - min(load["flops"]) <= biggest
        assert sum(load["matrices"]) == 13 + 8


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
        assert max(load["flops"]) - min(load["flops"]) <= max(u.cost for u in load["units"])
