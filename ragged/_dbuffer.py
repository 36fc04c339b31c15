"""DBuffer: this rank's flat shard of a plan, with zero-copy views of every leaf.

[Note: DBuffer is a pytree of two tensors]
A DBuffer is an optree dataclass in the ``"ragged"`` namespace whose children are the
two flat tensors ``data`` (this rank's S elements of the sharded buffer) and
``replicated`` (every replicated leaf, whole, on every rank); the plan and rank are static
metadata. So ``ragged.pytree.map(fn, dbuf)`` runs ``fn`` once per buffer (one kernel over all
leaves, never one per leaf), and optimizers written over pytrees work on DBuffers unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from optree.dataclasses import dataclass, field

from ragged._pytree import pytree
from ragged.spec._plan import LayoutPlan, piece_shape

__all__ = ["DBuffer", "unflatten"]


@dataclass(frozen=True, namespace="ragged")
class DBuffer:
    """This rank's shard of a :class:`~ragged.spec.LayoutPlan`.

    Attributes:
        data: 1-D tensor of ``plan.shard_size`` elements (padding is zero).
        replicated: 1-D tensor holding every replicated leaf (may be empty).
        plan: the layout (static metadata).
        rank: this rank's index in the shard group (static metadata).
    """

    data: torch.Tensor
    replicated: torch.Tensor
    plan: LayoutPlan = field(pytree_node=False)
    rank: int = field(pytree_node=False)

    replace = dataclasses.replace

    def views(self):
        """A pytree like the params whose leaves are zero-copy views of this rank's pieces.

        A leaf this rank holds none of is an empty view. Pieces keep rows as rows when the
        cut falls on row boundaries (see :func:`ragged.spec.piece_shape`).
        """
        plan = self.plan
        leaves = [None] * plan.num_leaves
        held = {piece.leaf.index: piece for piece in plan.local_pieces(self.rank)}
        for leaf in plan.leaves:
            piece = held.get(leaf.index)
            if piece is None:
                empty_shape = (0, *leaf.shape[1:]) if len(leaf.shape) >= 1 else (0,)
                leaves[leaf.index] = self.data[:0].view(empty_shape)
            else:
                view = self.data[piece.local_offset : piece.local_offset + piece.numel]
                leaves[leaf.index] = view.view(piece_shape(leaf.shape, piece.start, piece.stop))
        for leaf in plan.replicated:
            leaves[leaf.index] = self.replicated[leaf.offset : leaf.offset + leaf.numel].view(leaf.shape)
        return pytree.unflatten(plan.treedef, leaves)


def unflatten(plan: LayoutPlan, buffer: torch.Tensor, replicated: torch.Tensor | None = None):
    """Views of every leaf in a gathered flat buffer of ``plan.buffer_numel`` elements.

    Zero-copy: each returned tensor shares ``buffer``'s (or ``replicated``'s) storage.
    """
    leaves = [None] * plan.num_leaves
    for leaf in plan.leaves:
        leaves[leaf.index] = buffer[leaf.offset : leaf.stop].view(leaf.shape)
    for leaf in plan.replicated:
        if replicated is None:
            raise ValueError("the plan has replicated leaves; pass the replicated buffer too.")
        leaves[leaf.index] = replicated[leaf.offset : leaf.stop].view(leaf.shape)
    return pytree.unflatten(plan.treedef, leaves)
