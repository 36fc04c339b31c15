"""Small float64 models and training loops shared by the simulated and the gloo tests of
ragged.parallel: a TP MLP (fused gate/up column-parallel with a strided Shard, then
row-parallel) and an EP MoE layer (experts Shard(0) on "ep", top-2 routing with all_to_all).

Every training loop here is written once against a MeshComm; the single-process reference
uses plain tensors and ``torch.optim.AdamW``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ragged as rg
from ragged import parallel, spec

DT = torch.float64
LR, WD = 0.05, 0.1
STEPS = 3


def _rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=DT) * scale


# ---- TP MLP ------------------------------------------------------------------------------------
D, FF, LAYERS, BATCH = 8, 16, 2, 6


def tp_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks": [
            {
                "norm": 1 + _rand(g, D, scale=0.1),
                "w13": _rand(g, 2 * FF, D, scale=D**-0.5),  # fused [gate; up]: strided Shard(0, groups=2)
                "b13": _rand(g, 2 * FF, scale=0.1),
                "w2": _rand(g, D, FF, scale=FF**-0.5),
                "b2": _rand(g, D, scale=0.1),
            }
            for _ in range(LAYERS)
        ],
        "out": _rand(g, D, scale=0.1),
    }


def tp_specs(fsdp_blocks=True):
    block = {
        "norm": spec.Placements(dp=spec.Replicate()),  # whole on every rank of every axis
        "w13": {"dp": spec.Blocks(8, 8) if fsdp_blocks else spec.Rows(1), "tp": spec.Shard(0, groups=2)},
        "b13": {"tp": spec.Shard(0, groups=2)},
        "w2": {"dp": spec.Rows(1), "tp": spec.Shard(1)},
        "b2": None,
    }
    return {"blocks": [block] * LAYERS, "out": None}


def tp_forward(params, x, tp=None):
    """``tp``: the TP group's Collectives (None: unsharded reference)."""
    copy_to = (lambda t: parallel.copy_to(t, tp)) if tp is not None else (lambda t: t)
    reduce_from = (lambda t: parallel.reduce_from(t, tp)) if tp is not None else (lambda t: t)
    for blk in params["blocks"]:
        u = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * blk["norm"]
        u = copy_to(u)
        a = F.linear(u, blk["w13"], blk["b13"])
        gate, up = a.chunk(2, dim=-1)
        h = F.silu(gate) * up
        x = x + reduce_from(F.linear(h, blk["w2"])) + blk["b2"]
    return x * params["out"]


def tp_batch(step, index):
    g = torch.Generator().manual_seed(1000 + 17 * step + index)
    return _rand(g, BATCH, D), _rand(g, BATCH, D)


def tp_loss(params, batch, tp=None):
    x, y = batch
    return (tp_forward(params, x, tp) - y).pow(2).mean()


# ---- EP MoE ------------------------------------------------------------------------------------
E, H, TOKENS, TOPK = 4, 12, 10, 2


def moe_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "norm": 1 + _rand(g, D, scale=0.1),
        "router": _rand(g, E, D, scale=D**-0.5),
        "experts": {"w_in": _rand(g, E, H, D, scale=D**-0.5), "w_out": _rand(g, E, D, H, scale=H**-0.5)},
        "out": _rand(g, D, D, scale=D**-0.5),
    }


def moe_specs():
    return {
        "norm": {"dp": spec.Replicate()},
        "router": None,  # Rows(1) on dp, replicated on ep (a data axis: its gradient is all-reduced)
        "experts": {"w_in": {"dp": spec.Blocks(4, 8), "ep": spec.Shard(0)}, "w_out": {"ep": spec.Shard(0)}},
        "out": {"dp": spec.Blocks(4, 4)},
    }


def _experts(w_in, w_out, rows, local_ids):
    hidden = F.gelu(torch.einsum("nhd,nd->nh", w_in[local_ids], rows))
    return torch.einsum("ndh,nh->nd", w_out[local_ids], hidden)


