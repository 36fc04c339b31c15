"""Optimizer cases through the engine (shard / reduce_scatter / gather), shared by the simulated
and the gloo tests: the model, per-rank gradients, ours and torch.optim's reference."""

from __future__ import annotations

import torch

import ragged as rg
from ragged import spec

STEPS = 4


def _params():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"emb": r(9, 6), "blocks": [{"w": r(6, 6), "b": r(6)}, {"w": r(5, 6), "b": r(5)}], "norm": r(6)}


SPECS = {"emb": spec.Rows(1), "blocks": [{"w": spec.Rows(2), "b": spec.Elements(1)}] * 2, "norm": spec.Replicate()}


def _rank_grads(step, rank):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return rg.pytree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), _params())


def _mean_grads(step, world_size):
    per = [_rank_grads(step, r) for r in range(world_size)]
    return rg.pytree.map(lambda *xs: sum(xs) / len(xs), *per)


def _ours(comm, make_opt, split=None):
    """``split``: optional ``plan -> plan`` (e.g. ``rg.testing.with_buffers``: a multi-buffer plan)."""
    params = _params()
    plan = rg.make_plan(params, SPECS, world_size=comm.world_size)
    if split is not None:
        plan = split(plan)
    local = rg.shard(plan, params, comm)
    opt = make_opt(comm)
    state = opt.init(local)
    for step in range(STEPS):
        g = rg.reduce_scatter(plan, _rank_grads(step, comm.rank), comm, op="mean")
        updates, state = opt.update(g, state, local)
        local = rg.apply_updates(local, updates)
    return rg.gather(local, comm)


def _reference(make_torch, world_size, clip=None):
    params = rg.pytree.map(lambda p: p.clone().requires_grad_(True), _params())
    leaves = rg.pytree.leaves(params)
    opt = make_torch(leaves)
    for step in range(STEPS):
        for p, g in zip(leaves, rg.pytree.leaves(_mean_grads(step, world_size))):
            p.grad = g.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(leaves, clip)
        opt.step()
    return rg.pytree.map(lambda p: p.detach(), params)


CASES = {
    "sgd-nesterov": (lambda comm: rg.optim.sgd(0.1, momentum=0.9, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), None),
    "adamw": (lambda comm: rg.optim.adamw(0.02, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1), None),
    # max_norm below the gradients' norm, so clipping is active on every step
    "clip+adamw": (lambda comm: rg.optim.chain(rg.optim.clip_by_global_norm(0.5, comm=comm),
                                               rg.optim.adamw(0.02, weight_decay=0.1)),
                   lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1), 0.5),
    "clip+sgd": (lambda comm: rg.optim.chain(rg.optim.clip_by_global_norm(0.5, comm=comm), rg.optim.sgd(0.3)),
                 lambda ps: torch.optim.SGD(ps, lr=0.3), 0.5),
}

def _adamw8_state(comm, split=None):
    """``split``: optional ``plan -> plan`` (e.g. ``rg.testing.with_buffers``: a multi-buffer plan)."""
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(96, 80, generator=g), "e": torch.randn(2, 64, 40, generator=g), "v": torch.randn(6000, generator=g)}
    specs = {"w": spec.Blocks(32, 32), "e": spec.Blocks(32, 16), "v": spec.Elements(256)}
    plan = rg.make_plan(params, specs, world_size=comm.world_size)
    if split is not None:
        plan = split(plan)
    local = rg.shard(plan, params, comm)
    opt = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000)
    state = opt.init(local)
    for step in range(3):
        gr = torch.Generator().manual_seed(100 + step)
        grads = rg.pytree.map(lambda p: torch.randn(p.shape, generator=gr), params)
        if comm.rank:  # rank 0 contributes the gradient, the others zeros: the sum is exact
            grads = rg.pytree.map(torch.zeros_like, grads)
        gs = rg.reduce_scatter(plan, grads, comm, op="sum")
        updates, state = opt.update(gs, state, local)
        local = rg.apply_updates(local, updates)
    return rg.optim.adam8bit_leaf_state(state[0].moments, local, min_size=1000), rg.gather(local, comm)
