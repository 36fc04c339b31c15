"""`reduce_scatter` / `reduce_scatter_start` / `reduce_scatter_wait`: per-rank gradients ->
this rank's DBuffer of the reduced gradient shard.

[Note: reduce_scatter copies once or never]
A pytree of gradients is packed ONCE into a flat m*S buffer in the reduce dtype (one
``torch.cat(..., out=)`` over leaves and zero gaps: the copy-in, which also casts); a flat
gradient of ``plan.buffer_numel`` elements (e.g. the gradient of ``gather``'s buffer) is
reduced as is, with no copy. Then one reduce-scatter(sum) within the shard group (one coalesced
launch for all of a plan's buffers: ``reduce_scatter_flat``); for HSDP one
all-reduce(sum) of the S-element result across replicas; ``"mean"`` divides by every
contributing rank (shard group x replicas). Replicated leaves are packed the same way and
all-reduced over every rank. The result is cast to ``plan.dtype`` (an S-element cast).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, leaf_positions, local_gaps, segments
from ragged._divide import divisor
from ragged.collectives._scratch import SCRATCH
from ragged.spec._plan import LayoutPlan
from ragged.transforms._check import check_plan, check_plan_type, flatten_like_plan, poisons
from ragged.transforms._flat import _reduce_scatter_flat_start, _tree_all_reduce_start, _tree_reduce_scatter_flat_start
from ragged.transforms._quantized import format_key, formats_of, reduce_scatter_launch
from ragged.spec._concat import replicated_size
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["reduce_scatter", "reduce_scatter_start", "reduce_scatter_wait", "ReduceScatterPending"]

_OPS = ("mean", "sum")


class ReduceScatterPending(NamedTuple):
    """A reduce-scatter in flight (from :func:`reduce_scatter_start`): pass it to
    :func:`reduce_scatter_wait` once; its fields are the wait's inputs (the output shard, the
    replicated buffer, the handles, and what the wait finishes with).

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(4)}, world_size=2, align=1)
        >>> def fn(comm):
        ...     pending = rg.reduce_scatter_start(plan, {"w": torch.ones(4)}, comm, op="sum")
        ...     return pending.output.shape, pending.op
        >>> rg.collectives.simulate(2, fn)[0]
        (torch.Size([2]), 'sum')
    """

    output: torch.Tensor
    replicated: torch.Tensor
    handles: tuple
    plan: LayoutPlan
    comm: Any
    op: str
    zero_padding: bool
    source: torch.Tensor
    pooled: bool


def _segments(plan: LayoutPlan):
    """(leaf layout or None for a zero gap, length) along the global and the replicated buffer."""
    return segments(plan.leaves, plan.buffer_numel), segments(plan.replicated, replicated_size(plan))


def all_reduce_leaves_numels(plan: LayoutPlan, rank: int, picked: frozenset) -> tuple[int, ...]:
    """The element count of each all-reduce :func:`all_reduce_leaves` issues (for ``step.lower``)."""
    if len(picked) == plan.num_leaves:
        return (plan.shard_size,) + ((plan.replicated_numel,) if plan.replicated_numel else ())
    data = sum(p.numel for p in plan.local_pieces(rank) if p.leaf.index in picked)
    return tuple(n for n in (data, sum(l.numel for l in plan.replicated if l.index in picked)) if n)


def all_reduce_leaves(comm, data: torch.Tensor, replicated: torch.Tensor, plan: LayoutPlan, rank: int,
                      picked: frozenset) -> None:
    """All-reduce (sum) over ``comm``, in place, the elements of the ``picked`` leaves (by index)
    in ``rank``'s shard ``data`` and in ``replicated``; whole buffers when every leaf is picked.
    (A data axis other than the FSDP axis: see [Note: data axes] in ragged/parallel/_transforms.py.)"""
    if len(picked) == plan.num_leaves:
        comm.all_reduce(data, op="sum")
        if replicated.numel():
            comm.all_reduce(replicated, op="sum")
        return
    for buf, pos in zip((data, replicated), leaf_positions(plan, rank, picked, data.device)):
        if pos.numel():
            vals = buf[pos]
            comm.all_reduce(vals, op="sum")
            buf[pos] = vals


def _pack(segs, leaves, numel, dtype, device):
    out = SCRATCH.take(numel, dtype, device)
    if numel == 0:
        return out
    gap = max((n for leaf, n in segs if leaf is None), default=0)
    zeros = torch.zeros(gap, dtype=dtype, device=device) if gap else None
    parts = [zeros[:n] if leaf is None else leaves[leaf.index].reshape(-1) for leaf, n in segs]
    with torch.no_grad():
        torch.cat([p if p.dtype == dtype else p.to(dtype) for p in parts], out=out)
    return out


@poisons("comm")
def reduce_scatter_start(
    plan: LayoutPlan, grads, comm, *, op: str = "mean", dtype: torch.dtype | None = None, replicated=None, out=None,
    format=None,
) -> ReduceScatterPending:
    """Starts :func:`reduce_scatter`; finish with :func:`reduce_scatter_wait`.

    Input checks, packing and the plan check happen here, so errors surface at the start.
    The shard-group reduce-scatter (and the replicated leaves' all-reduce) run asynchronously;
    on an HSDP mesh the cross-replica all-reduce of the S-element result runs in
    :func:`reduce_scatter_wait` (not overlapped).

    Args: as :func:`reduce_scatter`.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(4)}, world_size=2, align=1)
        >>> def fn(comm):
        ...     pending = rg.reduce_scatter_start(plan, {"w": torch.full((4,), comm.rank + 1.0)}, comm)
        ...     # ... compute that overlaps the reduce-scatter ...
        ...     return rg.reduce_scatter_wait(pending).data.tolist()
        >>> rg.collectives.simulate(2, fn)   # the mean of 1 and 2
        [[1.5, 1.5], [1.5, 1.5]]
    """
    return _reduce_scatter_start(plan, grads, comm, op, dtype, replicated=replicated, out=out, format=format)


def _reduce_scatter_start(plan, grads, comm, op, dtype, *, replicated=None, out=None, agreed=False, label=None,
                          format=None, formats=None, tree=False):
    """:func:`reduce_scatter_start`; ``agreed=True`` skips the cross-rank check for callers
    that already made the ranks agree on the plan (``rg.fsdp``'s step, once per step); ``label``
    names the call to the comm (compared across ranks: the step's unit and program position);
    ``formats``: every leaf's format, resolved (instead of ``format``); ``tree=True``: the sum over
    the shard group takes the fixed tree of the chunked step (see [Note: one tree over the chunks]
    in ``ragged/collectives/_tree.py``)."""
    check_plan_type(plan, "reduce_scatter")
    if op not in _OPS:
        raise RaggedValueError(f"reduce_scatter: op must be one of {_OPS}, got {op!r}.")
    if plan.world_size != comm.world_size:
        raise RaggedValueError(
            f"reduce_scatter: the plan shards over world_size={plan.world_size} but the comm's shard group has "
            f"{comm.world_size} ranks. Fix: plan with rg.make_plan(..., world_size=comm.world_size)."
        )
    rdtype = plan.dtype if dtype is None else dtype
    device = comm.device
    if format is not None:  # ``formats``: already resolved by the caller (the step, when it was made)
        formats = formats_of(plan, format, "reduce_scatter: format", replicated=False)
    rep_numel = replicated_size(plan)
    segs, rsegs = _segments(plan)
    if isinstance(grads, torch.Tensor):
        if grads.dim() != 1 or grads.numel() != plan.buffer_numel:
            raise RaggedValueError(
                f"reduce_scatter: a flat gradient must be 1-D with plan.buffer_numel = {plan.buffer_numel} "
                f"elements (world_size {plan.world_size} x shard_size {plan.shard_size}); got shape "
                f"{tuple(grads.shape)}. Fix: pass the gradient of gather's buffer, or a pytree like the params."
            )
        if grads.device.type != device.type:
            raise RaggedValueError(f"reduce_scatter: the flat gradient is on {grads.device}; the comm works on {device}.")
        if not grads.is_floating_point():
            raise RaggedTypeError(f"reduce_scatter: the flat gradient has dtype {grads.dtype}; it must be floating point.")
        if plan.replicated and replicated is None:
            raise RaggedValueError(
                f"reduce_scatter: the plan has {len(plan.replicated)} replicated leaves "
                f"({[l.path for l in plan.replicated][:3]}...); with a flat gradient pass their flat gradient "
                f"too: replicated=<tensor of {rep_numel} elements>."
            )
        flat = grads.detach()
        flat = (flat if flat.dtype == rdtype else flat.to(rdtype)).contiguous()
        if replicated is not None:
            if replicated.numel() != rep_numel:
                raise RaggedValueError(f"reduce_scatter: replicated= has {replicated.numel()} elements, expected {rep_numel}.")
            rep = replicated.detach().reshape(-1).to(rdtype, copy=True)
        else:
            rep = torch.empty(0, dtype=rdtype, device=device)
        zero_padding, pooled = True, False
    else:
        leaves = flatten_like_plan(plan, grads, "grads", device=device)
        leaves = [l.detach() for l in leaves]
        flat = _pack(segs, leaves, plan.buffer_numel, rdtype, device)
        rep = _pack(rsegs, leaves, rep_numel, rdtype, device)
        zero_padding, pooled = False, True
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != (plan.shard_size,) or out.dtype != rdtype or not out.is_contiguous():
            raise RaggedValueError(
                f"reduce_scatter: out= must be a contiguous ({plan.shard_size},) tensor of the reduce dtype {rdtype}, "
                f"got {type(out).__name__} {tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', '')}."
            )
    if not agreed:
        check_plan(plan, comm, f"reduce_scatter:{op}:{rdtype}" + ("" if formats is None else f":{format_key(formats)}"))
    if out is None:
        out = torch.empty(plan.shard_size, dtype=rdtype, device=device)
    if formats is not None:  # see [Note: the quantized reduce-scatter] in _quantized.py
        handles = [reduce_scatter_launch(plan, flat, out, comm, formats, label=label, tree=tree)]
    elif tree and comm.world_size > 2:  # two terms add once: the same bits in either order, on any transport
        handles = [_tree_reduce_scatter_flat_start(plan, out, flat, comm, label=label)]
    else:
        handles = [_reduce_scatter_flat_start(plan, out, flat, comm, op="sum", label=label)]
    if rep.numel():
        rlabel = None if label is None else f"{label} (replicated leaves)"
        handles.append(_tree_all_reduce_start(comm, rep, label=rlabel) if tree else
                       comm.all_reduce(rep, op="sum", async_op=True, label=rlabel))
    return ReduceScatterPending(out, rep, tuple(handles), plan, comm, op, zero_padding, flat, pooled)


@poisons("pending.comm")
def reduce_scatter_wait(pending: ReduceScatterPending) -> DBuffer:
    """Completes :func:`reduce_scatter_start`; returns the same DBuffer as :func:`reduce_scatter`.

    Args:
        pending: what :func:`reduce_scatter_start` returned (wait on it once).

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(2, 2)}, world_size=2, align=1)
        >>> def fn(comm):
        ...     g = {"w": torch.full((2, 2), float(comm.rank))}
        ...     return rg.reduce_scatter_wait(rg.reduce_scatter_start(plan, g, comm, op="sum")).views()["w"].tolist()
        >>> rg.collectives.simulate(2, fn)
        [[[1.0, 1.0]], [[1.0, 1.0]]]
    """
    out, rep = reduced(pending)
    plan = pending.plan
    data = out if out.dtype == plan.dtype else out.to(plan.dtype)
    if rep.dtype != plan.dtype:
        rep = rep.to(plan.dtype)
    if not plan.replicated:
        rep = torch.zeros(0, dtype=plan.dtype, device=data.device)
    return DBuffer(data=data, replicated=rep, plan=plan, rank=pending.comm.rank)


def reduced(pending: ReduceScatterPending) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reduce_scatter_wait` up to the cast to ``plan.dtype``: this rank's reduced shard and
    replicated buffer, in the reduce dtype (the chunked step adds micro-batches in it)."""
    out, rep, handles, plan, comm, op, zero_padding, source, pooled = pending
    for h in handles:
        h.wait()
    if pooled:
        SCRATCH.give(source)
    replicas = comm.num_replicas
    if replicas > 1:
        comm.all_reduce_replicas(out, op="sum")
        if rep.numel():
            comm.all_reduce_replicas(rep, op="sum")
    if op == "mean":  # divided on every device (see [Note: a division every device rounds alike])
        n = comm.world_size * replicas
        out.div_(divisor(out, n))
        rep.div_(divisor(rep, n))
    if zero_padding:  # a flat gradient's padding need not be zero; the result's must
        for lo, hi in local_gaps(plan, comm.rank):
            out[lo:hi].zero_()
    return out, rep


