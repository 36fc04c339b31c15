"""Granularities: the unit a leaf may be cut at, and `Replicate`.

A granularity is a frozen, hashable value and a pytree *leaf*, so a spec tree can be a
prefix of the parameter tree. Each one answers a single question: for a leaf of a given
shape, how many consecutive elements form one granule (the smallest piece a rank
boundary may not cut)?

[Note: rows and blocks]
A *row* is the last dimension; leading dimensions are flattened, so a ``(E, R, C)`` expert
tensor has ``E * R`` rows of ``C`` elements. A 1-D tensor has one element per row and a
0-d tensor is a single element. ``Blocks(r, c)`` tiles the last two dimensions with
``r x c`` tiles; cutting only at multiples of ``r`` rows keeps every tile on one rank.
Edge tiles: when ``C % c != 0`` the last tile of each row band is narrower, and when
``R % r != 0`` (2-D only) the last band is shorter; both stay whole because they sit at
the end of a band / tensor. For 3-D and higher tensors the bands of consecutive matrices
must line up, so ``R % r == 0`` is required there (otherwise a clear error says how to fix it).
"""

from __future__ import annotations

import dataclasses
import math

from ragged._errors import LayoutError, RaggedTypeError, check_int

__all__ = ["Granularity", "Elements", "Rows", "Blocks", "Replicate", "granule_of"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=False)
class Elements:
    """Cut anywhere that is a multiple of ``n`` elements (``n=1``: DeepSpeed/FSDP1 style).

    ``Elements(256)`` keeps 1-D quantization blocks of 256 elements whole.

    Examples:
        >>> from ragged import spec
        >>> spec.Elements(256)
        Elements(n=256)
        >>> spec.Elements(4) == spec.Elements(4), hash(spec.Elements(4)) == hash(spec.Elements(4))
        (True, True)
    """

    n: int = 1

    def __post_init__(self):
        check_int("Elements.n", self.n)

    replace = dataclasses.replace


@dataclasses.dataclass(frozen=True, slots=True)
class Rows:
    """Cut only between groups of ``n`` rows (a row is the last dimension).

    Examples:
        >>> from ragged import spec
        >>> spec.Rows(16)
        Rows(n=16)
    """

    n: int = 1

    def __post_init__(self):
        check_int("Rows.n", self.n)

    replace = dataclasses.replace


@dataclasses.dataclass(frozen=True, slots=True)
class Blocks:
    """``r x c`` tiles over the last two dimensions; ranks hold whole tiles.

    Sharding happens at ``r``-row granularity; ``c`` is recorded for block-wise consumers
    (quantization, optimizers) and does not change the layout.

    Examples:
        >>> from ragged import spec
        >>> spec.Blocks(128, 128)
        Blocks(r=128, c=128)
    """

    r: int
    c: int

    def __post_init__(self):
        check_int("Blocks.r", self.r)
        check_int("Blocks.c", self.c)

    replace = dataclasses.replace


@dataclasses.dataclass(frozen=True, slots=True)
class Replicate:
    """Keep the whole leaf on every rank (outside the sharded buffer; gradients all-reduce).

    Examples:
        >>> from ragged import spec
        >>> spec.Replicate()
        Replicate()
    """

    replace = dataclasses.replace


Granularity = Elements | Rows | Blocks | Replicate
GRANULARITY_TYPES = (Elements, Rows, Blocks, Replicate)


def granule_of(granularity: Granularity, shape: tuple[int, ...], *, path: str = "<leaf>") -> int:
    """Returns the granule, in elements, of a leaf of ``shape`` under ``granularity``.

    Args:
        granularity: an ``Elements``, ``Rows`` or ``Blocks`` value.
        shape: the leaf's full shape.
        path: the leaf's key path, used in error messages.

    Raises:
        LayoutError: when the granularity cannot describe this shape (e.g. ``Blocks`` on a
            1-D leaf).

    Examples:
        >>> from ragged import spec
        >>> spec.granule_of(spec.Rows(2), (6, 5)), spec.granule_of(spec.Rows(2), (7,))
        (10, 2)
        >>> spec.granule_of(spec.Blocks(32, 32), (4, 64, 100))
        3200
    """
    shape = tuple(int(d) for d in shape)
    if isinstance(granularity, Elements):
        return granularity.n
    if len(shape) == 0:
        return 1
    row = shape[-1] if len(shape) >= 2 else 1
    if isinstance(granularity, Rows):
        return max(granularity.n * row, 1)
    if isinstance(granularity, Blocks):
        if len(shape) < 2:
            raise LayoutError(
                f"specs{path} is {granularity!r} but params{path} has shape {shape}: "
                "Blocks(r, c) tiles the last two dimensions, so the leaf must be at least 2-D. "
                f"Fix: use spec.Elements({granularity.r * granularity.c}) for 1-D blocks, or "
                "spec.Rows(1).",
                path=path,
                shape=shape,
            )
        if len(shape) >= 3 and shape[-2] % granularity.r != 0 and math.prod(shape[:-2]) > 1:
            raise LayoutError(
                f"specs{path} is {granularity!r} but params{path} has shape {shape}: with more "
                f"than one matrix the row bands of consecutive matrices must line up, so "
                f"shape[-2] = {shape[-2]} must be a multiple of r = {granularity.r}. "
                f"Fix: choose r dividing {shape[-2]}, or shard whole matrices with "
                f"spec.Rows({shape[-2]}).",
                path=path,
                shape=shape,
            )
        return max(granularity.r * row, 1)
    raise RaggedTypeError(f"granule_of got {granularity!r}, which is not a granularity.")
