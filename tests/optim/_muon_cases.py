"""Distributed Muon cases shared by the simulated and the gloo tests: the model, gradients,
ours and torch.optim.Muon's reference."""

from __future__ import annotations

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
