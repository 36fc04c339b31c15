"""`redistribute`: a DBuffer under one plan -> the same leaves under another plan, and
`owned_plan`, the plan where every leaf lies whole on one rank (distributed Muon / Shampoo).

[Note: redistribute is one uneven all_to_all]
For the old plan P and new plan Q over the same leaves, rank i must send rank j the elements
of every leaf that i holds under P and j holds under Q (a range intersection per leaf). Both
sides enumerate these ranges in the same order (Q's buffer order), so one index tensor per
side, computed once per (P, Q, rank) and cached, turns the exchange into: one ``index_select``
(send side), one uneven ``all_to_all``, one ``index_copy_`` (receive side; the rest, i.e.
padding, stays zero). World sizes may differ as long as both fit in the comm's shard group:
ranks beyond a plan's world size hold an empty shard under it.
"""

from __future__ import annotations

import functools

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import LayoutError, RaggedKeyError, RaggedTypeError, RaggedValueError, check_int
from ragged.spec._plan import LayoutPlan
from ragged.transforms._check import check_plan_type, check_plans, poisons
from ragged.spec._concat import replicated_size

__all__ = ["redistribute", "owned_plan"]


def _ranges(plan: LayoutPlan, rank: int):
    """{leaf path: (start, stop, local offset)} of what ``rank`` holds under ``plan``."""
    if rank >= plan.world_size:
        return {}
    return {p.leaf.path: (p.start, p.stop, p.local_offset) for p in plan.local_pieces(rank)}


@functools.lru_cache(maxsize=128)
def _exchange(old: LayoutPlan, new: LayoutPlan, rank: int, world: int):
    """(send index, send splits, recv index, recv splits) for ``rank``."""
    order = [l.path for l in sorted(new.leaves, key=lambda l: l.offset)]
    old_mine, new_mine = _ranges(old, rank), _ranges(new, rank)
    old_all = [_ranges(old, j) for j in range(world)]
    new_all = [_ranges(new, j) for j in range(world)]

    def spans(src, dst):
        out = []  # (offset in src's shard, offset in dst's shard, length)
        for path in order:
            a, b = src.get(path), dst.get(path)
            if a is None or b is None:
                continue
            lo, hi = max(a[0], b[0]), min(a[1], b[1])
            if lo < hi:
                out.append((a[2] + lo - a[0], b[2] + lo - b[0], hi - lo))
        return out

    send_idx, send_splits, recv_idx, recv_splits = [], [], [], []
    for j in range(world):
        s = spans(old_mine, new_all[j])
        send_idx += [torch.arange(o, o + n) for o, _, n in s]
        send_splits.append(sum(n for _, _, n in s))
        r = spans(old_all[j], new_mine)
        recv_idx += [torch.arange(o, o + n) for _, o, n in r]
        recv_splits.append(sum(n for _, _, n in r))
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)
    return cat(send_idx), tuple(send_splits), cat(recv_idx), tuple(recv_splits)


def _check_same_leaves(old: LayoutPlan, new: LayoutPlan):
    def table(plan):
        return {l.path: l.shape for l in plan.leaves}, {l.path: l.shape for l in plan.replicated}

    (os_, or_), (ns, nr) = table(old), table(new)
    for kind, a, b in (("sharded", os_, ns), ("replicated", or_, nr)):
        if set(a) != set(b):
            raise LayoutError(
                f"redistribute: the new plan's {kind} leaves differ: only in the old plan "
                f"{sorted(set(a) - set(b))}, only in the new {sorted(set(b) - set(a))}. redistribute moves the "
                "same leaves to another layout; plan both from the same params (and the same Replicate specs)."
            )
        for path in a:
            if a[path] != b[path]:
                raise LayoutError(
                    f"redistribute: leaf {path} has shape {a[path]} in the old plan but {b[path]} in the new one.",
                    path=path,
                    shape=a[path],
                )
    if old.treedef != new.treedef:
        raise LayoutError("redistribute: the two plans have different tree structures; plan both from the same params.")


