"""Where each rank's codes, scales and unquantized values sit in the bytes one quantized
collective moves: a pure function of the plan, so every rank knows every other rank's layout
without asking.

[Note: one chunk of bytes per rank]
A quantized collective moves ``m`` chunks of ``B`` bytes each (the all-gather: every rank's
chunk to everyone; the reduce-scatter: an all-to-all of one chunk per destination). A rank's
chunk holds what it owns of the unit, piece by piece (its ``plan.local_pieces``): a quantized
piece as one code byte per element plus its blocks' scales (float32, or one e8m0 exponent byte
for mxfp8), any other piece (a vector, a leaf whose format is ``None``) as its values in the
collective's dtype. Items are grouped by size, widest first (8-, 4-, 2-, then 1-byte items, each
group in shard order), so every typed view of the chunk is aligned with no padding between
groups. Ranks own different mixes (one holds the norms, another only codes), so chunks differ
in length: ``B`` is the longest, rounded up to 8 bytes, and shorter chunks end in unused bytes.
Bytes because a backend may not carry a code dtype (gloo refuses ``float8_e4m3fn`` in its
collectives: "Invalid scalar type"; every backend carries ``uint8``).

[Note: which granules hold whole blocks]
A rank boundary inside a leaf falls on a multiple of the leaf's granule (counted from the leaf's
first element), so a rank's piece is a run of whole blocks (see [Note: a run of whole blocks] in
``_codec.py``) for every world size exactly when the granule is a multiple of the format's
*run unit*: ``r * cols`` elements (``r`` whole rows) for ``r x c`` blocks with ``r > 1``, ``c``
elements for ``1 x c`` blocks (``c`` dividing the row). So ``spec.Blocks(R, C)`` fits ``r x c``
blocks when ``r`` divides ``R``; ``spec.Rows(k)`` when ``r`` divides ``k``; ``spec.Elements(n)``
when the unit divides ``n``. The rule depends on the granule only, never on the world size: a
setting that works at 2 ranks works at 10,240.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch

from ragged._errors import LayoutError, RaggedTypeError
from ragged.quant._codec import check_shape
from ragged.quant._format import Format
from ragged.spec._leaf import LeafLayout
from ragged.spec._plan import LayoutPlan

__all__ = ["leaf_formats", "run_unit", "Segment", "WireLayout", "wire_layout"]

ALIGN = 8  # the widest item: every chunk starts 8-byte aligned


def run_unit(fmt: Format, cols: int) -> int:
    """Elements of the smallest run of whole blocks that can start a rank's piece (see [Note:
    which granules hold whole blocks])."""
    r, c = fmt.block
    return c if r == 1 else r * cols


def _cols(leaf) -> int:
    return leaf.shape[-1] if leaf.shape else 1


def _spec_to_plan_with(fmt: Format, leaf) -> str:
    r, c = fmt.block
    if r > 1:
        return f"spec.Blocks({r}, {c})"
    return "spec.Rows(1)" if len(leaf.shape) >= 2 else f"spec.Elements({c})"


def _check_fits(plan: LayoutPlan, leaf: LeafLayout, fmt: Format, where: str) -> None:
    check_shape(leaf.shape, fmt, path=f"{where}: params{leaf.path}")
    if leaf in plan.replicated:
        return
    unit = run_unit(fmt, _cols(leaf))
    if leaf.granule % unit or plan.split_blocks:
        why = ("the plan splits granules between ranks (strategy='naive')" if plan.split_blocks else
               f"its granule of {leaf.granule} elements is not a multiple of {unit} (one run of whole {fmt!r} blocks)")
        raise LayoutError(
            f"{where}: params{leaf.path} of shape {leaf.shape} is planned with {leaf.granularity!r}, so a rank boundary "
            f"can cut a {fmt!r} block: {why}. Each rank quantizes the blocks it owns, so a rank must hold whole blocks. "
            f"Fix: plan with `{_spec_to_plan_with(fmt, leaf)}` for this leaf (specs=...), or leave it unquantized.",
            path=leaf.path, shape=leaf.shape,
        )


def leaf_formats(plan: LayoutPlan, choose, *, where: str = "gather_format", replicated: bool = True
                 ) -> tuple[Format | None, ...]:
    """The format of every leaf of ``plan`` (by ``leaf.index``), checked before any
    communication (the same on every rank: a pure function of the plan).

    Args:
        plan: the layout.
        choose: ``None`` (nothing quantized), a :class:`Format` (every leaf of two or more
            dimensions; vectors and scalars travel unquantized) or a callable
            ``LeafLayout -> Format | None`` (per leaf, e.g. by ``leaf.path``).
        where: the option's name, for error messages.
        replicated: whether replicated leaves may be quantized (a reduce-scatter all-reduces
            them exactly: ``False``).

    Raises:
        LayoutError: a chosen format does not tile the leaf's shape, or the leaf's granule
            does not hold whole blocks (see [Note: which granules hold whole blocks]).
        RaggedTypeError: the callable returned something other than a format or None.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> params = {"w": torch.empty(64, 32), "b": torch.empty(32)}
        >>> plan = rg.make_plan(params, {"w": spec.Blocks(32, 32), "b": None}, world_size=2)
        >>> from ragged.quant._wire import leaf_formats
        >>> leaf_formats(plan, rg.quant.fp8(block=(32, 32)))          # by leaf.index: b, then w
        (None, fp8(block=(32, 32)))
        >>> leaf_formats(rg.make_plan(params, world_size=2), rg.quant.fp8(block=(32, 32)))
        Traceback (most recent call last):
        ...
        ragged._errors.LayoutError: gather_format: params['w'] of shape (64, 32) is planned with Rows(n=1), so a rank boundary can cut a fp8(block=(32, 32)) block: ... Fix: plan with `spec.Blocks(32, 32)` for this leaf (specs=...), or leave it unquantized.
    """
    leaves = sorted(plan.leaves + plan.replicated, key=lambda l: l.index)
    if choose is None:
        return (None,) * len(leaves)
    skip = set() if replicated else {leaf.index for leaf in plan.replicated}
    if isinstance(choose, Format):
        picked = [choose if len(leaf.shape) >= 2 and leaf.index not in skip else None for leaf in leaves]
    elif callable(choose):
        picked = [None if leaf.index in skip else choose(leaf) for leaf in leaves]
        for leaf, fmt in zip(leaves, picked):
            if fmt is not None and not isinstance(fmt, Format):
                raise RaggedTypeError(f"{where}({leaf.path}) returned {fmt!r}; it must return a rg.quant format or None.")
    else:
        raise RaggedTypeError(
            f"{where} must be None, a rg.quant format or a callable leaf -> format | None, got {type(choose).__name__}."
        )
    for leaf, fmt in zip(leaves, picked):
        if fmt is not None:
            _check_fits(plan, leaf, fmt, where)
    return tuple(picked)


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """One rank's piece of one leaf in its chunk (see [Note: one chunk of bytes per rank]).

    Attributes:
        leaf: the leaf's layout.
        start, stop: the piece's elements of the leaf.
        local_offset: where the piece starts in the rank's shard.
        fmt: its format, or None (travels as values of ``dtype``).
        dtype: the dtype its values travel in when unquantized (the leaf's compute dtype).
        data: byte offset of its codes (or values) in the chunk.
        scales: byte offset of its scales (quantized pieces), else -1.
    """

    leaf: LeafLayout
    start: int
    stop: int
    local_offset: int
    fmt: Format | None
    dtype: torch.dtype
    data: int
    scales: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def cols(self) -> int:
        return _cols(self.leaf)

    @property
    def global_offset(self) -> int:
        return self.leaf.offset + self.start


def _items(n: int, fmt: Format | None, itemsize: int) -> tuple[tuple[int, int], ...]:
    """``((item size, bytes), ...)`` a piece of ``n`` elements puts in a chunk."""
    if fmt is None:
        return ((itemsize, n * itemsize),)
    return ((1, n), (fmt.scale_nbytes, n // fmt.block_numel * fmt.scale_nbytes))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class WireLayout:
    """The chunks of one quantized collective over ``plan`` (see [Note: one chunk of bytes per
    rank]); build with :func:`wire_layout` (cached).

    Attributes:
        plan: the layout.
        formats: every leaf's format by ``leaf.index`` (from :func:`leaf_formats`).
        dtypes: every leaf's compute dtype by ``leaf.index`` (what its values travel in when
            unquantized).
        chunk_nbytes: ``B``, the bytes of every rank's chunk.
    """

    plan: LayoutPlan
    formats: tuple
    dtypes: tuple
    chunk_nbytes: int

    @property
    def nbytes(self) -> int:
        """Bytes of the whole collective: ``m * B``."""
        return self.plan.world_size * self.chunk_nbytes

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """``rank``'s pieces in its chunk, in shard order."""
        return _segments(self, rank)


