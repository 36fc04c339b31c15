"""``make_step(..., chunks=C)``: a step whose numbers do not depend on the data-parallel world
size, and :func:`local_chunks`, each rank's rows of a global batch in the order it runs them.

[Note: the chunked step]
The global batch is ``C`` equal chunks. Data-parallel rank ``d`` of ``D`` (``D``: the FSDP ranks
times the HSDP replicas, ``d = replica * W + rank``) runs chunks ``d, D + d, 2D + d, ...`` as its
``C / D`` micro-batches, so micro-batch ``j`` of every rank together is the aligned block of
chunks ``j * D .. j * D + D - 1``. Each chunk's loss and gradient are computed alone, unscaled,
at the same batch size at every ``D`` (kernels whose results depend on the batch size see the
same shapes). Its gradient is then summed with the others over one fixed binary tree of the
chunk indices ([Note: one tree over the chunks] in ``ragged/collectives/_tree.py``):

* over the ranks, per micro-batch: from three ranks on, each unit's reduce-scatter is an
  all-to-all of the same bytes whose rows the owner adds over the tree (``transforms/_flat.py``;
  the quantized reduce-scatter decodes each rank's chunk and adds them the same way at any
  size); two ranks, like the HSDP replicas' all-reduce of two terms, add once, which gives the same
  bits in either order on any transport;
* over the micro-batches: a :class:`~ragged.collectives._tree.TreeSum` per unit, in the reduce
  dtype (at most ``log2(C / D) + 1`` shards alive, ``_reducing.py``);
* then divided once by ``C`` and cast to the plan's dtype.

The loss is the same tree over the ``C`` chunk losses (each rank writes its chunks' slots of the
end-of-call agreement, ``_grad.py``), divided by ``C``. Every element of the tree is then the
same sum at every ``D`` that is a power of two dividing ``C`` (and at ``D = C`` on one replica:
one micro-batch, the counter over the ranks itself). The global norm of clipping adds squares
in exact integer arithmetic ([Note: a norm that does not depend on the split] in
``ragged/_dbuffer.py``), and everything after the gradient is element-wise or block-local.
What this cannot hold: a world size the tree does not serve, more than two HSDP replicas (the
backend's all-reduce of more than two terms picks its own order), expert parallelism (a data
group: each expert's matmul sums the tokens of several ranks' chunks at once) and a quantized
reduce-scatter into a reduce dtype narrower than float32 (each micro-batch's sum is rounded to
it at a point that depends on ``D``): :func:`chunked_micro_batches` and :func:`check_chunked`
refuse them when the step is made. See docs/invariance.md.
"""

from __future__ import annotations

import torch

from ragged._errors import RaggedTypeError, RaggedValueError, check_int
from ragged._pytree import flatten_with_keystr, pytree

__all__ = ["local_chunks", "data_parallel", "served_world_sizes", "chunked_micro_batches", "check_chunked", "chunk_losses",
           "LATE_CHUNKS_MSG"]

LATE_CHUNKS_MSG = (
    "rg.fsdp chunked step: gradients still reached units after their reduce-scatter in {attempts} attempts with "
    "the learnt schedule; outside the reduce-scatter they would be added outside the fixed tree over the chunks, "
    "so the numbers would depend on the world size (every rank raises this, before any parameter changes). Fix: "
    "make such parts one unit (make_units(groups=...)), or drop chunks=."
)


def data_parallel(comm) -> tuple[int, int]:
    """``(d, D)``: this rank's index among the data-parallel ranks (replica-major) and their number."""
    w, replicas = comm.world_size, getattr(comm, "num_replicas", 1)
    return getattr(comm, "replica_rank", 0) * w + comm.rank, w * replicas


def served_world_sizes(chunks: int) -> tuple[int, ...]:
    """The data-parallel world sizes at which a step with ``chunks`` gives the same bits: the
    powers of two that divide ``chunks``, and ``chunks`` itself (see [Note: the chunked step]).

    Examples:
        >>> served_world_sizes(8), served_world_sizes(12), served_world_sizes(6)
        ((1, 2, 4, 8), (1, 2, 4, 12), (1, 2, 6))
    """
    sizes = [1 << k for k in range(chunks.bit_length()) if chunks % (1 << k) == 0]
    return tuple(sizes) if chunks in sizes else (*sizes, chunks)


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def chunked_micro_batches(chunks, comm, micro_batches, where: str) -> int:
    """The micro-batches per rank of a step with ``chunks`` on ``comm`` (``C / D``), or the error
    naming ``C``, ``D`` and the fix (every rank raises it alike: it reads only values every rank
    shares)."""
    check_int("chunks", chunks)
    _, dp = data_parallel(comm)
    w, replicas = comm.world_size, getattr(comm, "num_replicas", 1)
    served = served_world_sizes(chunks)
    here = f"data-parallel world size W={dp}" + (f" ({w} ranks x {replicas} HSDP replicas)" if replicas > 1 else "")
    why = None
    if chunks % dp:
        why = f"W does not divide chunks={chunks}"
    elif dp not in served:
        why = (f"chunks={chunks} gives the same numbers at W in {served} only (powers of two dividing it, and "
               f"chunks itself: the sums follow one binary tree over the chunks, see docs/invariance.md)")
    elif replicas > 2:
        why = (f"{replicas} HSDP replicas: their all-reduce adds more than two terms in the backend's order, which "
               "no tree fixes (two replicas add once, the same bits either way)")
    elif replicas == 2 and not _power_of_two(w):
        why = f"two HSDP replicas of {w} ranks do not split chunks={chunks}'s tree into two halves"
    if why is not None:
        fix = f"run at a data-parallel world size in {served}" + (" with at most 2 replicas" if replicas > 2 else "")
        if replicas <= 2 and _power_of_two(dp):
            fix += f", or chunks={dp * -(-chunks // dp)} (a power-of-two W serves every multiple of itself)"
        elif replicas == 1:
            fix += f", or chunks={dp} (W serves chunks=W: one micro-batch per rank)"
        raise RaggedValueError(f"{where}: chunks={chunks} at {here}: {why}. Fix: {fix}.")
    per_rank = chunks // dp
    if micro_batches is not None and micro_batches != per_rank:
        raise RaggedValueError(
            f"{where}: micro_batches={micro_batches} with chunks={chunks} at W={dp}: each rank runs its "
            f"chunks / W = {per_rank} chunks as its micro-batches. Fix: leave micro_batches out (chunks= sets it).")
    return per_rank


