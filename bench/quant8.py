"""8-bit AdamW: FSDP2 with torchao-style per-local-shard blocks vs ragged with aligned 32x32 blocks.

Does the optimizer state depend on how many ranks the model is sharded over? The same
parameters and the same gradient sequence are fed to

* ``per-shard``: ``bench/_fsdp2.PerShardAdamW8bit`` (blocks of 1024 consecutive elements of
  each rank's FSDP2 ``Shard(0)`` piece, as torchao's AdamW8bit does under FSDP2), run on the
  exact pieces FSDP2 gives each rank (``torch.chunk`` along dim 0);
* ``ragged``: ``rg.optim.adamw_8bit`` over ``rg.shard`` with ``spec.Blocks(32, 32)`` on every
  matrix (1024-element tiles that no rank boundary cuts), on the in-process simulated backend;

at world sizes 1, 2, 3, 4, and the results after a few steps are compared with world size 1.
Both use the same quantizer (dynamic maps, one fp32 absmax per block): only where the blocks
fall differs. Gradients are identical at every world size by construction (no reduction
order effects), so any difference is the block layout's doing.

The cost side (a real gloo training step with each 8-bit optimizer, time and memory) is
``python3 bench/step.py --model dense --world 2 --optim adamw8bit``.

Usage::

    python3 bench/quant8.py                  # dense GPT of bench/step.py, W = 1 2 3 4, 3 steps
    python3 bench/quant8.py --model 120m --steps 2
    python3 bench/quant8.py --json out.json  # also write the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

BLOCK = 32


def _params(model: str):
    from bench.step import CONFIGS
    from ragged.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(**CONFIGS[model]))
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def _grads(params, steps: int):
    """Per step: normal gradients with a per-row scale spread (log-normal, sigma 0.5) (so blocks'
    absmax differ, as in real gradients)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        step = {}
        for k, p in params.items():
            x = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                x = x * torch.exp(torch.randn(*p.shape[:-1], 1, generator=g) * 0.5)
            step[k] = x * 1e-2
        out.append(step)
    return out


def per_shard(params, grads, world: int, *, lr: float, block: int):
    from bench._fsdp2 import PerShardAdamW8bit

    pieces = {k: [c.clone() for c in torch.chunk(p, world, dim=0)] for k, p in params.items()}
    ranks = []
    for r in range(world):
        local = {k: v[r] for k, v in pieces.items() if r < len(v)}
        numel = {id(v): params[k].numel() for k, v in local.items()}
        opt = PerShardAdamW8bit(list(local.values()), lr=lr, block_size=block, full_numel=lambda p, _n=numel: _n[id(p)])
        ranks.append((local, opt))
    for step in grads:
        for r, (local, opt) in enumerate(ranks):
            for k, v in local.items():
                v.grad = torch.chunk(step[k], world, dim=0)[r].clone()
            opt.step()
    full = {k: torch.cat([ranks[r][0][k] for r in range(world) if k in ranks[r][0]], dim=0) for k in params}
    state_bytes = max(sum(t.numel() * t.element_size() for t in opt.state_tensors()) for _, opt in ranks)
    blocks = set()  # (param, global start, length) of every quantization block
    for k, p in params.items():
        if p.numel() < 4096:
            continue
        start = 0
        for c in torch.chunk(p, world, dim=0):
            n = c.numel()
            for b in range(0, n, block):
                blocks.add((k, start + b, min(block, n - b)))
            start += n
    return full, state_bytes, blocks


def _specs(params):
    from ragged import spec

    return {k: spec.Blocks(BLOCK, BLOCK) if p.dim() >= 2 else spec.Rows(1) for k, p in params.items()}