def _segments_uncached(wire: WireLayout, rank: int) -> tuple[Segment, ...]:
    pieces = wire.plan.local_pieces(rank)
    sizes: dict[int, int] = {}
    for p in pieces:
        for size, nbytes in _items(p.numel, wire.formats[p.leaf.index], wire.dtypes[p.leaf.index].itemsize):
            sizes[size] = sizes.get(size, 0) + nbytes
    cursor, pos = {}, 0
    for size in sorted(sizes, reverse=True):
        cursor[size], pos = pos, pos + sizes[size]
    out = []
    for p in pieces:
        fmt, dtype = wire.formats[p.leaf.index], wire.dtypes[p.leaf.index]
        (dsize, dbytes), *rest = _items(p.numel, fmt, dtype.itemsize)
        data, cursor[dsize] = cursor[dsize], cursor[dsize] + dbytes
        scales = -1
        if rest:
            (ssize, sbytes), = rest
            scales, cursor[ssize] = cursor[ssize], cursor[ssize] + sbytes
        out.append(Segment(leaf=p.leaf, start=p.start, stop=p.stop, local_offset=p.local_offset, fmt=fmt,
                           dtype=dtype, data=data, scales=scales))
    return tuple(out)


_segments = functools.lru_cache(maxsize=4096)(_segments_uncached)