@poisons("comm")
def redistribute(dbuf: DBuffer, new_plan: LayoutPlan, comm) -> DBuffer:
    """The same leaves under ``new_plan`` (other granularity, world size, or owners).

    See [Note: redistribute is one uneven all_to_all]. Cast to ``new_plan.dtype`` if it differs.

    Args:
        dbuf: this rank's shard under ``dbuf.plan``.
        new_plan: a plan over the same leaves (same paths and shapes) whose world size fits
            the comm's shard group.
        comm: the shard group's collectives.

    Returns:
        This rank's :class:`~ragged.DBuffer` under ``new_plan`` (empty if
        ``comm.rank >= new_plan.world_size``).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"a": torch.randn(3, 4), "b": torch.randn(5, 4)}
        >>> even = rg.make_plan(params, world_size=2)
        >>> owned = rg.owned_plan(even)          # each leaf whole on one rank
        >>> def fn(comm):
        ...     d = rg.redistribute(rg.shard(even, params, comm), owned, comm)
        ...     return sorted(k for k, v in d.views().items() if v.numel())
        >>> rg.collectives.simulate(2, fn)
        [['b'], ['a']]
    """
    check_plan_type(new_plan, "redistribute")
    if not isinstance(dbuf, DBuffer):
        raise RaggedTypeError(f"redistribute takes a DBuffer, got {type(dbuf).__name__}.")
    old = dbuf.plan
    world = comm.world_size
    if max(old.world_size, new_plan.world_size) > world:
        raise RaggedValueError(
            f"redistribute: plans over {old.world_size} and {new_plan.world_size} ranks need a shard group of at "
            f"least that many; the comm has {world}."
        )
    if dbuf.rank != comm.rank:
        raise RaggedValueError(f"redistribute: the DBuffer belongs to rank {dbuf.rank} but comm.rank is {comm.rank}.")
    _check_same_leaves(old, new_plan)
    check_plans((old, new_plan), comm, "redistribute")
    rank = comm.rank
    if old == new_plan:
        return dbuf
    send_idx, send_splits, recv_idx, recv_splits = _exchange(old, new_plan, rank, world)
    device = dbuf.data.device
    send = dbuf.data.detach().index_select(0, send_idx.to(device))
    if send.dtype != new_plan.dtype:
        send = send.to(new_plan.dtype)
    recv = torch.empty(sum(recv_splits), dtype=new_plan.dtype, device=device)
    comm.all_to_all(recv, send, list(recv_splits), list(send_splits))
    S = new_plan.shard_size if rank < new_plan.world_size else 0
    data = torch.zeros(S, dtype=new_plan.dtype, device=device)
    data.index_copy_(0, recv_idx.to(device), recv)
    rep_old = {l.path: l for l in old.replicated}
    if all(rep_old[l.path].offset == l.offset for l in new_plan.replicated):
        rep = dbuf.replicated.detach().to(new_plan.dtype)[: replicated_size(new_plan)]
    else:
        rep = torch.zeros(replicated_size(new_plan), dtype=new_plan.dtype, device=device)
        for l in new_plan.replicated:
            o = rep_old[l.path]
            rep[l.offset : l.stop].copy_(dbuf.replicated[o.offset : o.stop])
    return DBuffer(data=data, replicated=rep, plan=new_plan, rank=rank)


def owned_plan(plan: LayoutPlan, owners=None, *, world_size: int | None = None) -> LayoutPlan:
    """A plan over ``plan``'s leaves in which every sharded leaf lies whole on one rank.

    The "owned" RaggedShard (one non-zero unit per leaf) that distributed Muon / Shampoo
    need: ``redistribute`` to it, run the whole-matrix update on the owner, redistribute back.

    Args:
        plan: the plan whose leaves to lay out.
        owners: ``{key path: rank}`` for leaves with a fixed owner; the rest are assigned
            greedily, largest first, to the least loaded rank. Default: all greedy.
        world_size: ranks of the new plan (default ``plan.world_size``).

    Returns:
        A :class:`~ragged.spec.LayoutPlan` with ``strategy="owned"`` and each leaf's granule
        equal to its size.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"a": torch.empty(8, 8), "b": torch.empty(4, 8), "c": torch.empty(4, 8)}, world_size=2)
        >>> op = rg.owned_plan(plan)
        >>> op.shard_size, [(l.path, op.owners(l)) for l in op.leaves]
        (64, [("['a']", (0,)), ("['b']", (1,)), ("['c']", (1,))])
    """
    check_plan_type(plan, "owned_plan")
    m = plan.world_size if world_size is None else world_size
    owners = dict(owners or {})
    paths = {l.path for l in plan.leaves}
    for path, r in owners.items():
        if path not in paths:
            raise RaggedKeyError(f"owned_plan: owners names {path!r}, which is not a sharded leaf; leaves are {sorted(paths)}.")
        check_int(f"owned_plan: the owner of {path} (a rank)", r, 0, m)
    align = plan.align
    up = lambda n: -(-n // align) * align
    load = [0] * m
    assigned: dict[int, list] = {r: [] for r in range(m)}
    for leaf in plan.leaves:
        if leaf.path in owners:
            assigned[owners[leaf.path]].append(leaf)
            load[owners[leaf.path]] += up(leaf.numel)
    for leaf in sorted((l for l in plan.leaves if l.path not in owners), key=lambda l: (-l.numel, l.offset)):
        r = min(range(m), key=lambda k: (load[k], k))
        assigned[r].append(leaf)
        load[r] += up(leaf.numel)
    S = max(max(load), align)
    leaves = []
    for r in range(m):
        pos = r * S
        for leaf in sorted(assigned[r], key=lambda l: l.offset):
            leaves.append(leaf.replace(offset=pos, granule=max(leaf.numel, 1)))
            pos += up(leaf.numel)
    return plan.replace(leaves=tuple(leaves), world_size=m, shard_size=S, strategy="owned", split_blocks=0, buffers=())
