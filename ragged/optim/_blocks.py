"""Which elements SOAP and Shampoo precondition as blocks, where each block lies in a rank's shard,
and the batches the blocks are computed in.

[Note: each granule's tiles are the blocks]
A leaf planned with ``spec.Blocks(r, c)`` is cut by the planner only between bands of ``r`` rows
(a row is the last dimension; leading dimensions are flattened, as the planner does), so every
``r x c`` tile of a band lies whole on one rank. Each tile is one block, preconditioned on the
rank that holds it: no block ever needs another rank's elements, so the optimizers communicate
nothing. A leaf planned with ``spec.Rows(k)`` has ``k``-row bands but no block width: the
optimizer's ``block=(k, c)`` gives it one (tiles ``k x c``). Edge tiles follow the planner's
rule: the last tile of a band is ``C % c`` wide when ``c`` does not divide the row, the last band
of a 2-D leaf ``R % r`` tall. With ``precondition_1d`` (SOAP), a 1-D leaf planned with
``spec.Elements(n)`` has ``1 x n`` blocks (its granules; the last one may be shorter).

Everything else falls back to the optimizer's element-wise method (Adam; Shampoo's grafting
method), with the reason recorded per leaf (:func:`ragged.optim.preconditioned_leaves`): 0-d and
1-D leaves, replicated leaves, ``Elements`` leaves, ``Rows`` leaves without a block width, blocks
with a side over ``max_precondition_dim``, and leaves ``precondition_filter`` rejects. When the
optimizer is given ``block=(r, c)``, a leaf of two or more dimensions planned with other blocks is
refused at ``opt.init`` (before any update), naming the spec to plan it with.

[Note: blocks by part and ordinal]
A leaf's blocks form up to four *parts* of equal-shaped blocks: ``interior`` (``r x c``), ``right``
(the narrow last tile of each full band), ``bottom`` (the short last band's tiles) and ``corner``.
Within a part, blocks are numbered band-major (the *ordinal*). A rank holds whole bands, so its
blocks of a part are one run of ordinals, ``[first, first + local)``. The state of a part (each
block's statistics and eigenbases or roots) is stored in ordinal order, so a checkpoint can store
each part as one world-size-independent array and each rank's share as one chunk of it.

[Note: fixed slots, the same numbers at every world size]
Blocks of a part are computed in batches (one ``torch.linalg`` or ``matmul`` call per batch). A
batched call may round a block differently depending on how many blocks the batch holds and where
in it the block sits (measured with MKL on this CPU: ``bmm``, ``eigh`` and ``qr`` on ``5 x 7`` and
``33 x 31`` blocks change bits with the batch size and the slot). So the batches are fixed by the
leaf, not by the rank: batch ``j`` of a part holds ordinals ``[j K, j K + K)`` (``K`` from the
part's block size and count only; the last batch holds what is left), block ``o`` always sits in
slot ``o - j K``, and a rank computes every batch it holds a block of, with zeros in the slots of
blocks it does not hold. Each block then meets the same call, shape, slot and alignment (fresh
tensors) at every world size, and the results are bit-identical (tested at 1-4 ranks and HSDP
2 x 2). Zero slots are wasted work only where a rank boundary cuts a part.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch

from ragged._errors import LayoutError
from ragged.spec import Blocks, Elements, LayoutPlan, LeafLayout, Rows

__all__ = ["BlockRule", "Part", "LeafBlocks", "BlockLayout", "block_layout", "leaf_parts", "batches", "gather", "scatter"]

BATCH_BLOCKS = 64  # at most this many blocks per batch, about this many elements (one block at least) ...
BATCH_ELEMENTS = 1 << 18
BATCHES_PER_PART = 8  # ... a part in about this many batches: a rank boundary wastes at most one batch's zero slots ...
BATCH_MIN_ELEMENTS = 1 << 14  # ... but not so small that each call's own cost dominates (tiny blocks)
PARTS = ("interior", "right", "bottom", "corner")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRule:
    """The optimizer options that decide the blocks (hashable: a cache key)."""

    name: str
    block: tuple[int, int] | None
    max_dim: int
    precondition_1d: bool = False
    leaf_filter: Callable[[LeafLayout], bool] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """One part of one leaf's blocks on one rank (see [Note: blocks by part and ordinal]).

    The rank's blocks of the part are an ``(bands, tiles)`` grid of ``rows x cols`` tiles whose
    element ``(b, t, i, j)`` is at ``offset + b * rows * row_len + i * row_len + t * cols + j`` of
    the shard; ordinals ``first + b * tiles + t``.
    """

    path: str
    part: str
    rows: int
    cols: int
    count: int  # blocks of this part in the whole leaf
    first: int  # ordinal of this rank's first block
    bands: int
    tiles: int
    offset: int
    row_len: int

    @property
    def local(self) -> int:
        return self.bands * self.tiles

    @property
    def batch(self) -> int:
        """Blocks per batch: a function of the leaf's part only (never of the rank)."""
        size = self.rows * self.cols
        want = max(-(-self.count // BATCHES_PER_PART), -(-BATCH_MIN_ELEMENTS // size))
        return max(1, min(self.count, want, BATCH_BLOCKS, BATCH_ELEMENTS // size))


@dataclasses.dataclass(frozen=True, slots=True)
class LeafBlocks:
    """How the optimizer treats one leaf: ``block`` (rows, cols) when preconditioned, else the
    ``reason`` it falls back to the element-wise method. ``blocks``: blocks in the whole leaf."""

    path: str
    shape: tuple[int, ...]
    granularity: object
    block: tuple[int, int] | None
    blocks: int
    reason: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockLayout:
    """One rank's blocks of one DBuffer: every leaf's decision, and this rank's parts."""

    rule: BlockRule
    plan: LayoutPlan
    rank: int
    leaves: tuple[LeafBlocks, ...]
    parts: tuple[Part, ...]


def _spec_fix(leaf: LeafLayout, r: int, c: int) -> str:
    return (f"plan params{leaf.path} with spec.Blocks({r}, {c}) (make_plan specs, or make_units(specs=...)), "
            "or leave it to the fallback with precondition_filter")


def _refuse(rule: BlockRule, leaf: LeafLayout, why: str) -> None:
    r, c = rule.block
    raise LayoutError(
        f"{rule.name}(block=({r}, {c})): params{leaf.path} (shape {leaf.shape}) is planned with "
        f"{leaf.granularity!r}, {why}, so its granules are not {r} x {c} blocks. Fix: {_spec_fix(leaf, r, c)}.",
        path=leaf.path, shape=leaf.shape)


def _block_of(rule: BlockRule, leaf: LeafLayout, replicated: bool) -> tuple[tuple[int, int] | None, str | None]:
    """``(block, None)`` for a preconditioned leaf, ``(None, reason)`` for a fallback one; raises
    for a leaf planned with other blocks than ``rule.block`` (see [Note: each granule's tiles are
    the blocks])."""
    g, ndim = leaf.granularity, len(leaf.shape)
    if not leaf.numel:
        return None, "empty"
    if rule.leaf_filter is not None and not rule.leaf_filter(leaf):
        return None, "precondition_filter excludes it"
    if replicated:
        return None, "replicated (spec.Replicate()): shard it with spec.Blocks(r, c) to precondition it"
    if ndim < 2:
        if ndim == 1 and rule.precondition_1d and isinstance(g, Elements) and g.n > 1:
            return _within_max(rule, (1, min(g.n, leaf.numel)))
        hint = (" (precondition_1d: plan it with spec.Elements(n), n > 1)" if rule.precondition_1d and ndim == 1
                else "")
        return None, f"not a matrix ({ndim}-D){hint}"
    if rule.block is not None:
        r, c = rule.block
        if isinstance(g, Blocks) and (g.r, g.c) != (r, c):
            _refuse(rule, leaf, f"whose tiles are {g.r} x {g.c}")
        if isinstance(g, Rows) and g.n != r:
            _refuse(rule, leaf, f"whose bands are {g.n} rows, not {r}")
        if isinstance(g, Elements):
            _refuse(rule, leaf, "which may cut a row anywhere")
    if isinstance(g, Blocks):
        r, c = g.r, g.c
    elif isinstance(g, Rows) and rule.block is not None:
        r, c = rule.block
    elif isinstance(g, Rows):
        return None, f"Rows({g.n}) has no block width: give the optimizer block=({g.n}, c), or plan it with spec.Blocks(r, c)"
    else:
        return None, f"{g!r} granules are not matrix blocks: plan it with spec.Blocks(r, c)"
    rows = leaf.numel // leaf.shape[-1]
    return _within_max(rule, (min(r, rows), min(c, leaf.shape[-1])))


def _within_max(rule: BlockRule, block: tuple[int, int]):
    if max(block) > rule.max_dim:
        return None, f"its {block[0]} x {block[1]} blocks exceed max_precondition_dim={rule.max_dim}"
    return block, None


def _count(leaf: LeafLayout, block: tuple[int, int]) -> int:
    """Blocks in the whole leaf."""
    r, c = block
    if len(leaf.shape) == 1:
        return -(-leaf.numel // c)
    rows, cols = leaf.numel // leaf.shape[-1], leaf.shape[-1]
    return -(-rows // max(r, 1)) * -(-cols // max(c, 1))


def _parts_2d(leaf: LeafLayout, block, start: int, stop: int, local_offset: int, rank: int) -> list[Part]:
    """This rank's parts of a matrix leaf whose rows ``[start // C, stop // C)`` it holds."""
    r, c = block
    C = leaf.shape[-1]
    R = leaf.numel // C
    if start % (r * C):
        raise LayoutError(f"params{leaf.path} (shape {leaf.shape}): rank {rank}'s piece starts at row {start // C}, "
                          f"inside a band of {r} rows.", path=leaf.path, shape=leaf.shape)
    full_bands, edge_rows = R // r, R % r
    full_tiles, edge_cols = C // c, C % c
    b0, row1 = start // (r * C), stop // C
    held_full = max(0, min(-(-row1 // r), full_bands) - b0)
    holds_edge = edge_rows and row1 == R
    edge_at = local_offset + (full_bands - b0) * r * C
    out = []
    if held_full and full_tiles:
        out.append(Part(leaf.path, "interior", r, c, full_bands * full_tiles, b0 * full_tiles, held_full, full_tiles,
                        local_offset, C))
    if held_full and edge_cols:
        out.append(Part(leaf.path, "right", r, edge_cols, full_bands, b0, held_full, 1, local_offset + full_tiles * c, C))
    if holds_edge and full_tiles:
        out.append(Part(leaf.path, "bottom", edge_rows, c, full_tiles, 0, 1, full_tiles, edge_at, C))
    if holds_edge and edge_cols:
        out.append(Part(leaf.path, "corner", edge_rows, edge_cols, 1, 0, 1, 1, edge_at + full_tiles * c, C))
    return out


def _parts_1d(leaf: LeafLayout, n: int, start: int, stop: int, local_offset: int) -> list[Part]:
    """This rank's ``1 x n`` blocks of a 1-D leaf whose elements ``[start, stop)`` it holds."""
    full, edge = leaf.numel // n, leaf.numel % n
    held = max(0, min(-(-stop // n), full) - start // n)
    out = []
    if held:
        out.append(Part(leaf.path, "interior", 1, n, full, start // n, held, 1, local_offset, n))
    if edge and stop == leaf.numel:
        out.append(Part(leaf.path, "right", 1, edge, 1, 0, 1, 1, local_offset + (full - start // n) * n, n))
    return out


@functools.lru_cache(maxsize=64)
def block_layout(rule: BlockRule, plan: LayoutPlan, rank: int) -> BlockLayout:
    """The :class:`BlockLayout` of ``rank``'s shard of ``plan`` under ``rule`` (cached).

    Raises:
        LayoutError: a leaf planned with other blocks than ``rule.block``; a plan that cuts
            blocks at rank boundaries (``strategy="naive"``).
    """
    if plan.split_blocks:
        raise LayoutError(
            f"{rule.name} needs whole blocks on every rank, but this plan (strategy={plan.strategy!r}) cuts "
            f"{plan.split_blocks} granule(s) at rank boundaries. Fix: plan with strategy='dp' (the default) or 'exact'.")
    leaves, blocks = [], {}
    for leaf in plan.leaves + plan.replicated:
        block, reason = _block_of(rule, leaf, leaf in plan.replicated)
        if block is not None:
            blocks[leaf.path] = block
        leaves.append(LeafBlocks(leaf.path, leaf.shape, leaf.granularity, block,
                                 _count(leaf, block) if block else 0, reason))
    parts = []
    for piece in plan.local_pieces(rank) if rank < plan.world_size else ():
        block = blocks.get(piece.leaf.path)
        if block is None:
            continue
        if len(piece.leaf.shape) == 1:
            parts += _parts_1d(piece.leaf, block[1], piece.start, piece.stop, piece.local_offset)
        else:
            parts += _parts_2d(piece.leaf, block, piece.start, piece.stop, piece.local_offset, rank)
    return BlockLayout(rule, plan, rank, tuple(leaves), tuple(parts))


def leaf_parts(leaf: LeafBlocks) -> tuple[tuple[str, int, int, int], ...]:
    """``(part, rows, cols, count)`` of every part of a preconditioned leaf, in the whole leaf
    (every rank's parts of the leaf have these shapes; see [Note: blocks by part and ordinal])."""
    r, c = leaf.block
    if len(leaf.shape) == 1:
        n = leaf.shape[0]
        parts = (("interior", 1, c, n // c), ("right", 1, n % c, 1 if n % c else 0))
    else:
        cols = leaf.shape[-1]
        rows = math.prod(leaf.shape) // cols
        fb, er, ft, ec = rows // r, rows % r, cols // c, cols % c
        parts = (("interior", r, c, fb * ft), ("right", r, ec, fb if ec else 0), ("bottom", er, c, ft if er else 0),
                 ("corner", er, ec, 1 if er and ec else 0))
    return tuple(p for p in parts if p[3])


def batches(p: Part):
    """``(n, lo, hi, slot)`` per batch holding a block of ``p`` on this rank (see [Note: fixed
    slots, the same numbers at every world size]): the batch has ``n`` slots, this rank's blocks
    ``[lo, hi)`` (local indices) sit in slots ``[slot, slot + hi - lo)``."""
    k = p.batch
    end = p.first + p.local
    for j in range(p.first // k, (end - 1) // k + 1):
        a, b = max(p.first, j * k), min(end, j * k + k)
        yield min(k, p.count - j * k), a - p.first, b - p.first, a - j * k


def _view(data: torch.Tensor, p: Part) -> torch.Tensor:
    """The ``(bands, tiles, rows, cols)`` strided view of ``p``'s blocks in ``data`` (a 1-D shard)."""
    C = p.row_len
    return data.as_strided((p.bands, p.tiles, p.rows, p.cols), (p.rows * C, p.cols, C, 1),
                           data.storage_offset() + p.offset)


def gather(data: torch.Tensor, p: Part, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``p``'s blocks of ``data`` as a new contiguous ``(local, rows, cols)`` tensor, in ordinal order."""
    out = torch.empty((p.local, p.rows, p.cols), dtype=dtype or data.dtype, device=data.device)
    out.view(p.bands, p.tiles, p.rows, p.cols).copy_(_view(data, p))
    return out


def scatter(data: torch.Tensor, p: Part, blocks: torch.Tensor) -> None:
    """Writes ``blocks`` (``(local, rows, cols)``, ordinal order) into ``p``'s elements of ``data``."""
    _view(data, p).copy_(blocks.view(p.bands, p.tiles, p.rows, p.cols))
