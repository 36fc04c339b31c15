"""The simplest real training loop over the public API (shard, gather, torch.func.grad,
reduce_scatter, rg.optim), used to check that a resumed run equals an uninterrupted one."""

from __future__ import annotations

import torch

import ragged as rg
from ragged import spec

GLOBAL_BATCH = 8


def model_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(6, 16, generator=g) * 0.4,
        "b1": torch.randn(16, generator=g) * 0.1,
        "w2": torch.randn(16, 3, generator=g) * 0.4,
        "b2": torch.randn(3, generator=g) * 0.1,
    }


SPECS = {
    "rows": None,
    "elements": spec.Elements(1),
    "blocks": {"w1": spec.Blocks(2, 8), "b1": None, "w2": spec.Rows(2), "b2": spec.Replicate()},
    # 8-bit Adam quantizes blocks of >= 32 elements: w1 in 2x16 tiles, w2 in runs of 32
    "blocks8": {"w1": spec.Blocks(2, 16), "b1": None, "w2": spec.Elements(32), "b2": spec.Replicate()},
}
MIN_SIZE_8BIT = 32


def loss_fn(p, x, y):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] + p["b2"] - y) ** 2).mean()


def optimizer(name: str = "adamw", comm=None):
    if name == "muon":  # Newton-Schulz on w1 / w2 (owner ranks), AdamW for the biases
        return rg.optim.muon(2e-2, comm=comm, weight_decay=0.01)
    if name == "adamw":
        return rg.optim.adamw(3e-2, weight_decay=0.01)
    if name == "adamw_8bit":
        return rg.optim.adamw_8bit(3e-2, weight_decay=0.01, min_size=MIN_SIZE_8BIT)
    if name == "sgd":
        return rg.optim.sgd(5e-2, momentum=0.9, nesterov=True)
    raise ValueError(name)


def init_state(comm, granularity: str = "rows", opt: str = "adamw", seed: int = 0):
    params = model_params(seed)
    specs = SPECS[granularity] if isinstance(granularity, str) else granularity
    plan = rg.make_plan(params, specs, world_size=comm.world_size)
    local = rg.shard(plan, params, comm)
    return {
        "params": local,
        "opt": optimizer(opt, comm).init(local),
        "step": 0,
        "data_rng": torch.Generator().manual_seed(1000 + seed).get_state(),
    }


def train(comm, state, steps: int, opt: str = "adamw"):
    """``steps`` steps of data-parallel training on a global batch of 8 drawn from the state's
    own RNG (so the data stream resumes exactly); returns the new state."""
    tx = optimizer(opt, comm)
    local, opt_state = state["params"], state["opt"]
    gen = torch.Generator()
    gen.set_state(state["data_rng"])
    m, r = comm.world_size, comm.rank
    b = GLOBAL_BATCH // m
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, 6, generator=gen)
        y = torch.randn(GLOBAL_BATCH, 3, generator=gen)
        full = rg.pytree.map(lambda t: t.detach(), rg.gather(local, comm))
        grads = torch.func.grad(loss_fn)(full, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b])
        g = rg.reduce_scatter(local.plan, grads, comm, op="mean")
        updates, opt_state = tx.update(g, opt_state, local)
        local = rg.apply_updates(local, updates)
    return {"params": local, "opt": opt_state, "step": state["step"] + steps, "data_rng": gen.get_state()}


def full_params(comm, state):
    """The gathered parameters (every rank), detached copies."""
    return rg.pytree.map(lambda t: t.detach().clone(), rg.gather(state["params"], comm))


def bound(state, opt: str = "adamw"):
    """The state as the checkpoint takes it: optimizer states that are not plain DBuffers bound
    to what describes them (8-bit moments to their params, Muon's packed AdamW part to its labels)."""
    if opt == "muon":
        return dict(state, opt=rg.checkpoint.bind_muon(state["opt"]))
    if opt == "adamw_8bit":
        return dict(state, opt=rg.checkpoint.bind_quant8(state["opt"], state["params"], min_size=MIN_SIZE_8BIT))
    return state


def unbound(state):
    return dict(state, opt=rg.checkpoint.unbind(state["opt"]))
