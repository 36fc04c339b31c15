"""Helpers shared by the checkpoint tests (simulated and gloo)."""

from __future__ import annotations

from typing import NamedTuple

import torch

import ragged as rg
from ragged import spec
from ragged._pytree import flatten_with_keystr


class AdamLike(NamedTuple):
    """An optimizer-state-shaped container: a count tensor and two DBuffers."""

    count: torch.Tensor
    mu: object
    nu: object


def make_params(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {
        "emb": r(10, 6),
        "layers": [{"w": r(7, 5), "b": r(5)}, {"w": r(3, 8), "b": r(8)}],
        "gain": r(()),
        "head": r(6, 4),
    }


SPECS = {
    "rows": None,
    "elements": spec.Elements(1),
    "blocks": {"emb": spec.Blocks(2, 3), "layers": spec.Rows(1), "gain": spec.Rows(1), "head": spec.Blocks(2, 2)},
    "mixed": {"emb": spec.Rows(2), "layers": spec.Elements(1), "gain": spec.Replicate(), "head": spec.Replicate()},
}


def plan_for(params, world_size: int, granularity: str = "rows", strategy: str = "dp"):
    return rg.make_plan(params, SPECS[granularity], world_size=world_size, strategy=strategy)


def full_leaves(dbufs) -> dict[str, torch.Tensor]:
    """Rebuilds every leaf (path -> full tensor) from all ranks' DBuffers of one plan, without
    any collective (pieces are read by their plan offsets)."""
    plan = dbufs[0].plan
    out = {}
    for leaf in plan.leaves:
        out[leaf.path] = torch.full((leaf.numel,), float("nan"), dtype=dbufs[0].data.dtype)
    for d in dbufs:
        for piece in plan.local_pieces(d.rank):
            out[piece.leaf.path][piece.start : piece.stop] = d.data[piece.local_offset : piece.local_offset + piece.numel]
    for leaf in plan.leaves:
        out[leaf.path] = out[leaf.path].view(leaf.shape)
    for leaf in plan.replicated:
        values = [d.replicated[leaf.offset : leaf.stop].view(leaf.shape) for d in dbufs]
        for v in values[1:]:
            torch.testing.assert_close(v, values[0], rtol=0, atol=0)
        out[leaf.path] = values[0].clone()
    return out


def tree_leaves_by_path(tree) -> dict[str, torch.Tensor]:
    p, l, _ = flatten_with_keystr(tree)
    return dict(zip(p, l))


def padding_is_zero(d) -> bool:
    mask = torch.ones(d.plan.shard_size, dtype=torch.bool)
    for piece in d.plan.local_pieces(d.rank):
        mask[piece.local_offset : piece.local_offset + piece.numel] = False
    return bool((d.data[mask] == 0).all())


def make_state(rank: int, plan, full: dict, *, step: int = 5):
    """A training-state-shaped tree for ``rank`` from full trees ``full[name]``."""
    return {
        "params": rg.shard(plan, full["params"], rank=rank),
        "opt": (AdamLike(count=torch.tensor(step, dtype=torch.int64), mu=rg.shard(plan, full["mu"], rank=rank),
                         nu=rg.shard(plan, full["nu"], rank=rank)),),
        "step": step,
        "rng": torch.Generator().manual_seed(1234).get_state(),
        "lr": 0.25,
        "name": "run-1",
        "nothing": None,
    }


def full_trees(seed: int = 0):
    params = make_params(seed)
    mu = make_params(seed + 1)
    nu = {k: v for k, v in make_params(seed + 2).items()}
    nu = rg.pytree.map(lambda t: t * t, nu)  # second moments are non-negative
    return {"params": params, "mu": mu, "nu": nu}