@poisons("comm")
def reduce_scatter(
    plan: LayoutPlan, grads, comm, *, op: str = "mean", dtype: torch.dtype | None = None, replicated=None, out=None,
    format=None,
) -> DBuffer:
    """This rank's shard of the reduction (over every rank) of every rank's ``grads``.

    See [Note: reduce_scatter copies once or never].

    Args:
        plan: the layout of the params the gradients belong to.
        grads: a pytree like the params (full-shape gradients), or a flat 1-D tensor of
            ``plan.buffer_numel`` elements laid out as the plan's buffer (no copy-in).
        comm: collectives; for HSDP the result is reduced over the replicas too.
        op: ``"mean"`` (divide by shard group size x replicas) or ``"sum"``.
        dtype: reduce dtype (e.g. ``torch.float32`` for bf16 gradients); the result is in
            ``plan.dtype``. Default: ``plan.dtype``.
        replicated: with a flat ``grads``, the flat gradient of the replicated buffer (needed
            iff the plan has replicated leaves).
        out: optional ``(plan.shard_size,)`` tensor of the reduce dtype to reduce into (its
            storage becomes the result's ``data`` when the reduce dtype is ``plan.dtype``).
        format: quantize on the wire: a ``rg.quant`` format (every sharded leaf of two or more
            dimensions) or a callable ``LeafLayout -> format | None``. Each rank quantizes its
            gradient block by block; the owner of each block receives every rank's codes and
            scales in one all-to-all and sums them dequantized, in rank order, in float32
            (float64 for a float64 reduce dtype): deterministic (see [Note: the quantized
            reduce-scatter] in ``_quantized.py``). Replicated leaves are all-reduced unquantized.

    Returns:
        A :class:`~ragged.DBuffer` (padding is zero; replicated leaves all-reduced).

    Raises:
        LayoutError, TypeError, ValueError: grads do not match the plan (named by key path),
            raised before any communication.
        PlanMismatchError: ranks hold different plans.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.zeros(4, 2)}
        >>> plan = rg.make_plan(params, world_size=2, align=1)
        >>> def step(comm):
        ...     g = {"w": torch.full((4, 2), float(comm.rank + 1))}   # 1 on rank 0, 2 on rank 1
        ...     return rg.reduce_scatter(plan, g, comm, op="sum").data.tolist()
        >>> rg.collectives.simulate(2, step)
        [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    """
    return reduce_scatter_wait(reduce_scatter_start(plan, grads, comm, op=op, dtype=dtype, replicated=replicated, out=out,
                                                    format=format))
