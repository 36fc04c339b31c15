"""Where one leaf lives: :class:`LeafLayout` (in the global buffer), :class:`LocalPiece` (the
part of it one rank holds) and :class:`ShardRange` (one contiguous range of a rank's shard).

"Local" always means this rank's own piece of an FSDP buffer (see the glossary in docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from ragged.spec._granularity import Granularity

__all__ = ["LeafLayout", "LocalPiece", "ShardRange", "piece_shape"]


def _span_numel(span) -> int:
    """Elements of a ``[start, stop)`` span (``LocalPiece`` and ``ShardRange`` both are one)."""
    return span.stop - span.start


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeafLayout:
    """Where one leaf lives.

    Attributes:
        path: key path string, e.g. ``"['layers'][0]['w']"``.
        index: position of the leaf in the flattened parameter tree (key-sorted for dicts).
        shape: full shape of the leaf.
        dtype: the leaf's own dtype.
        offset: global element offset in the sharded buffer (``m * S`` elements) or, for a
            replicated leaf, in the replicated buffer every rank holds.
        numel: number of elements.
        granule: smallest piece (elements) a rank boundary may not cut.
        granularity: the granularity the leaf was planned with.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> plan = rg.make_plan({"w": torch.empty(6, 4, device="meta")}, spec.Rows(3), world_size=2, align=1)
        >>> leaf = plan.leaves[0]
        >>> leaf.path, leaf.shape, leaf.offset, leaf.numel, leaf.granule, leaf.granularity
        ("['w']", (6, 4), 0, 24, 12, Rows(n=3))
    """

    path: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int
    granule: int
    granularity: Granularity

    replace = dataclasses.replace

    @property
    def stop(self) -> int:
        """One past the leaf's last global element."""
        return self.offset + self.numel

    @property
    def row_size(self) -> int:
        """Elements per row (the last dimension; 1 for 0-d and 1-D leaves)."""
        return self.shape[-1] if len(self.shape) >= 2 else 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalPiece:
    """The part of one leaf that one rank holds.

    Attributes:
        leaf: the leaf's layout.
        start: first element of the leaf held (in the leaf's flattened order).
        stop: one past the last element held.
        local_offset: where the piece starts inside the rank's shard of S elements.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(5, 2), "b": torch.empty(3)}, world_size=2, align=1)
        >>> [(p.leaf.path, p.start, p.stop, p.local_offset) for p in plan.local_pieces(1)]   # rank 1's pieces
        [("['w']", 4, 10, 0)]
    """

    leaf: LeafLayout
    start: int
    stop: int
    local_offset: int

    numel = property(_span_numel)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the piece's view: whole leading slices or whole rows when the cut allows,
        else flat."""
        return piece_shape(self.leaf.shape, self.start, self.stop)


class ShardRange(NamedTuple):
    """One contiguous part of a rank's shard: global elements ``[start, stop)`` of one buffer,
    held at ``[local_offset, local_offset + stop - start)`` of the rank's ``S`` elements."""

    start: int
    stop: int
    local_offset: int

    numel = property(_span_numel)


def piece_shape(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    """Shape a contiguous piece ``[start, stop)`` of a leaf is viewed with.

    Whole slices along dim 0 keep their trailing shape (``(k, *shape[1:])``); whole rows of
    the last dimension become ``(k, shape[-1])``; anything else is flat.

    Examples:
        >>> piece_shape((4, 3, 2), 6, 18), piece_shape((4, 3, 2), 2, 8), piece_shape((4, 3, 2), 1, 4)
        ((2, 3, 2), (3, 2), (3,))
    """
    n = stop - start
    if len(shape) == 0:
        return () if n == 1 else (n,)
    inner = math.prod(shape[1:])
    if inner > 0 and start % inner == 0 and n % inner == 0:
        return (n // inner, *shape[1:])
    if len(shape) >= 2:
        row = shape[-1]
        if row > 0 and start % row == 0 and n % row == 0:
            return (n // row, row)
    return (n,)
