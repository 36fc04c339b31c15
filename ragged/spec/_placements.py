"""Placements over an N-D mesh: ``Shard(dim)`` on the TP / EP axes, a granularity on the FSDP
axis, and the spec trees that give each leaf its placements.

A leaf of a model trained with FSDP x TP (or x EP) has one placement per mesh axis: a
granularity (``Rows(n)``, ``Blocks(r, c)``, ``Elements(n)``, ``Replicate()``) on the FSDP axis,
and ``Shard(dim)`` or ``Replicate()`` on every other axis. For example a column-parallel weight
is ``{"dp": Rows(1), "tp": Shard(0)}``, a row-parallel one ``{"dp": Rows(1), "tp": Shard(1)}``
and stacked experts ``{"dp": Blocks(32, 32), "ep": Shard(0)}``.

[Note: strided placements]
``Shard(dim, groups=g)`` treats ``dim`` as ``g`` equal consecutive segments (e.g. the Q, K and
V row blocks of a fused QKV weight) and gives each rank its chunk *of every segment*,
concatenated. Several axes sharding the same dim apply in mesh order (first axis outermost, as
DTensor does). What one position of the non-FSDP axes holds of a leaf is its *part* (see the
glossary in docs/design.md); the FSDP RaggedShard then cuts the part, so a rank's FSDP piece is a
strided set of global elements: :func:`ragged.parallel.part_index` keeps that bookkeeping (the
paper's StridedRaggedShard), and ``ragged.parallel`` uses it to reassemble global tensors and
to convert to a global layout for checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ragged._errors import RaggedKeyError, RaggedTypeError, RaggedValueError, check_int
from ragged._pytree import keystr
from ragged.spec._granularity import GRANULARITY_TYPES
from ragged.spec._mesh import Mesh
from ragged.spec._spec_tree import broadcast_specs

__all__ = ["Shard", "Placements", "PlacementValue", "placement_leaves"]


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """Even split of dimension ``dim`` over one mesh axis (TP / EP), as DTensor's ``Shard``.

    Attributes:
        dim: the dimension to split (negative counts from the end).
        groups: ``dim`` is ``groups`` equal consecutive segments (a fused QKV weight has 3);
            each rank holds its chunk of every segment (see [Note: strided placements]).

    Examples:
        >>> from ragged import spec
        >>> spec.Shard(0), spec.Shard(0) == spec.Shard(0, groups=1), spec.Shard(0, groups=3)
        (Shard(dim=0, groups=1), True, Shard(dim=0, groups=3))
    """

    dim: int
    groups: int = 1

    def __post_init__(self):
        check_int("Shard.dim", self.dim, low=None)
        check_int("Shard.groups", self.groups)

    replace = dataclasses.replace


PlacementValue = Any  # a granularity (FSDP axis) or Shard / Replicate (other axes)
_PLACEMENT_TYPES = (Shard, *GRANULARITY_TYPES)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Placements:
    """One leaf's placement on each named mesh axis (a pytree *leaf*, hashable).

    Axes not named are ``Replicate()`` (the FSDP axis defaults to ``Rows(1)``). A plain dict
    whose keys are mesh axis names is accepted in a spec tree too and converted to this.

    Examples:
        >>> from ragged import spec
        >>> p = spec.Placements(dp=spec.Rows(1), tp=spec.Shard(0))
        >>> p == spec.Placements({"tp": spec.Shard(0), "dp": spec.Rows(1)}), p["tp"]
        (True, Shard(dim=0, groups=1))
    """

    axes: tuple[tuple[str, PlacementValue], ...]

    def __init__(self, mapping: Mapping[str, PlacementValue] | None = None, /, **kwargs):
        items = dict(mapping or {})
        overlap = set(items) & set(kwargs)
        if overlap:
            raise RaggedValueError(f"Placements got axes {sorted(overlap)} twice.")
        items.update(kwargs)
        for axis, p in items.items():
            if not isinstance(axis, str):
                raise RaggedTypeError(f"Placements keys are mesh axis names (str), got {axis!r}.")
            if not isinstance(p, _PLACEMENT_TYPES):
                raise RaggedTypeError(
                    f"Placements[{axis!r}] is {p!r} of type {type(p).__name__}; a placement is spec.Shard(dim), "
                    "spec.Replicate(), or (on the FSDP axis) spec.Rows(n) / spec.Blocks(r, c) / spec.Elements(n)."
                )
        object.__setattr__(self, "axes", tuple(sorted(items.items())))

    def __getitem__(self, axis: str):
        try:
            return dict(self.axes)[axis]
        except KeyError:
            raise RaggedKeyError(axis) from None

    def get(self, axis: str, default=None):
        return dict(self.axes).get(axis, default)

    def __repr__(self) -> str:
        return "Placements(" + ", ".join(f"{a}={p!r}" for a, p in self.axes) + ")"


# Placeholder axis names of a bare spec leaf, resolved against the mesh by make_mesh_plan.
FSDP_AXIS, OTHER_AXIS = "__fsdp__", "__other__"


def _is_placement_leaf(mesh: Mesh):
    names = set(mesh.names)

    def is_leaf(x):
        if isinstance(x, Placements):
            return True
        return (
            isinstance(x, Mapping) and len(x) > 0 and set(x) <= names
            and all(isinstance(v, _PLACEMENT_TYPES) for v in x.values())
        )

    return is_leaf


def placement_leaves(specs, params, treedef, mesh: Mesh) -> list[Placements]:
    """One :class:`Placements` per params leaf from ``specs`` (see :func:`~ragged.spec.make_mesh_plan`).

    A bare granularity stands for the FSDP axis and a bare ``Shard`` for the one non-FSDP axis
    (axes ``FSDP_AXIS`` / ``OTHER_AXIS`` until the mesh plan resolves them).
    """
    n = treedef.num_leaves
    if specs is None:
        return [Placements()] * n
    is_leaf = _is_placement_leaf(mesh)
    if isinstance(specs, _PLACEMENT_TYPES) or is_leaf(specs):
        return [_as_placements(specs, "<root>")] * n

    def check_leaf(path, s):
        if s is not None and not isinstance(s, (*_PLACEMENT_TYPES, Placements)) and not is_leaf(s):
            raise RaggedTypeError(
                f"specs{path} is {s!r} of type {type(s).__name__}, not a placement. Each spec leaf must be "
                "spec.Placements(...) (or a dict {axis: placement} over the mesh axes), a granularity (FSDP axis only), "
                "spec.Shard(dim) (when the mesh has one non-FSDP axis) or None."
            )

    flat = broadcast_specs(specs, params, treedef, check_leaf=check_leaf, is_leaf=is_leaf,
                           none_means="Rows(1) on the FSDP axis, replicated on the others")
    return [_as_placements(s, keystr(a)) for s, a in zip(flat, treedef.accessors())]


def _as_placements(s, path: str) -> Placements:
    if s is None:
        return Placements()
    if isinstance(s, Placements):
        return s
    if isinstance(s, Mapping):
        return Placements(s)
    if isinstance(s, GRANULARITY_TYPES):
        return Placements({FSDP_AXIS: s})
    if isinstance(s, Shard):
        return Placements({OTHER_AXIS: s})
    raise RaggedTypeError(f"specs{path} is {s!r}, not a placement.")
