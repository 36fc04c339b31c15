"""A plan's gathered flat buffer <-> this rank's shard, for any number of buffers.

[Note: one launch per unit, whatever its buffers]
A plan's gathered buffer is one flat tensor of ``m * S`` elements; with several buffers (see
[Note: buffers of a plan] in ``ragged/spec/_plan.py``) rank k's shard of it is several ranges,
one per buffer, and its ``S`` elements are those ranges back to back. So the all-gather of a
unit is one all-gather per buffer, from a slice of the shard into a slice of the flat buffer
(still zero copy), and the reduce-scatter the mirror. :func:`all_gather_flat` and
:func:`reduce_scatter_flat` issue them as ONE coalesced launch through the comm's
``all_gather_into_coalesced`` / ``reduce_scatter_into_coalesced`` (one gloo p2p batch; one NCCL
group), or one call per buffer for a comm without them. Both are synchronous; the asynchronous
form is ragged's one style, a ``*_start`` that returns what its ``*_wait`` completes
(``gather_start`` / ``gather_wait``, ``reduce_scatter_start`` / ``reduce_scatter_wait``), built
on this module's private ``_all_gather_flat_start`` / ``_reduce_scatter_flat_start`` (a handle
with ``wait()``), which the training step's runtime uses too. A single-buffer plan makes exactly
the one ``comm.all_gather_into`` / ``comm.reduce_scatter_into`` call it always made. Every
consumer that moves a whole unit's flat buffer (``gather``, ``reduce_scatter``, gather's
backward, ``rg.fsdp``'s step) goes through these two functions.
"""

from __future__ import annotations

import torch

from ragged._errors import RaggedValueError
from ragged.collectives._base import completed
from ragged.spec._plan import LayoutPlan

__all__ = ["all_gather_flat", "reduce_scatter_flat", "buffer_views"]  # and the runtime's two *_start


class _Handles:
    """Waits on several handles (the per-buffer fallback)."""

    __slots__ = ("_handles",)

    def __init__(self, handles):
        self._handles = [h for h in handles if h is not None]

    def wait(self) -> None:
        for h in self._handles:
            h.wait()

    def is_completed(self) -> bool:
        return all(completed(h) for h in self._handles)


def buffer_views(plan: LayoutPlan, flat: torch.Tensor, local: torch.Tensor):
    """``[(flat[offset_b : offset_b + m*S_b], local[base_b : base_b + S_b])]``: per buffer, its
    slice of the gathered flat buffer and of this rank's shard (views, no copy)."""
    m = plan.world_size
    out, base = [], 0
    for offset, size in plan.buffers:
        out.append((flat[offset : offset + m * size], local[base : base + size]))
        base += size
    return out


def _check(plan: LayoutPlan, flat: torch.Tensor, local: torch.Tensor, comm, where: str) -> None:
    if plan.world_size != comm.world_size:
        raise RaggedValueError(
            f"{where}: the plan shards over world_size={plan.world_size} but the comm's shard group has "
            f"{comm.world_size} ranks."
        )
    if flat.dim() != 1 or flat.numel() != plan.buffer_numel or local.dim() != 1 or local.numel() != plan.shard_size:
        raise RaggedValueError(
            f"{where}: needs a flat buffer of plan.buffer_numel = {plan.buffer_numel} elements and a shard of "
            f"plan.shard_size = {plan.shard_size}; got {tuple(flat.shape)} and {tuple(local.shape)}."
        )


