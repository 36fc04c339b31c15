"""SOAP and Shampoo, measured (the ``precond`` sections of ``bench/optim.py``).

precond-step     One optimizer step on one process (1 thread) over the fp32 parameters of the ``step``
                 section, matrices planned ``Blocks(b, b)``: ``rg.optim.adamw`` and torch's foreach
                 AdamW beside ``rg.optim.soap`` and ``rg.optim.shampoo``, each on steps that refresh
                 (SOAP's power iteration + QR, Shampoo's inverse roots) and steps that do not. Every
                 step of every method interleaved; paired ratios against ``rg.optim.adamw`` of the
                 same round.
precond-balance  The refresh step's work per rank for the dense and MoE models of ``bench/step.py``
                 (one unit per block + the rest, ``Blocks(b, b)`` on the matrices) at W = 2 and 4:
                 analytic (the flops of every block a rank computes, the zero slots of batches that a
                 rank boundary cuts included; see [Note: fixed slots, the same numbers at every world
                 size]) and timed (each rank's ``opt.update`` over all its units, in this process, one
                 rank after the other, interleaved; the update communicates nothing, so a rank's time
                 is its own). max / mean over ranks.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.table import Table

import ragged as rg
from ragged import spec
from ragged._dbuffer import DBuffer
from ragged.optim._blocks import BlockRule, batches, block_layout

__all__ = ["section_step", "section_balance", "refresh_flops"]


def block_specs(b: int):
    """``Blocks(b, b)`` for the matrices; a stack of matrices (3-D experts) whose rows ``b`` does not
    divide gets ``Blocks(r, b)`` with ``r`` halved until it does (its bands must line up), so no matrix
    falls back to the element-wise method: a fallback leaf costs nothing on a refresh, and mixing it
    with blocks would unbalance the ranks' refresh work (the plan balances elements)."""
    def one(name, t):
        if t.dim() < 2:
            return None
        r = b
        while t.dim() > 2 and t.shape[-2] % r:
            r //= 2
        return spec.Blocks(r, b)

    return one


def _block_flops(name: str, r: int, c: int, refresh: bool) -> float:
    """A flop model of one block's step (matmuls 2mnk; QR 8/3 n^3 with Q formed; eigh with vectors ~9 n^3)."""
    mix = 2 * (r * r * c + r * c * c)  # one product on each side: r x r @ r x c and r x c @ c x c
    if name == "soap":
        flops = 3 * mix  # project G, project back, the statistics
        if refresh:
            flops += sum(2 * n**3 + 8 / 3 * n**3 for n in (r, c)) + 2 * mix  # S Q, QR; m rotated
        return flops
    flops = 2 * mix  # the statistics, X_L G X_R
    if refresh:
        flops += sum(9 * n**3 + 2 * n**3 for n in (r, c))  # eigh, Q diag Q^T
    return flops


def refresh_flops(name: str, plans, rule: BlockRule, refresh: bool = True) -> list[float]:
    """Per rank: the flop model of every block it computes on a (refresh) step over ``plans``
    (zero slots of cut batches included: they are computed)."""
    m = plans[0].world_size
    out = [0.0] * m
    for plan in plans:
        for rank in range(m):
            for p in block_layout(rule, plan, rank).parts:
                slots = sum(n for n, *_ in batches(p))
                out[rank] += slots * _block_flops(name, p.rows, p.cols, refresh)
    return out


def _refreshing(name: str):
    """SOAP or Shampoo refreshing on every step (after the first)."""
    if name == "soap":
        return rg.optim.soap(1e-3, precondition_frequency=1)
    return rg.optim.shampoo(1e-3, precondition_frequency=1, start_preconditioning_step=1)


def _params(hidden: int, g: torch.Generator) -> dict:
    h, f = hidden, int(hidden * 8 / 3) // 64 * 64
    params = {}
    for i in range(4):
        for name, shape in (("qkv", (3 * h, h)), ("proj", (h, h)), ("w1", (f, h)), ("w3", (f, h)), ("w2", (h, f)),
                            ("n1", (h,)), ("n2", (h,))):
            params[f"l{i}.{name}"] = torch.randn(*shape, generator=g)
    return params


