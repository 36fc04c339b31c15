"""`LayoutPlan`: where every leaf lives in the flat communication buffer.

A plan holds no tensors. It is a frozen, hashable value: equal inputs give equal plans, so
plans can key caches and be compared across ranks (:meth:`LayoutPlan.fingerprint`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import torch

from ragged.spec._granularity import Granularity
from ragged._errors import RaggedKeyError, RaggedValueError

__all__ = ["LeafLayout", "LocalPiece", "LayoutPlan"]


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
        spec: the granularity the leaf was planned with.
    """

    path: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int
    granule: int
    spec: Granularity

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
    """

    leaf: LeafLayout
    start: int
    stop: int
    local_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the piece's view: whole leading slices or whole rows when the cut allows,
        else flat."""
        return piece_shape(self.leaf.shape, self.start, self.stop)


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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LayoutPlan:
    """A layout of a parameter tree into one flat buffer of ``world_size * shard_size``
    elements (rank k holds ``[k*S, (k+1)*S)``), plus the replicated leaves.

    Build one with :func:`ragged.make_plan`. Leaves are contiguous, blocks never cross a
    rank boundary (except under ``strategy="naive"``, which reports ``split_blocks``), and
    padding sits only between leaves and at the end.

    Attributes:
        leaves: sharded leaves in buffer order.
        replicated: leaves kept whole on every rank (``spec.Replicate()``), with offsets into
            the replicated buffer.
        world_size: m, the number of ranks in the shard group.
        shard_size: S, elements per rank.
        dtype: the buffer's dtype (one buffer has one dtype).
        align: offset alignment in elements.
        strategy: the strategy that produced the plan.
        split_blocks: how many (leaf, boundary) pairs cut a granule (0 except for "naive").
        treedef: the parameter tree's structure, to rebuild trees from leaves.
    """

    leaves: tuple[LeafLayout, ...]
    replicated: tuple[LeafLayout, ...] = ()
    world_size: int
    shard_size: int
    dtype: torch.dtype
    align: int
    strategy: str
    split_blocks: int = 0
    treedef: Any = dataclasses.field(repr=False)

    replace = dataclasses.replace

    # ---- sizes -------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Elements of all sharded leaves together."""
        return sum(leaf.numel for leaf in self.leaves)

    @property
    def buffer_numel(self) -> int:
        """``world_size * shard_size``: the gathered buffer's length."""
        return self.world_size * self.shard_size

    @property
    def replicated_numel(self) -> int:
        return sum(leaf.numel for leaf in self.replicated)

    @property
    def padding(self) -> int:
        """``m * S - sum(numel)``: zero elements in the gathered buffer."""
        return self.buffer_numel - self.numel

    @property
    def overhead(self) -> float:
        """``padding / sum(numel)`` (0.0 for an empty buffer)."""
        return self.padding / self.numel if self.numel else 0.0

    @property
    def num_leaves(self) -> int:
        return len(self.leaves) + len(self.replicated)

    # ---- per-rank queries ----------------------------------------------------------------
    def local_pieces(self, rank: int) -> tuple[LocalPiece, ...]:
        """The pieces of sharded leaves that ``rank`` holds, in buffer order.

        Examples:
            >>> import torch, ragged as rg
            >>> plan = rg.make_plan({"w": torch.empty(6, 4)}, world_size=2, align=1)
            >>> [(p.start, p.stop, p.shape) for p in plan.local_pieces(1)]
            [(12, 24, (3, 4))]
        """
        if not 0 <= rank < self.world_size:
            raise RaggedValueError(f"rank must be in [0, {self.world_size}), got {rank}.")
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        pieces = []
        for leaf in self.leaves:
            start, stop = max(leaf.offset, lo), min(leaf.stop, hi)
            if start < stop:
                pieces.append(
                    LocalPiece(leaf=leaf, start=start - leaf.offset, stop=stop - leaf.offset, local_offset=start - lo)
                )
        return tuple(pieces)

    def occupancy(self) -> tuple[int, ...]:
        """Elements of real data (not padding) each rank holds (one pass over the leaves).

        Examples:
            >>> import torch, ragged as rg
            >>> rg.make_plan({"w": torch.empty(7, 4)}, world_size=3, align=1).occupancy()
            (12, 12, 4)
        """
        S = self.shard_size
        occ = [0] * self.world_size
        for leaf in self.leaves:
            if not leaf.numel:
                continue
            first, last = leaf.offset // S, (leaf.stop - 1) // S
            if first == last:
                occ[first] += leaf.numel
                continue
            occ[first] += (first + 1) * S - leaf.offset
            for r in range(first + 1, last):
                occ[r] += S
            occ[last] += leaf.stop - last * S
        return tuple(occ)

    def owners(self, leaf: LeafLayout) -> tuple[int, ...]:
        """Ranks holding at least one element of ``leaf``."""
        if leaf.numel == 0:
            return ()
        S = self.shard_size
        return tuple(range(leaf.offset // S, (leaf.stop - 1) // S + 1))

    def leaf(self, path: str) -> LeafLayout:
        """The layout of the leaf at key path ``path`` (sharded or replicated)."""
        for leaf in self.leaves + self.replicated:
            if leaf.path == path:
                return leaf
        raise RaggedKeyError(f"no leaf at {path!r}; paths are {[l.path for l in self.leaves + self.replicated]}")

    def fingerprint(self) -> str:
        """A digest that is equal on two processes exactly when their plans are equal.

        (``hash()`` of strings is salted per process, so it cannot serve across ranks.)
        """
        text = repr(
            (
                self.world_size,
                self.shard_size,
                str(self.dtype),
                self.align,
                self.strategy,
                [(l.path, l.index, l.shape, str(l.dtype), l.offset, l.granule, repr(l.spec)) for l in self.leaves],
                [(l.path, l.index, l.shape, str(l.dtype), l.offset, repr(l.spec)) for l in self.replicated],
                str(self.treedef),
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()

    # ---- display -------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (
            f"LayoutPlan(world_size={self.world_size}, shard_size={self.shard_size}, "
            f"leaves={len(self.leaves)}, replicated={len(self.replicated)}, dtype={self.dtype}, "
            f"padding={self.padding} ({self.overhead:.2%}), strategy={self.strategy!r})"
        )

    def __rich__(self):
        from ragged._viz import plan_summary

        return plan_summary(self)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        # Jupyter: show the rich summary (text/html + text/plain) as a cell's output.
        from rich.panel import Panel

        from ragged._viz import plan_summary

        return Panel(plan_summary(self), expand=False)._repr_mimebundle_(include, exclude, **kwargs)