def moe_forward(params, x, ep=None):
    """Top-2 MoE; ``ep``: the EP group's Collectives (None: all experts local)."""
    u = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * params["norm"]
    probs = torch.softmax(u @ params["router"].T, dim=-1)
    vals, idx = probs.topk(TOPK, dim=-1)
    gates = vals / vals.sum(-1, keepdim=True)
    tok = torch.arange(x.shape[0]).repeat_interleave(TOPK)
    expert = idx.reshape(-1)
    order = torch.argsort(expert, stable=True)  # group (token, slot) pairs by expert -> by EP rank
    tok, expert, gate = tok[order], expert[order], gates.reshape(-1)[order]
    w_in, w_out = params["experts"]["w_in"], params["experts"]["w_out"]
    rows = u[tok]
    if ep is None:
        y = _experts(w_in, w_out, rows, expert)
    else:
        e_local = w_in.shape[0]
        dest = torch.div(expert, e_local, rounding_mode="floor")
        send = torch.bincount(dest, minlength=ep.world_size)
        recv = torch.empty_like(send)
        ep.all_to_all(recv, send, [1] * ep.world_size, [1] * ep.world_size)
        send_rows, recv_rows = send.tolist(), recv.tolist()
        ids = torch.empty(sum(recv_rows), dtype=torch.int64)
        ep.all_to_all(ids, expert - dest * e_local, recv_rows, send_rows)
        got = parallel.all_to_all(rows, ep, recv_rows, send_rows)  # dispatch
        y = parallel.all_to_all(_experts(w_in, w_out, got, ids), ep, send_rows, recv_rows)  # combine
    mixed = torch.zeros_like(x).index_add(0, tok, gate[:, None] * y)
    return (x + mixed) @ params["out"]


def moe_batch(step, index):
    g = torch.Generator().manual_seed(5000 + 31 * step + index)
    return _rand(g, TOKENS, D), _rand(g, TOKENS, D)


def moe_loss_sum(params, batch, ep=None):
    x, y = batch
    return (moe_forward(params, x, ep) - y).pow(2).sum()


def init_params(kind):
    return {"tp": tp_params, "ep": moe_params, "dt": dt_params}[kind]()


def init_specs(kind):
    return {"tp": tp_specs, "ep": moe_specs, "dt": dt_specs}[kind]()


def mesh_names(kind):
    return ("dp", "ep") if kind == "ep" else ("dp", "tp")


def batches_per_step(kind, mesh):
    """Distinct batches per step: one per rank of the data axes (every axis but "tp": TP ranks
    share a batch; EP ranks route their own tokens; an HSDP "rep" axis splits the batch too)."""
    return mesh.size // (mesh.axis_size("tp") if "tp" in mesh.names else 1)


def _data_index(mc):
    """This rank's batch index: its row-major index over the data axes (all but "tp")."""
    index = 0
    for name, size in zip(mc.mesh.names, mc.mesh.shape):
        if name != "tp":
            index = index * size + mc.coords[name]
    return index


# ---- training loops ----------------------------------------------------------------------------
def mesh_train(kind, mc, mplan, steps, *, shards=None, opt_state=None, start=0):
    """FSDP x TP (kind="tp", "dt": DTensor) or FSDP x EP (kind="ep") training on one rank of a
    mesh; axes other than "dp" and "tp" are data axes (EP, or HSDP replication).

    Returns ``(shards, opt_state, losses)``; losses are the global batch losses.
    """
    opt = rg.optim.adamw(LR, weight_decay=WD)
    if shards is None:
        full = init_params(kind)
        shards = rg.shard(mplan, full, mc)
        opt_state = opt.init(shards)
    data_axes = tuple(a for a in mc.mesh.names if a not in ("dp", "tp"))  # "ep", or an HSDP "rep" axis
    batch = _data_index(mc)
    losses = []
    for step in range(start, start + steps):
        local = rg.gather(mplan, shards, mc)
        local = rg.pytree.map(lambda t: t.detach().requires_grad_(), local)
        if kind == "tp":
            loss = tp_loss(local, tp_batch(step, batch), mc["tp"])  # mean over the local batch
            op = "mean"
        elif kind == "dt":
            tp_mesh = mc.device_mesh["tp"]
            loss = dt_loss(parallel.to_dtensor(mplan, local, mc.device_mesh), tp_batch(step, batch), tp_mesh)
            op = "mean"
        else:
            n_global = mc.mesh.size * TOKENS * D
            loss = moe_loss_sum(local, moe_batch(step, batch), mc["ep"]) / n_global  # a share of the global mean
            op = "sum"
        loss.backward()
        grads = rg.pytree.map(lambda t: t.grad, local)
        g = rg.reduce_scatter(mplan, grads, mc, op=op, data_axes=data_axes)
        updates, opt_state = opt.update(g, opt_state, shards)
        shards = rg.optim.apply_updates(shards, updates)
        total = loss.detach().reshape(1).clone()
        n = 1
        for a in ("dp", *data_axes):
            mc[a].all_reduce(total)
            n *= mc[a].world_size
        losses.append(float(total) / (n if op == "mean" else 1))
    return shards, opt_state, losses


# ---- a plain TP MLP written with DTensor (to_dtensor interop) -------------------------------------
def dt_params(seed=3):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": _rand(g, FF, D, scale=D**-0.5),
        "b1": _rand(g, FF, scale=0.1),
        "w2": _rand(g, D, FF, scale=FF**-0.5),
        "b2": _rand(g, D, scale=0.1),
    }


