"""Flat element ranges of an N-D tensor as N-D boxes, and back.

[Note: a flat range as boxes]
In a RaggedShard plan a rank's piece of a leaf is one contiguous range ``[start, stop)`` of the
flattened (row-major) tensor; FSDP2 / DTensor checkpoints describe a tensor by N-D chunks
(``Shard(0)``: blocks of rows). DCP computes the overlap of N-D boxes, so a flat range is
written, and read, as the few boxes that tile it: a partial innermost run up to the next row
boundary, the rows (or planes) it covers whole, and a partial run at the end, recursively per
dimension. Each box is itself a contiguous sub-range of ``[start, stop)`` (its leading sizes
are 1 up to one dimension, its trailing sizes are the whole dimensions), in range order, so
its data is a plain slice of the rank's flat shard viewed as the box's shape: no copy, no
temporary. At most ``2 * ndim - 1`` boxes per range.
"""

from __future__ import annotations

import math

from ragged._errors import RaggedValueError

__all__ = ["Box", "boxes", "box_range"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes that tile elements ``[start, stop)`` of a row-major tensor of ``shape``, in
    range order (see [Note: a flat range as boxes]); none for an empty range.

    A 0-d tensor (``shape == ()``) has one element: ``[0, 1)`` is the box ``((), ())``.

    Examples:
        >>> boxes((4, 3), 2, 10)      # the end of row 0, rows 1 and 2 whole, the start of row 3
        [((0, 2), (1, 1)), ((1, 0), (2, 3)), ((3, 0), (1, 1))]
        >>> boxes((2, 2, 3), 0, 12)
        [((0, 0, 0), (2, 2, 3))]
        >>> boxes((), 0, 1), boxes((5,), 3, 3)
        ([((), ())], [])
    """
    shape = tuple(int(d) for d in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise RaggedValueError(f"[{start}, {stop}) is not a range of a tensor of shape {shape} ({total} elements)")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = total // shape[0] if shape[0] else 0
    rest = shape[1:]
    out: list[Box] = []
    row, lo = divmod(start, inner)
    if lo:  # the partial first row
        hi = min(stop - row * inner, inner)
        out += [((row, *o), (1, *s)) for o, s in boxes(rest, lo, hi)]
        row += 1
    end, tail = divmod(stop, inner)
    if end > row:  # whole rows
        out.append(((row, *(0,) * len(rest)), (end - row, *rest)))
    if tail and end >= row:  # the partial last row
        out += [((end, *o), (1, *s)) for o, s in boxes(rest, 0, tail)]
    return out


def box_range(shape: tuple[int, ...], box: Box) -> tuple[int, int]:
    """``[start, stop)`` of a box that is contiguous in the row-major order of ``shape`` (as
    :func:`boxes` makes them); raises RaggedValueError (a ValueError) for a box that is not.

    Examples:
        >>> box_range((4, 3), ((1, 0), (2, 3)))
        (3, 9)
        >>> box_range((4, 3), ((0, 0), (2, 2)))
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedValueError: box ((0, 0), (2, 2)) of shape (4, 3) is not one contiguous range
    """
    offsets, sizes = box
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise RaggedValueError(f"box {box} does not have the {len(shape)} dimensions of shape {shape}")
    if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
        raise RaggedValueError(f"box {box} lies outside shape {shape}")
    lead = next((i for i, s in enumerate(sizes) if s != 1), len(sizes))
    if any(s != d for s, d in zip(sizes[lead + 1 :], shape[lead + 1 :])) or any(o for o in offsets[lead + 1 :]):
        raise RaggedValueError(f"box {box} of shape {shape} is not one contiguous range")
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    start = sum(o * st for o, st in zip(offsets, strides))
    return start, start + math.prod(sizes)
