"""`LayoutPlan`: where every leaf lives in the flat communication buffer.

A plan holds no tensors. It is a frozen, hashable value: equal inputs give equal plans, so
plans can key caches and be compared across ranks (:meth:`LayoutPlan.fingerprint`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import itertools
from typing import Any

import torch

from ragged._errors import RaggedKeyError, RaggedValueError
from ragged._viz import plan_summary
from ragged.spec._leaf import LeafLayout, LocalPiece, ShardRange, piece_shape

__all__ = ["LeafLayout", "LocalPiece", "LayoutPlan", "ShardRange", "piece_shape"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LayoutPlan:
    """A layout of a parameter tree into flat buffers sharded over ``world_size`` ranks, plus
    the replicated leaves.

    [Note: buffers of a plan]
    A plan has one or more *buffers* (``plan.buffers``, ``((offset_b, S_b), ...)``). Buffer b
    occupies global elements ``[offset_b, offset_b + m * S_b)`` and rank k owns
    ``[offset_b + k * S_b, offset_b + (k + 1) * S_b)`` of it; buffers tile the global buffer
    of ``m * S`` elements in order (``offset_0 = 0``), and ``S = shard_size = sum(S_b)``. A
    rank's shard (``DBuffer.data``) is its piece of buffer 0, then of buffer 1, ... So a
    gathered unit is still ONE flat tensor of ``m * S`` elements in which every leaf is a
    contiguous range (``leaf.offset`` is global), but rank k's part of it is several ranges:
    :meth:`shard_ranges` says which, and :meth:`locate` / :meth:`global_position` convert
    between global positions and (rank, local offset). A single-buffer plan (the default,
    ``make_plan(max_buffers=1)``) has ``buffers == ((0, S),)`` and rank k owns ``[kS, (k+1)S)``.

    Build one with :func:`ragged.make_plan`. Leaves are contiguous, each inside one buffer,
    granules never cross a rank boundary of their buffer (except under ``strategy="naive"``,
    which reports ``split_blocks``), and padding sits only between leaves and at the end of
    each buffer.

    Attributes:
        leaves: sharded leaves in buffer order (global offset order).
        replicated: leaves kept whole on every rank (``spec.Replicate()``), with offsets into
            the replicated buffer.
        world_size: m, the number of ranks in the shard group.
        shard_size: S, elements per rank (the sum of the buffers' ``S_b``).
        dtype: the buffers' dtype (one dtype per plan).
        align: offset alignment in elements.
        strategy: the strategy that produced the plan.
        split_blocks: how many (leaf, boundary) pairs cut a granule (0 except for "naive").
        treedef: the parameter tree's structure, to rebuild trees from leaves.
        buffers: ``((offset_b, S_b), ...)``, see [Note: buffers of a plan]; default (and
            whenever one buffer is given) ``((0, shard_size),)``.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(5, 4, device="meta"), "b": torch.empty(3, device="meta")},
        ...                     world_size=2, align=1)
        >>> plan.world_size, plan.shard_size, plan.padding, plan.buffers
        (2, 12, 1, ((0, 12),))
        >>> [(l.path, l.offset, l.numel, l.granule) for l in plan.leaves]
        [("['b']", 0, 3, 1), ("['w']", 4, 20, 4)]
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
    buffers: tuple[tuple[int, int], ...] = ()

    replace = dataclasses.replace

    def __post_init__(self):
        buffers = tuple((int(o), int(s)) for o, s in self.buffers)
        if len(buffers) <= 1:  # one buffer is the whole shard (also after replace(shard_size=...))
            buffers = ((0, self.shard_size),)
        else:
            pos = 0
            for b, (offset, size) in enumerate(buffers):
                if offset != pos or size < 1:
                    raise RaggedValueError(
                        f"LayoutPlan.buffers must tile the global buffer in order with positive sizes: buffer {b} is "
                        f"(offset {offset}, S_b {size}) but should start at {pos}. Buffers: {buffers}."
                    )
                pos += self.world_size * size
            if sum(size for _, size in buffers) != self.shard_size:
                raise RaggedValueError(
                    f"LayoutPlan: shard_size {self.shard_size} is not the sum of the buffers' sizes {buffers}."
                )
        object.__setattr__(self, "buffers", buffers)

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

    @property
    def num_buffers(self) -> int:
        """How many buffers the plan has (one collective launch each, coalesced)."""
        return len(self.buffers)

    # ---- where elements live: the one vocabulary for multi-buffer plans ---------------------
    def buffer_index(self, offset: int) -> int:
        """The buffer holding global element ``offset``.

        Examples:
            >>> import torch, ragged as rg
            >>> from ragged import spec
            >>> plan = rg.make_plan({"a": torch.empty(8, 3), "b": torch.empty(4, 5)}, world_size=2, align=1,
            ...                     max_buffers=2)
            >>> plan.buffers, [plan.buffer_index(l.offset) for l in plan.leaves]
            (((0, 12), (24, 10)), [0, 1])
        """
        return _buffer_starts(self.buffers)[1](offset)

    def shard_ranges(self, rank: int) -> tuple[ShardRange, ...]:
        """The global ranges ``rank`` owns, one per buffer, and where each sits in its shard.

        Rank k's shard is ``cat([global[r.start:r.stop] for r in plan.shard_ranges(k)])``.

        Examples:
            >>> import torch, ragged as rg
            >>> plan = rg.make_plan({"a": torch.empty(8, 3), "b": torch.empty(4, 5)}, world_size=2, align=1,
            ...                     max_buffers=2)
            >>> [tuple(r) for r in plan.shard_ranges(1)]
            [(12, 24, 0), (34, 44, 12)]
        """
        if not 0 <= rank < self.world_size:
            raise RaggedValueError(f"rank must be in [0, {self.world_size}), got {rank}.")
        bases = _buffer_starts(self.buffers)[3]
        return tuple(ShardRange(o + rank * s, o + (rank + 1) * s, base) for (o, s), base in zip(self.buffers, bases))

    def locate(self, positions):
        """Owner rank and offset in that rank's shard of global buffer positions.

        Args:
            positions: an int, or an integer tensor of global positions in ``[0, m * S)``.

        Returns:
            ``(rank, local_offset)``: two ints, or two int64 tensors like ``positions``.

        Examples:
            >>> import torch, ragged as rg
            >>> plan = rg.make_plan({"a": torch.empty(8, 3), "b": torch.empty(4, 5)}, world_size=2, align=1,
            ...                     max_buffers=2)
            >>> plan.locate(13), [t.tolist() for t in plan.locate(torch.tensor([0, 13, 24, 43]))]
            ((1, 1), [[0, 1, 0, 1], [0, 1, 12, 21]])
        """
        starts, _, sizes, bases = _buffer_starts(self.buffers)
        if isinstance(positions, torch.Tensor):
            pos = positions.to(torch.int64)
            if len(self.buffers) == 1:
                S = max(self.shard_size, 1)
                rank = torch.div(pos, S, rounding_mode="floor")
                return rank, pos - rank * S
            b = torch.searchsorted(torch.tensor(starts, dtype=torch.int64, device=pos.device), pos, right=True) - 1
            start = torch.tensor(starts, dtype=torch.int64, device=pos.device)[b]
            size = torch.tensor(sizes, dtype=torch.int64, device=pos.device)[b]
            base = torch.tensor(bases, dtype=torch.int64, device=pos.device)[b]
            rel = pos - start
            rank = torch.div(rel, size, rounding_mode="floor")
            return rank, base + rel - rank * size
        b = bisect.bisect_right(starts, positions) - 1
        rank, within = divmod(positions - starts[b], sizes[b])
        return rank, bases[b] + within

    def global_position(self, rank: int, local_offsets):
        """Inverse of :meth:`locate`: the global positions of ``rank``'s local offsets (an int or
        an integer tensor).

        Examples:
            >>> import torch, ragged as rg
            >>> plan = rg.make_plan({"a": torch.empty(8, 3), "b": torch.empty(4, 5)}, world_size=2, align=1,
            ...                     max_buffers=2)
            >>> plan.global_position(1, 1), plan.global_position(1, torch.tensor([0, 12, 21])).tolist()
            (13, [12, 34, 43])
        """
        starts, _, sizes, bases = _buffer_starts(self.buffers)
        if isinstance(local_offsets, torch.Tensor):
            loc = local_offsets.to(torch.int64)
            if len(self.buffers) == 1:
                return loc + rank * self.shard_size
            bases_t = torch.tensor(bases, dtype=torch.int64, device=loc.device)
            b = torch.searchsorted(bases_t, loc, right=True) - 1
            starts_t = torch.tensor(starts, dtype=torch.int64, device=loc.device)[b]
            sizes_t = torch.tensor(sizes, dtype=torch.int64, device=loc.device)[b]
            return starts_t + rank * sizes_t + loc - bases_t[b]
        b = bisect.bisect_right(bases, local_offsets) - 1
        return starts[b] + rank * sizes[b] + local_offsets - bases[b]

    # ---- per-rank queries ----------------------------------------------------------------
    def local_pieces(self, rank: int) -> tuple[LocalPiece, ...]:
        """The pieces of sharded leaves that ``rank`` holds, in shard (= buffer) order.

        Examples:
            >>> import torch, ragged as rg
            >>> plan = rg.make_plan({"w": torch.empty(6, 4)}, world_size=2, align=1)
            >>> [(p.start, p.stop, p.shape) for p in plan.local_pieces(1)]
            [(12, 24, (3, 4))]
        """
        ranges = self.shard_ranges(rank)
        offsets = _leaf_offsets(self.leaves)
        pieces = []
        for lo, hi, local in ranges:
            # leaves are in offset order: only the last non-empty leaf starting before lo can reach into it
            i = max(bisect.bisect_left(offsets, lo) - 1, 0)
            while i > 0 and self.leaves[i].numel == 0:
                i -= 1
            for leaf in self.leaves[i:]:
                if leaf.offset >= hi:
                    break
                start, stop = max(leaf.offset, lo), min(leaf.stop, hi)
                if start < stop:
                    pieces.append(
                        LocalPiece(leaf=leaf, start=start - leaf.offset, stop=stop - leaf.offset,
                                   local_offset=local + start - lo)
                    )
        return tuple(pieces)

    def occupancy(self) -> tuple[int, ...]:
        """Elements of real data (not padding) each rank holds (one pass over the leaves).

        Examples:
            >>> import torch, ragged as rg
            >>> rg.make_plan({"w": torch.empty(7, 4)}, world_size=3, align=1).occupancy()
            (12, 12, 4)
        """
        starts, find, sizes, _ = _buffer_starts(self.buffers)
        occ = [0] * self.world_size
        for leaf in self.leaves:
            if not leaf.numel:
                continue
            b = find(leaf.offset)
            S, base = sizes[b], starts[b]
            first, last = (leaf.offset - base) // S, (leaf.stop - 1 - base) // S
            if first == last:
                occ[first] += leaf.numel
                continue
            occ[first] += base + (first + 1) * S - leaf.offset
            for r in range(first + 1, last):
                occ[r] += S
            occ[last] += leaf.stop - base - last * S
        return tuple(occ)

    def owners(self, leaf: LeafLayout) -> tuple[int, ...]:
        """Ranks holding at least one element of ``leaf``."""
        if leaf.numel == 0:
            return ()
        starts, find, sizes, _ = _buffer_starts(self.buffers)
        b = find(leaf.offset)
        S, base = sizes[b], starts[b]
        return tuple(range((leaf.offset - base) // S, (leaf.stop - 1 - base) // S + 1))

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
        fields = (
            self.world_size,
            self.shard_size,
            str(self.dtype),
            self.align,
            self.strategy,
            [(l.path, l.index, l.shape, str(l.dtype), l.offset, l.granule, repr(l.granularity)) for l in self.leaves],
            [(l.path, l.index, l.shape, str(l.dtype), l.offset, repr(l.granularity)) for l in self.replicated],
            str(self.treedef),
        )
        if len(self.buffers) > 1:  # single-buffer fingerprints stay what they were
            fields = (*fields, self.buffers)
        text = repr(fields)
        return hashlib.sha256(text.encode()).hexdigest()

    # ---- display -------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (
            f"LayoutPlan(world_size={self.world_size}, shard_size={self.shard_size}, "
            f"leaves={len(self.leaves)}, replicated={len(self.replicated)}, dtype={self.dtype}, "
            f"padding={self.padding} ({self.overhead:.2%}), strategy={self.strategy!r}"
            + (f", buffers={len(self.buffers)})" if len(self.buffers) > 1 else ")")
        )

    def __rich__(self):
        return plan_summary(self)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        # Jupyter: show the rich summary (text/html + text/plain) as a cell's output.
        from rich.panel import Panel

        return Panel(plan_summary(self), expand=False)._repr_mimebundle_(include, exclude, **kwargs)


@functools.lru_cache(maxsize=1024)
def _buffer_starts(buffers: tuple[tuple[int, int], ...]):
    """``(starts, find, sizes, local bases)`` of a plan's buffers; ``find(offset)`` is the buffer
    index of a global offset (cached per buffers tuple: cheap to hash, shared by equal plans)."""
    starts = tuple(o for o, _ in buffers)
    sizes = tuple(max(s, 1) for _, s in buffers)
    bases = tuple(itertools.accumulate((s for _, s in buffers[:-1]), initial=0))
    return starts, functools.partial(_bisect_buffer, starts), sizes, bases


def _bisect_buffer(starts, offset: int) -> int:
    return max(bisect.bisect_right(starts, offset) - 1, 0)


@functools.lru_cache(maxsize=1024)
def _leaf_offsets(leaves: tuple) -> list[int]:
    return [leaf.offset for leaf in leaves]