def _chunk_bytes(plan: LayoutPlan, formats: tuple, dtypes: tuple) -> int:
    """The longest chunk over all ranks, by arithmetic on the buffers (no per-rank walk): every
    rank strictly inside a leaf holds ``S_b`` of its elements."""
    m = plan.world_size
    total = np.zeros(m + 1, dtype=np.int64)  # a difference array over ranks for the middle ranks

    def cost(n, leaf):
        return sum(b for _, b in _items(n, formats[leaf.index], dtypes[leaf.index].itemsize))

    starts = [o for o, _ in plan.buffers]
    for leaf in plan.leaves:
        if not leaf.numel:
            continue
        b = plan.buffer_index(leaf.offset)
        base, size = starts[b], plan.buffers[b][1]
        first, last = (leaf.offset - base) // size, (leaf.stop - 1 - base) // size
        if first == last:
            total[first] += cost(leaf.numel, leaf)
            total[first + 1] -= cost(leaf.numel, leaf)
            continue
        head = base + (first + 1) * size - leaf.offset
        tail = leaf.stop - base - last * size
        for rank, n in ((first, head), (last, tail)):
            total[rank] += cost(n, leaf)
            total[rank + 1] -= cost(n, leaf)
        if last > first + 1:
            total[first + 1] += cost(size, leaf)
            total[last] -= cost(size, leaf)
    longest = int(np.cumsum(total)[:m].max()) if m else 0
    return max(-(-longest // ALIGN) * ALIGN, ALIGN)


def wire_layout(plan: LayoutPlan, formats: tuple, dtype) -> WireLayout:
    """The :class:`WireLayout` of ``plan`` with ``formats`` (by leaf index) and unquantized
    pieces in ``dtype``: one dtype, or one per leaf index (cached: plans and formats are
    hashable).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> from ragged.quant._wire import leaf_formats, wire_layout
        >>> params = {"w": torch.empty(64, 32), "b": torch.empty(32)}
        >>> plan = rg.make_plan(params, {"w": spec.Blocks(32, 32), "b": None}, world_size=2)
        >>> wire = wire_layout(plan, leaf_formats(plan, rg.quant.fp8(block=(32, 32))), torch.bfloat16)
        >>> wire.chunk_nbytes      # rank 0's: b's 32 bf16 values, w's first 32 x 32 codes and 1 scale, rounded up
        1096
        >>> [(s.leaf.path, s.fmt, s.data, s.scales) for s in wire.segments(0)]   # fp32 scales, bf16, then codes
        [("['b']", None, 4, -1), ("['w']", fp8(block=(32, 32)), 68, 0)]
    """
    dtypes = (dtype,) * len(formats) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if len(dtypes) != len(formats) or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise RaggedTypeError(f"wire_layout: dtype must be a torch.dtype or one per leaf, got {dtype!r}.")
    return _wire_layout(plan, formats, dtypes)


@functools.lru_cache(maxsize=1024)
def _wire_layout(plan: LayoutPlan, formats: tuple, dtypes: tuple) -> WireLayout:
    return WireLayout(plan=plan, formats=formats, dtypes=dtypes, chunk_nbytes=_chunk_bytes(plan, formats, dtypes))


@functools.lru_cache(maxsize=1024)
def gaps(plan: LayoutPlan) -> tuple[tuple[int, int], ...]:
    """``(lo, hi)`` ranges of the gathered buffer that no leaf covers (padding)."""
    out, pos = [], 0
    for leaf in sorted(plan.leaves, key=lambda l: l.offset):
        if leaf.offset > pos:
            out.append((pos, leaf.offset))
        pos = max(pos, leaf.stop)
    if plan.buffer_numel > pos:
        out.append((pos, plan.buffer_numel))
    return tuple(out)


Choice = Format | None | Callable[[LeafLayout], Format | None]