def section_step(console, iters: int, hidden: int, block: int) -> dict:
    """``precond-step`` (see the module docstring)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    params = _params(hidden, g)
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    plan = rg.make_plan(params, {k: block_specs(block)(k, v) for k, v in params.items()}, world_size=1)
    local, gsh = rg.shard(plan, params, rank=0), rg.shard(plan, grads, rank=0)

    def stepper(opt, after=None, count=None):
        """Steps of ``opt`` from the state one step of ``after`` (default ``opt``) leaves, its step
        count set to ``count`` if given."""
        first = after or opt
        state = first.init(local)
        _, state = first.update(gsh, state, local)  # SOAP: eigh; Shampoo (start = 1): the first roots
        if count is not None:
            state = state._replace(count=torch.tensor(count))
        box = {"p": local, "s": state}

        def step():
            u, box["s"] = opt.update(gsh, box["s"], box["p"])
            box["p"] = rg.apply_updates(box["p"], u)

        return step

    torch_ps = [p.clone().requires_grad_(True) for p in params.values()]
    for p, gr in zip(torch_ps, grads.values()):
        p.grad = gr.clone()
    torch_opt = torch.optim.AdamW(torch_ps, lr=1e-3, foreach=True)
    never = 10**9
    methods = {
        "rg.optim.adamw": stepper(rg.optim.adamw(1e-3)), "torch AdamW foreach": torch_opt.step,
        "soap, refresh step": stepper(rg.optim.soap(1e-3, precondition_frequency=1)),
        "soap, other step": stepper(rg.optim.soap(1e-3, precondition_frequency=never)),
        "shampoo, refresh step": stepper(rg.optim.shampoo(1e-3, precondition_frequency=1, start_preconditioning_step=1)),
        # the roots of one step, then steps that precondition with them (count past start, before the next root)
        "shampoo, other step": stepper(rg.optim.shampoo(1e-3, precondition_frequency=never), count=never,
                                       after=rg.optim.shampoo(1e-3, precondition_frequency=1, start_preconditioning_step=1)),
    }
    from bench._measure import interleaved, paired

    times = interleaved(methods, iters, warmup=2)
    base = times["rg.optim.adamw"]
    rows = [{"method": k, "ms": statistics.median(v) * 1e3, "vs_adamw": paired(v, base), "seconds": v}
            for k, v in times.items()]
    table = Table(title=f"one optimizer step, {plan.numel / 1e6:.1f}M fp32 params ({len(params)} leaves; matrices "
                        f"Blocks({block}, {block})), 1 thread, median of {iters} interleaved; paired vs rg.optim.adamw")
    for col in ("method", "ms", "vs rg.optim.adamw (paired)"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        table.add_row(r["method"], f"{r['ms']:.1f}", f"{r['vs_adamw']:.2f}x")
    console.print(table)
    return {"section": "precond-step", "numel": plan.numel, "leaves": len(params), "block": block, "hidden": hidden,
            "iters": iters, "rows": rows}


def _units(model: str, world_size: int, block: int):
    from bench.step import CONFIGS, meta_model
    from ragged import fsdp

    return fsdp.make_units(meta_model(CONFIGS[model]), world_size=world_size, specs=block_specs(block))


def section_balance(console, models, world_sizes, block: int, iters: int) -> dict:
    """``precond-balance`` (see the module docstring)."""
    torch.set_num_threads(1)
    rows = []
    table = Table(title=f"refresh step per rank, matrices Blocks({block}, {block}), 1 thread: analytic flops (zero slots "
                        f"included) and measured opt.update time (median of {iters}); max / mean over ranks")
    for col in ("model", "optimizer", "W", "blocks/rank", "GFLOP/rank", "flops max/mean", "ms/rank", "time max/mean"):
        table.add_column(col, justify="left" if col in ("model", "optimizer") else "right")
    for model in models:
        for m in world_sizes:
            units = _units(model, m, block)
            plans = [u.plan for u in units]
            for name in ("soap", "shampoo"):
                rule = BlockRule(name, None, 10000 if name == "soap" else 8192)  # the optimizers' defaults
                flops = refresh_flops(name, plans, rule)
                blocks = [sum(p.local for plan in plans for p in block_layout(rule, plan, r).parts) for r in range(m)]
                secs = _time_ranks(units, name, m, iters)
                med = [statistics.median(s) for s in secs]
                row = {"model": model, "optimizer": name, "world_size": m, "blocks": blocks, "flops": flops,
                       "seconds": secs, "flops_ratio": max(flops) / statistics.mean(flops),
                       "time_ratio": max(med) / statistics.mean(med)}
                rows.append(row)
                table.add_row(model, name, str(m), "/".join(map(str, blocks)), "/".join(f"{f / 1e9:.1f}" for f in flops),
                              f"{row['flops_ratio']:.3f}", "/".join(f"{t * 1e3:.0f}" for t in med), f"{row['time_ratio']:.3f}")
    console.print(table)
    return {"section": "precond-balance", "block": block, "iters": iters, "rows": rows}


def _time_ranks(units, name: str, m: int, iters: int) -> list[list[float]]:
    """Each rank's refresh-step time: its opt.update over every unit, ranks interleaved."""
    g = torch.Generator().manual_seed(0)
    ranks = []
    for r in range(m):
        shards = {u.name: DBuffer(data=torch.randn(u.plan.shard_size, generator=g), replicated=torch.randn(
            u.plan.replicated_numel, generator=g), plan=u.plan, rank=r) for u in units}
        opt = _refreshing(name)
        state = opt.init(shards)
        _, state = opt.update(shards, state, shards)  # SOAP's first step (eigh), Shampoo's first roots
        ranks.append([opt, state, shards])
    out = [[] for _ in range(m)]
    for it in range(iters + 1):
        for r in (range(m) if it % 2 == 0 else reversed(range(m))):
            opt, state, shards = ranks[r]
            t0 = time.perf_counter()
            _, ranks[r][1] = opt.update(shards, state, shards)
            if it:  # the first round warms up
                out[r].append(time.perf_counter() - t0)
    return out