def check_chunked(layouts, data_groups, where: str) -> None:
    """Refuses what a chunked step cannot keep independent of the world size (see [Note: the
    chunked step]): data groups (expert parallelism) and a quantized reduce-scatter into a
    reduce dtype narrower than float32."""
    if data_groups:
        raise RaggedValueError(
            f"{where}: chunks= with data_groups (expert parallelism): an expert's matmul then sums the tokens of "
            "several ranks' chunks at once, in an order and at batch sizes that depend on the EP size, so no tree "
            "over the chunks fixes its gradient. Fix: drop chunks= under expert parallelism, or run the experts "
            "on the FSDP axis only (no data groups).")
    for lay in layouts:
        dtype = lay.reduce_dtype or (lay.grad_plan.dtype if lay.grad_plan is not None else None)
        if lay.reduce_formats is not None and dtype is not None and dtype.itemsize < 4:
            raise RaggedValueError(
                f"{where}: chunks= with a quantized reduce-scatter into {dtype} (unit {lay.name!r}): the owner adds "
                "each micro-batch's dequantized chunks in float32 and rounds the sum to the reduce dtype, at a point "
                "of the tree that depends on the world size. Fix: MixedPrecision(reduce_dtype=torch.float32) with "
                "reduce_format=..., or no reduce_format.")


def chunk_losses(losses, comm, chunks) -> torch.Tensor:
    """This rank's chunk losses in their slots of the ``chunks``, on the device (zeros elsewhere:
    the all-reduce adds each to zeros, exactly; ``+ 0.0`` makes a ``-0.0`` the ``0.0`` every sum of
    it gives)."""
    d, dp = data_parallel(comm)
    slots = torch.zeros(chunks, dtype=torch.float64, device=comm.device)
    if losses:
        slots[d::dp][: len(losses)] = torch.stack([l.double() for l in losses]) + 0.0
    return slots


def local_chunks(batch, chunks: int, comm):
    """This rank's rows of a global batch, in the order a step made with ``chunks=`` runs them.

    The global batch (a pytree of tensors, the batch on dim 0) is ``chunks`` equal chunks of
    consecutive rows; data-parallel rank ``d`` of ``W`` (FSDP ranks x HSDP replicas, replica-major)
    gets chunks ``d, W + d, 2W + d, ...``, one micro-batch each (see [Note: the chunked step]).

    Args:
        batch: the global batch, the same on every rank (each rank may also load only these rows).
        chunks: ``C`` of the step (:func:`ragged.fsdp.make_step`).
        comm: the step's comm.

    Returns:
        A pytree like ``batch`` with ``chunks / W`` chunks of rows per leaf (a copy).

    Raises:
        RaggedValueError: ``W`` does not divide ``chunks``, or a leaf's leading dimension is not a
            multiple of ``chunks`` (named by key path).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> rows = torch.arange(8)
        >>> rg.collectives.simulate(2, lambda comm: fsdp.local_chunks(rows, 4, comm).tolist())
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    check_int("chunks", chunks)
    d, dp = data_parallel(comm)
    if chunks % dp:
        raise RaggedValueError(f"local_chunks: chunks={chunks} does not split over the data-parallel world size "
                               f"W={dp}. Fix: chunks= a multiple of W (the step's own chunks=).")
    paths, leaves, treedef = flatten_with_keystr(batch)
    out = []
    for path, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            raise RaggedTypeError(f"local_chunks: batch{path} is a {type(x).__name__}; every leaf must be a tensor "
                                  "with the batch on dim 0.")
        if x.dim() == 0 or x.shape[0] % chunks:
            raise RaggedValueError(
                f"local_chunks: batch{path} has shape {tuple(x.shape)}; with chunks={chunks} its leading dimension "
                f"must be a multiple of {chunks}. Fix: a global batch size that chunks divides.")
        rows = x.shape[0] // chunks
        out.append(x.reshape(chunks, rows, *x.shape[1:])[d::dp].reshape(chunks // dp * rows, *x.shape[1:]))
    return pytree.unflatten(treedef, out)
