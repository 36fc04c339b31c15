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
from ragged.collectives._scratch import SCRATCH
from ragged.collectives._tree import sum_rows
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


# ---- the fixed tree over the ranks (see [Note: one tree over the chunks] in ragged/collectives/_tree.py) ----
class _RowsSummed:
    """Handles of all-to-alls (or all-gathers) into ``(m, n)`` rows; ``wait()`` sums each one's rows
    into its output over the fixed tree, then gives the rows back to the scratch pool."""

    __slots__ = ("_parts",)

    def __init__(self, parts):
        self._parts = parts  # (handle, rows, out)

    def wait(self) -> None:
        parts, self._parts = self._parts, []
        for handle, rows, out in parts:
            handle.wait()
            with torch.no_grad():
                sum_rows(rows.view(-1, out.numel()), out)
            SCRATCH.give(rows)

    def is_completed(self) -> bool:
        return all(completed(h) for h, _, _ in self._parts)


def _tree_reduce_scatter_flat_start(plan: LayoutPlan, out: torch.Tensor, flat: torch.Tensor, comm, *,
                                    label: str | None = None):
    """:func:`reduce_scatter_flat` (a sum) whose order is the fixed tree over the ranks: per buffer,
    ONE all-to-all gives each rank every rank's chunk of it as a row (the bytes of a reduce-scatter),
    and the handle's ``wait()`` adds the rows over :func:`~ragged.collectives._tree.sum_rows`'s
    tree, whichever order the transport would sum in (NCCL fixes none). Its caller takes the plain
    reduce-scatter up to two ranks, where one addition per element gives the same bits in either order."""
    _check(plan, flat, out, comm, "reduce_scatter_flat")
    m, parts = plan.world_size, []
    for whole, mine in buffer_views(plan, flat, out):
        n = mine.numel()
        rows = SCRATCH.take(m * n, flat.dtype, flat.device)
        parts.append((comm.all_to_all(rows, whole, [n] * m, [n] * m, async_op=True, label=label), rows, mine))
    return _RowsSummed(parts)


def _tree_all_reduce_start(comm, tensor: torch.Tensor, *, label: str | None = None):
    """An all-reduce (sum, in place) of ``tensor`` over the shard group in the fixed tree's order: an
    all-gather of every rank's copy (``m`` times the bytes: for the small replicated leaves), summed
    on ``wait()``. Up to two ranks the comm's own all-reduce adds once, in either order: the same bits."""
    m = comm.world_size
    if m <= 2:
        return comm.all_reduce(tensor, op="sum", async_op=True, label=label)
    rows = SCRATCH.take(m * tensor.numel(), tensor.dtype, tensor.device)
    return _RowsSummed([(comm.all_gather_into(rows, tensor, async_op=True, label=label), rows, tensor)])


def tree_scratch_buffers(plan: LayoutPlan, dtype: torch.dtype, *, quantized: bool = False) -> tuple[int, ...]:
    """The rows (bytes each scratch buffer) one reduction of the fixed tree takes from the scratch
    pool until its handle is waited (``step.lower`` counts them as wire scratch), from three ranks
    on: each buffer's all-to-all (every rank's chunk of it: ``m * S_b`` elements; a quantized
    reduce-scatter holds its chunks of bytes instead) and the replicated leaves' all-gather (``m``
    copies)."""
    m, size = plan.world_size, dtype.itemsize
    if m <= 2:
        return ()
    rows = () if quantized else tuple(m * s * size for _, s in plan.buffers)
    return rows + ((m * plan.replicated_numel * size,) if plan.replicated else ())
