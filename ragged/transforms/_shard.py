"""`shard`: full parameters (equal on every rank) -> this rank's DBuffer."""

from __future__ import annotations

import torch

from ragged._dbuffer import DBuffer
from ragged.spec._concat import replicated_size
from ragged.spec._plan import LayoutPlan
from ragged.transforms._check import check_comm, check_plan, check_plan_type, flatten_like_plan, poisons
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["shard"]


@poisons("comm")
def shard(plan: LayoutPlan, params, comm=None, *, rank: int | None = None) -> DBuffer:
    """This rank's :class:`~ragged.DBuffer` of ``params`` under ``plan``.

    ``params`` holds the full tensors, equal on every rank (e.g. after seeded init). Each rank
    copies out its own pieces into a fresh zero-padded buffer of ``plan.shard_size`` elements
    in ``plan.dtype`` (casting, e.g. to an fp32 master copy); replicated leaves are copied
    whole into ``dbuf.replicated``. With ``comm`` the ranks first agree on the plan (see
    [Note: plan check before collectives]).

    Args:
        plan: the layout.
        params: a pytree shaped like the plan's params (real tensors, not meta).
        comm: a :class:`~ragged.collectives.Collectives`; or ``None`` with ``rank=``.
        rank: this rank's index (only without ``comm``).

    Returns:
        A :class:`~ragged.DBuffer` whose ``views()`` are zero-copy views of ``data``.

    Raises:
        TypeError, LayoutError: params do not match the plan (the message names the key path).
        PlanMismatchError: ranks hold different plans.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.arange(12.0).reshape(6, 2), "b": torch.ones(2)}
        >>> plan = rg.make_plan(params, world_size=2, align=1)
        >>> d = rg.shard(plan, params, rank=1)
        >>> d.data.shape, d.views()["w"].shape
        (torch.Size([8]), torch.Size([3, 2]))
    """
    check_plan_type(plan, "shard")
    if comm is not None:
        if rank is not None and rank != comm.rank:
            raise RaggedValueError(f"shard: rank={rank} disagrees with comm.rank={comm.rank}; pass one of them.")
        rank = comm.rank
        check_comm(plan, comm, "shard")
    elif rank is None:
        raise RaggedTypeError("shard needs a comm (rg.collectives.from_torch() / simulate) or rank=.")
    leaves = flatten_like_plan(plan, params, "params")
    if comm is not None:
        check_plan(plan, comm, "shard")
    device = leaves[0].device if leaves else None
    S = plan.shard_size if rank < plan.world_size else 0
    data = torch.zeros(S, dtype=plan.dtype, device=device)
    replicated = torch.zeros(replicated_size(plan), dtype=plan.dtype, device=device)
    with torch.no_grad():
        if rank < plan.world_size:
            for piece in plan.local_pieces(rank):
                src = leaves[piece.leaf.index].detach().reshape(-1)[piece.start : piece.stop]
                data[piece.local_offset : piece.local_offset + piece.numel].copy_(src)
        for layout in plan.replicated:
            replicated[layout.offset : layout.stop].copy_(leaves[layout.index].detach().reshape(-1))
    return DBuffer(data=data, replicated=replicated, plan=plan, rank=rank)