def ragged_run(params, grads, world: int, *, lr: float):
    import ragged as rg

    plan = rg.make_plan(params, _specs(params), world_size=world)

    def fn(comm):
        opt = rg.optim.adamw_8bit(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
        p = rg.shard(plan, params, comm)
        st = opt.init(p)
        for step in grads:
            g = rg.shard(plan, step, comm)
            u, st = opt.update(g, st, p)
            p = rg.apply_updates(p, u)
        full = {k: v.clone() for k, v in rg.gather(p, comm).items()}
        moments = st[0].moments
        leaf = rg.optim.adam8bit_leaf_state(moments, p)
        nbytes = sum(t.numel() * t.element_size() for t in rg.pytree.leaves(moments))
        return full, leaf, nbytes

    out = rg.collectives.simulate(world, fn)
    full = out[0][0]
    # whole-leaf state: codes in rank order (element order), scales band-major
    leaf_state = {}
    paths = dict.fromkeys(p for o in out for p in o[1])
    for path in paths:
        parts = [o[1][path] for o in out if path in o[1]]
        leaf_state[path] = {f: torch.cat([part[f] for part in parts]) for f in parts[0]}
    return full, max(o[2] for o in out), leaf_state, plan


def compare(a, b):
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    n = sum(a[k].numel() for k in a)
    changed = sum(int((a[k] != b[k]).sum()) for k in a)
    return diff, changed / n


def main(argv=None) -> int:
    from ragged._console import console as make_console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dense")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = ap.parse_args(argv)
    params = _params(args.model)
    grads = _grads(params, args.steps)
    console = make_console(min_width=140)
    n = sum(p.numel() for p in params.values())
    t = Table(title=f"8-bit AdamW on the {args.model} GPT ({n / 1e6:.1f}M params), {args.steps} steps of identical "
                    f"gradients: results at world size W vs W={args.worlds[0]}", title_justify="left")
    for col in ("W", "optimizer", "blocks", "blocks unlike W=1", "state MiB/rank", "params: max |diff|",
                "params changed", "state codes = W=1"):
        t.add_column(col, justify="right" if col not in ("optimizer",) else "left")
    ref_ps = ref_rg = ref_blocks = ref_state = None
    rows = []
    for w in args.worlds:
        ps_full, ps_bytes, blocks = per_shard(params, grads, w, lr=args.lr, block=BLOCK * BLOCK)
        rg_full, rg_bytes, rg_state, plan = ragged_run(params, grads, w, lr=args.lr)
        if ref_ps is None:
            ref_ps, ref_rg, ref_blocks, ref_state = ps_full, rg_full, blocks, rg_state
        d_ps, c_ps = compare(ps_full, ref_ps)
        d_rg, c_rg = compare(rg_full, ref_rg)
        same = all(torch.equal(rg_state[k][f], ref_state[k][f]) for k in ref_state for f in ref_state[k])
        nblocks_rg = sum(len(v["mu_scales"]) for v in rg_state.values() if "mu_scales" in v)
        t.add_row(str(w), "per-shard (FSDP2 + torchao-style)", f"{len(blocks):,}", f"{len(blocks - ref_blocks):,}",
                  f"{ps_bytes / 2**20:.2f}", f"{d_ps:.2e}", f"{c_ps:.3%}", "-")
        t.add_row("", "ragged Blocks(32, 32)", f"{nblocks_rg:,}", "0", f"{rg_bytes / 2**20:.2f}", f"{d_rg:.2e}",
                  f"{c_rg:.3%}", "yes" if same else "[red]no", end_section=True)
        rows.append(dict(world=w, optimizer="per-shard (FSDP2 + torchao style)", blocks=len(blocks),
                         blocks_unlike=len(blocks - ref_blocks), state_bytes=ps_bytes, max_abs_diff=d_ps, changed=c_ps,
                         codes_equal=None))
        rows.append(dict(world=w, optimizer="ragged Blocks(32, 32)", blocks=nblocks_rg, blocks_unlike=None,
                         state_bytes=rg_bytes, max_abs_diff=d_rg, changed=c_rg, codes_equal=same))
        console.print(f"W={w}: ragged plan padding {plan.padding:,} elements ({plan.overhead:.3%})", style="dim")
    console.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    console.print("[dim]blocks: quantization blocks of the matrices (1024 elements each, shorter where cut); "
                  "'unlike W=1': blocks whose (tensor, start, length) does not occur at W=1. State MiB/rank: codes + "
                  "scales + fp32 moments of small tensors, the largest rank. Params compared element-wise, bitwise.[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
