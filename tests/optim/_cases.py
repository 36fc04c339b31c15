"""Local helpers: build each rank's DBuffer from full tensors and reassemble, without comm.

These do by hand (in float64, no communication) what ``rg.shard`` / ``rg.gather`` do, so the
optimizer tests here do not depend on the engine; the engine-backed tests use the real ones.
"""

from __future__ import annotations

import torch

import ragged as rg
from ragged._dbuffer import DBuffer, unflatten


def flat_buffer(plan, params):
    leaves = rg.pytree.leaves(params)
    buf = torch.zeros(plan.buffer_numel, dtype=plan.dtype)
    for leaf in plan.leaves:
        buf[leaf.offset : leaf.stop] = leaves[leaf.index].reshape(-1).to(plan.dtype)
    from ragged.spec._concat import replicated_size

    rep = torch.zeros(replicated_size(plan), dtype=plan.dtype)  # offsets are aligned
    for leaf in plan.replicated:
        rep[leaf.offset : leaf.stop] = leaves[leaf.index].reshape(-1).to(plan.dtype)
    return buf, rep


def shard_all(plan, params):
    """Every rank's DBuffer of ``params`` (a list of ``plan.world_size``)."""
    buf, rep = flat_buffer(plan, params)
    S = plan.shard_size
    return [
        DBuffer(data=buf[r * S : (r + 1) * S].clone(), replicated=rep.clone(), plan=plan, rank=r)
        for r in range(plan.world_size)
    ]


def gather_all(shards):
    """The full pytree from every rank's DBuffer (replicated leaves from rank 0)."""
    plan = shards[0].plan
    buf = torch.cat([s.data for s in shards])
    return unflatten(plan, buf, shards[0].replicated)


def padding_mask(plan, rank):
    mask = torch.ones(plan.shard_size, dtype=torch.bool)
    for p in plan.local_pieces(rank):
        mask[p.local_offset : p.local_offset + p.numel] = False
    return mask


def concat_over_ranks(per_rank: list[dict]) -> dict:
    """``{path: {name: tensor}}`` per rank -> each leaf's state concatenated in rank order."""
    state: dict = {}
    for parts_by_path in per_rank:
        for path, parts in parts_by_path.items():
            slot = state.setdefault(path, {})
            for k, v in parts.items():
                slot[k] = torch.cat([slot[k], v]) if k in slot else v
    return state