def dt_specs():
    return {"w1": {"tp": spec.Shard(0)}, "b1": {"tp": spec.Shard(0)}, "w2": {"tp": spec.Shard(1)}, "b2": None}


def dt_loss(params, batch, tp_mesh=None):
    """Column- then row-parallel MLP. With ``tp_mesh`` the params are DTensors and the TP
    all-reduce is DTensor's (Partial -> Replicate)."""
    x, y = batch
    if tp_mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate

        x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
    h = F.gelu(F.linear(x, params["w1"], params["b1"]))
    o = F.linear(h, params["w2"])
    if tp_mesh is not None:
        from torch.distributed.tensor import Replicate

        o = o.redistribute(tp_mesh, [Replicate()]).to_local()
        return (o + params["b2"].to_local() - y).pow(2).mean()
    return (o + params["b2"] - y).pow(2).mean()


def reference_train(kind, steps, *, n_batches, params=None, opt=None, start=0, clip=None, weights=None):
    """Single-process float64 training on the global batch with torch.optim.AdamW (with
    ``clip``: torch.optim.SGD after ``clip_grad_norm_(clip)``; ``weights``: what the forward reads
    instead of the parameters, e.g. their straight-through quantization)."""
    if params is None:
        params = init_params(kind)
        params = rg.pytree.map(lambda t: t.clone().requires_grad_(), params)
        if clip is None:
            opt = torch.optim.AdamW(rg.pytree.leaves(params), lr=LR, weight_decay=WD)
        else:
            opt = torch.optim.SGD(rg.pytree.leaves(params), lr=LR)
    losses = []
    trained = params
    for step in range(start, start + steps):
        opt.zero_grad()
        params = trained if weights is None else weights(trained)
        if kind in ("tp", "dt"):
            batches = [tp_batch(step, i) for i in range(n_batches)]
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            loss = (tp_loss if kind == "tp" else dt_loss)(params, (x, y))
        else:
            batches = [moe_batch(step, i) for i in range(n_batches)]
            # one batch at a time: the same routing per token as in the sharded run
            loss = sum(moe_loss_sum(params, b) for b in batches) / (n_batches * TOKENS * D)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(rg.pytree.leaves(trained), clip)
        opt.step()
        losses.append(loss.item())
    return trained, opt, losses


def ep_fsdp_step(mc, *, data_axes=("ep",), clip=None, policy=None):
    """FSDP x EP through ``rg.fsdp.make_step``: units of the EP-local params over ``mc["dp"]``,
    the all-to-all dispatch inside the loss, ``parallel.data_groups`` for the router's
    EP all-reduce; with ``clip``: SGD after ``clip_by_global_norm`` with the mesh-wide norm
    (``rg.global_norm(units, ...)`` over the data axes). Returns ``(units, state, step, mesh plan)``."""
    from ragged import fsdp

    mplan = spec.make_mesh_plan(moe_params(), moe_specs(), mesh=mc.mesh)  # norm: Replicate() on "dp"
    units = fsdp.make_units(mplan.part_meta(), world_size=mc["dp"].world_size,
                            groups=lambda p: "experts" if "experts" in p else "rest",
                            specs=lambda path, t: mplan.leaf(path).granularity)
    axes = parallel.data_groups(mplan, mc, data_axes)
    if clip is None:
        opt = rg.optim.adamw(LR, weight_decay=WD)
    else:
        norm = lambda g: rg.global_norm(units, g, mc["dp"], data_groups=axes)  # noqa: E731
        opt = rg.optim.chain(rg.optim.clip_by_global_norm(clip, comm=mc["dp"], norm=norm), rg.optim.sgd(LR))
    state = fsdp.init(units, parallel.parts(mplan, moe_params(), mc.coords), opt, mc["dp"])

    def loss_fn(params, batch):
        return moe_loss_sum(params, batch, mc["ep"]) / (TOKENS * D)  # this rank's mean

    return units, state, fsdp.make_step(units, loss_fn, opt, mc["dp"], data_groups=axes, policy=policy), mplan


def ep_fsdp_step_train(mc, steps, *, data_axes=("ep",), clip=None, policy=None):
    """Trains :func:`ep_fsdp_step` for ``steps``. Returns ``(EP-local params, losses, coords, mesh plan)``."""
    units, state, step, mplan = ep_fsdp_step(mc, data_axes=data_axes, clip=clip, policy=policy)
    losses = []
    for s in range(steps):
        state, metrics = step(state, moe_batch(s, _data_index(mc)))
        losses.append(metrics["loss"])
    return rg.gather(units, state.shards, mc["dp"]), losses, dict(mc.coords), mplan