def all_gather_flat(plan: LayoutPlan, out: torch.Tensor, local: torch.Tensor, comm, *, label: str | None = None) -> None:
    """``out`` (the ``m * S`` gathered buffer) <- every rank's ``local`` shard (``S`` elements),
    one coalesced launch for all of the plan's buffers. See [Note: one launch per unit,
    whatever its buffers].

    Args:
        plan: the plan both buffers are laid out by.
        out: the flat ``plan.buffer_numel`` output.
        local: this rank's ``plan.shard_size`` elements.
        comm: the shard group's collectives.
        label: what the call carries besides the plan's identity, compared across ranks.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged.transforms import all_gather_flat
        >>> plan = rg.make_plan({"a": torch.empty(8, 3), "b": torch.empty(4, 5)}, world_size=2, align=1,
        ...                     max_buffers=2)
        >>> def fn(comm):
        ...     out = torch.empty(plan.buffer_numel)
        ...     all_gather_flat(plan, out, torch.full((plan.shard_size,), float(comm.rank)), comm)
        ...     return [out[o : o + 2 * s].view(2, s)[:, 0].tolist() for o, s in plan.buffers]
        >>> rg.collectives.simulate(2, fn)[0]   # per buffer: rank 0's piece, then rank 1's
        [[0.0, 1.0], [0.0, 1.0]]
    """
    _all_gather_flat(plan, out, local, comm, False, label)


def _all_gather_flat_start(plan: LayoutPlan, out: torch.Tensor, local: torch.Tensor, comm, *, label: str | None = None):
    """:func:`all_gather_flat` started: returns a handle with ``wait()``."""
    return _all_gather_flat(plan, out, local, comm, True, label)


def _all_gather_flat(plan, out, local, comm, async_op, label):
    _check(plan, out, local, comm, "all_gather_flat")
    return _launch(plan, comm, "all_gather_into", buffer_views(plan, out, local), async_op, label=label)


def reduce_scatter_flat(plan: LayoutPlan, out: torch.Tensor, flat: torch.Tensor, comm, *, op: str = "sum",
                        label: str | None = None) -> None:
    """``out`` (this rank's ``S`` elements) <- its ranges of the reduction over the shard group
    of every rank's ``flat`` (``m * S``), one coalesced launch for all buffers. The transpose of
    :func:`all_gather_flat`.

    Args:
        plan: the plan both buffers are laid out by.
        out: this rank's ``plan.shard_size`` elements.
        flat: this rank's full ``plan.buffer_numel`` contribution.
        comm: the shard group's collectives.
        op: ``"sum"`` or ``"mean"`` over the shard group.
        label: what the call carries besides the plan's identity, compared across ranks.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged.transforms import reduce_scatter_flat
        >>> plan = rg.make_plan({"a": torch.empty(8, 3), "b": torch.empty(4, 5)}, world_size=2, align=1,
        ...                     max_buffers=2)
        >>> def fn(comm):
        ...     out = torch.empty(plan.shard_size)
        ...     reduce_scatter_flat(plan, out, torch.arange(float(plan.buffer_numel)), comm)
        ...     return out.tolist() == [2.0 * r.start + 2 * i for r in plan.shard_ranges(comm.rank) for i in range(r.numel)]
        >>> rg.collectives.simulate(2, fn)
        [True, True]
    """
    _reduce_scatter_flat(plan, out, flat, comm, op, False, label)


def _reduce_scatter_flat_start(plan: LayoutPlan, out: torch.Tensor, flat: torch.Tensor, comm, *, op: str = "sum",
                               label: str | None = None):
    """:func:`reduce_scatter_flat` started: returns a handle with ``wait()``."""
    return _reduce_scatter_flat(plan, out, flat, comm, op, True, label)


def _reduce_scatter_flat(plan, out, flat, comm, op, async_op, label):
    _check(plan, flat, out, comm, "reduce_scatter_flat")
    return _launch(plan, comm, "reduce_scatter_into", [(o, i) for i, o in buffer_views(plan, flat, out)], async_op,
                   op=op, label=label)


def _launch(plan, comm, name: str, pairs, async_op: bool, **kw):
    """``comm.<name>(output, input, **kw)`` for one buffer; ``comm.<name>_coalesced`` for several,
    or one ``comm.<name>`` per buffer when the comm has no coalesced op."""
    if len(plan.buffers) == 1:
        (out, inp), = pairs
        return getattr(comm, name)(out, inp, async_op=async_op, **kw)
    coalesced = getattr(comm, name + "_coalesced", None)
    if coalesced is not None:
        return coalesced([o for o, _ in pairs], [i for _, i in pairs], async_op=async_op, **kw)
    handles = [getattr(comm, name)(o, i, async_op=async_op, **kw) for o, i in pairs]
    return _Handles(handles) if async_op else None
