"""`MeshPlan`: a plan over an N-D mesh, the placements of every leaf resolved against its shape
plus the FSDP :class:`~ragged.LayoutPlan` of the parts (:func:`make_mesh_plan`).

A leaf's *part* is what one position of the non-FSDP axes (TP, EP) holds of it after every
``Shard`` placement (``MeshLeaf.part_shape``); the FSDP axis then shards the parts (see the
glossary in docs/design.md: "local" is this rank's piece of an FSDP buffer, never a part).

[Note: plan on the part shapes]
``make_mesh_plan`` first applies the ``Shard`` placements (all even) to get each leaf's part
shape on one TP/EP rank, then plans the FSDP buffer with :func:`~ragged.make_plan` on meta
tensors of those part shapes. Every rank of a TP/EP group therefore holds the same
:class:`~ragged.spec.LayoutPlan` (part shapes are equal), and the FSDP collectives run over
the FSDP axis only, on parts.

[Note: blocks stay whole on every axis]
A granule of the FSDP axis is defined on the *global* tensor; the TP/EP cut must not split
it. ``make_mesh_plan`` checks, before any tensor or communication is touched, that every
``Shard`` cut falls on a granule boundary of the global tensor:

* ``Blocks(r, c)``: cutting dim ``-2`` needs the part's rows ``% r == 0``; cutting dim ``-1``
  needs the part's columns ``% c == 0``; cutting a leading (matrix) dim is always fine.
* ``Rows(n)``: cutting a row dim ``d`` needs ``prod(part[d:-1]) % n == 0`` (the part's row
  groups are then global row groups). Cutting the last dim splits every row; ``Rows(n)`` then
  means ``n`` rows of the *part* (a row-parallel weight).
* ``Elements(n)``: cutting dim ``d`` needs ``prod(part[d:]) % n == 0``.

A violation raises :class:`~ragged.LayoutError` naming the key path, the shape, the part
shape, the rule and a fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import optree
import torch

from ragged._errors import NO_PARAMS_MSG, LayoutError, RaggedKeyError, RaggedTypeError, RaggedValueError
from ragged._pytree import keystr
from ragged.spec._granularity import Blocks, Elements, Replicate, Rows
from ragged.spec._mesh import Mesh
from ragged.spec._placements import FSDP_AXIS, OTHER_AXIS, PlacementValue, Placements, Shard, placement_leaves
from ragged.spec._plan import LayoutPlan
from ragged.spec._planning import make_plan

__all__ = ["MeshLeaf", "MeshPlan", "make_mesh_plan"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshLeaf:
    """One leaf's placement over the mesh, resolved against its shape.

    Attributes:
        path: key path.
        index: position in the flattened parameter tree.
        shape: global shape.
        part_shape: the leaf's part: its shape on one position of the non-FSDP axes (what the
            FSDP plan sees).
        dtype: the leaf's dtype.
        granularity: the FSDP-axis placement.
        shards: ``(axis, dim, groups, axis_size)`` for every ``Shard`` axis, in mesh order
            (``dim`` non-negative).
        replicated_on: non-FSDP axes on which the leaf is replicated.

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> mplan = spec.make_mesh_plan({"w": torch.empty(8, 4, device="meta")}, {"w": spec.Shard(0)},
        ...                             mesh=spec.Mesh((2, 2), ("dp", "tp")))
        >>> leaf = mplan.leaf("['w']")
        >>> leaf.shape, leaf.part_shape, leaf.shards, leaf.replicated_on
        ((8, 4), (4, 4), (('tp', 0, 1, 2),), ())
    """

    path: str
    index: int
    shape: tuple[int, ...]
    part_shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: PlacementValue
    shards: tuple[tuple[str, int, int, int], ...]
    replicated_on: tuple[str, ...]

    replace = dataclasses.replace

    def sharded_on(self, axis: str) -> bool:
        return any(a == axis for a, *_ in self.shards)

    def fingerprint_fields(self) -> tuple:
        return (self.path, self.index, self.shape, self.part_shape, str(self.dtype), repr(self.granularity),
                self.shards, self.replicated_on)



@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshPlan:
    """A plan over an N-D mesh: per-leaf placements plus the FSDP :class:`LayoutPlan` of the
    parts (equal on every rank; see [Note: plan on the part shapes]).

    Attributes:
        mesh: the mesh.
        fsdp_axis: the axis the RaggedShard buffer is sharded over.
        leaves: one :class:`MeshLeaf` per params leaf, in tree order.
        plan: the FSDP layout of the parts (``world_size == mesh.axis_size(fsdp_axis)``).
        treedef: the params tree structure.

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> params = {"w": torch.empty(8, 4, device="meta"), "b": torch.empty(4, device="meta")}
        >>> mplan = spec.make_mesh_plan(params, {"w": spec.Shard(0), "b": None}, mesh=spec.Mesh((2, 2), ("dp", "tp")))
        >>> mplan.fsdp_axis, mplan.other_axes, mplan.part_shapes()
        ('dp', ('tp',), {'w': (4, 4), 'b': (4,)})
        >>> mplan.plan.world_size                         # the FSDP plan of the parts, over "dp"
        2
    """

    mesh: Mesh
    fsdp_axis: str
    leaves: tuple[MeshLeaf, ...]
    plan: LayoutPlan
    treedef: Any = dataclasses.field(repr=False)

    replace = dataclasses.replace

    @property
    def other_axes(self) -> tuple[str, ...]:
        """Mesh axes other than the FSDP axis, in mesh order."""
        return tuple(a for a in self.mesh.names if a != self.fsdp_axis)

    @property
    def world_size(self) -> int:
        """Ranks of the whole mesh."""
        return self.mesh.size

    @property
    def shard_size(self) -> int:
        """Elements of the FSDP buffer per rank (``plan.shard_size``)."""
        return self.plan.shard_size

    @property
    def num_leaves(self) -> int:
        return len(self.leaves)

    def fingerprint(self) -> str:
        """A digest equal on two processes exactly when their mesh plans are equal."""
        text = repr((self.mesh, self.fsdp_axis, [l.fingerprint_fields() for l in self.leaves], self.plan.fingerprint()))
        return hashlib.sha256(text.encode()).hexdigest()

    def leaf(self, path: str) -> MeshLeaf:
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise RaggedKeyError(f"no leaf at {path!r}; paths are {[l.path for l in self.leaves]}")

    def part_shapes(self):
        """A tree like the params holding each leaf's part shape (a tuple)."""
        return optree.tree_unflatten(self.treedef, [l.part_shape for l in self.leaves])

    def part_meta(self):
        """A tree like the params of meta tensors of the part shapes (what ``fsdp.make_units``
        plans for a mesh run)."""
        return optree.tree_unflatten(
            self.treedef, [torch.empty(l.part_shape, dtype=l.dtype, device="meta") for l in self.leaves]
        )

    def __rich__(self):
        """A table: one row per leaf with its global shape, placements, part shape and granule."""
        # rich only when the plan is drawn (as ragged/_viz.py)
        from rich.table import Table

        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.shape))
        plan = self.plan
        table = Table(title=f"MeshPlan ({mesh}; FSDP over {self.fsdp_axis!r}: S={plan.shard_size}, "
                            f"padding {plan.padding} = {plan.overhead:.2%})")
        for col in ("leaf", "shape", *self.mesh.names, "part shape", "granule"):
            table.add_column(col)
        granules = {l.index: l.granule for l in plan.leaves}
        for l in self.leaves:
            per_axis = []
            for a in self.mesh.names:
                if a == self.fsdp_axis:
                    per_axis.append(repr(l.granularity))
                    continue
                s = [x for x in l.shards if x[0] == a]
                per_axis.append("Replicate()" if not s else f"Shard({s[0][1]}" + (f", groups={s[0][2]})" if s[0][2] > 1 else ")"))
            table.add_row(l.path, str(l.shape), *per_axis, str(l.part_shape), str(granules.get(l.index, "-")))
        return table

    def __repr__(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.shape))
        return f"MeshPlan(mesh=({mesh}), fsdp_axis={self.fsdp_axis!r}, leaves={len(self.leaves)}, plan={self.plan!r})"


def _resolve(path, index, shape, dtype, placements: Placements, mesh: Mesh, fsdp_axis: str) -> MeshLeaf:
    others = [a for a in mesh.names if a != fsdp_axis]
    table = dict(placements.axes)
    if FSDP_AXIS in table:
        table[fsdp_axis] = table.pop(FSDP_AXIS)
    if OTHER_AXIS in table:
        if len(others) != 1:
            raise LayoutError(
                f"specs{path} is a bare {table[OTHER_AXIS]!r} but the mesh has non-FSDP axes {tuple(others)}; it is "
                f"ambiguous which axis it shards. Fix: spec.Placements({fsdp_axis}=..., <axis>={table[OTHER_AXIS]!r}).",
                path=path, shape=shape,
            )
        table[others[0]] = table.pop(OTHER_AXIS)
    unknown = sorted(set(table) - set(mesh.names))
    if unknown:
        raise LayoutError(
            f"specs{path} = {placements!r} names axes {unknown} that the mesh {mesh.names} does not have. "
            "Fix: use the mesh's axis names.",
            path=path, shape=shape,
        )
    gran = table.get(fsdp_axis, Rows(1))
    if isinstance(gran, Shard):
        raise LayoutError(
            f"specs{path} places {gran!r} on the FSDP axis {fsdp_axis!r}; the FSDP axis takes a RaggedShard "
            f"granularity. Fix: use spec.Rows(1) (row-wise, no padding inside the tensor) or spec.Blocks(r, c).",
            path=path, shape=shape,
        )
    ndim = len(shape)
    part = list(shape)
    shards, replicated_on = [], []
    for axis in others:
        p = table.get(axis, Replicate())
        size = mesh.axis_size(axis)
        if isinstance(p, Replicate):
            replicated_on.append(axis)
            continue
        if not isinstance(p, Shard):
            raise LayoutError(
                f"specs{path} places {p!r} on mesh axis {axis!r}, which is not the FSDP axis ({fsdp_axis!r}); only "
                f"spec.Shard(dim) or spec.Replicate() go there. Fix: move the granularity to {fsdp_axis!r}.",
                path=path, shape=shape,
            )
        dim = p.dim + ndim if p.dim < 0 else p.dim
        if not 0 <= dim < ndim:
            raise LayoutError(
                f"specs{path} places {p!r} on mesh axis {axis!r} but params{path} has shape {tuple(shape)} "
                f"({ndim} dims). Fix: choose a dim in [{-ndim}, {ndim}), or Replicate().",
                path=path, shape=shape,
            )
        need = p.groups * size
        if part[dim] % need:
            what = f"{p.groups} segments x {size} ranks" if p.groups > 1 else f"{size} ranks"
            raise LayoutError(
                f"specs{path} places {p!r} on mesh axis {axis!r} (size {size}) but params{path} has shape "
                f"{tuple(shape)}: dim {dim} has {part[dim]} entries{' on this rank' if part[dim] != shape[dim] else ''}, "
                f"not a multiple of {need} ({what}). Rule: Shard(dim) splits a dimension evenly. Fix: pad dim {dim} "
                f"to a multiple of {need}, shard another dim, or Replicate() on {axis!r}.",
                path=path, shape=shape,
            )
        part[dim] //= size
        shards.append((axis, dim, p.groups, size))
    part = tuple(part)
    _check_granules(path, shape, part, gran, shards, fsdp_axis)
    return MeshLeaf(
        path=path, index=index, shape=tuple(shape), part_shape=part, dtype=dtype, granularity=gran,
        shards=tuple(shards), replicated_on=tuple(replicated_on),
    )


def _check_granules(path, shape, part, gran, shards, fsdp_axis) -> None:
    """See [Note: blocks stay whole on every axis]."""
    ndim = len(shape)
    for axis, dim, groups, size in shards:
        problem = None
        part = (*part[:dim], part[dim] // groups, *part[dim + 1:])  # a strided shard's dim: `groups` separate runs
        if isinstance(gran, Blocks) and ndim >= 2:
            if dim == ndim - 1 and part[-1] % gran.c:
                problem = (f"{part[-1]} columns per part is not a multiple of c = {gran.c}", f"c dividing {part[-1]}")
            elif dim == ndim - 2 and part[-2] % gran.r:
                problem = (f"{part[-2]} rows per part is not a multiple of r = {gran.r}", f"r dividing {part[-2]}")
        elif isinstance(gran, Rows) and (dim < ndim - 1 or ndim == 1):
            rows = math.prod(part[dim:-1]) if ndim >= 2 else part[0]
            if rows % gran.n:
                problem = (f"each contiguous run of the part holds {rows} rows, not a multiple of n = {gran.n}",
                           f"n dividing {rows}")
        elif isinstance(gran, Elements):
            run = math.prod(part[dim:])
            if run % gran.n:
                problem = (f"each contiguous run of the part holds {run} elements, not a multiple of n = {gran.n}",
                           f"n dividing {run}")
        if problem is not None:
            raise LayoutError(
                f"specs{path} places {gran!r} on {fsdp_axis!r} and Shard({dim}) on {axis!r} (size {size}): params{path} "
                f"of shape {tuple(shape)} has part shape {tuple(part)} on each {axis!r} rank, and {problem[0]}, so a "
                f"granule would straddle the {axis!r} boundary. Rule: a {type(gran).__name__} granule never crosses a "
                f"TP/EP or FSDP boundary. Fix: choose {problem[1]}, or shard a different dim on {axis!r}.",
                path=path, shape=shape,
            )


def make_mesh_plan(
    params,
    specs=None,
    *,
    mesh: Mesh,
    fsdp_axis: str | None = None,
    **plan_options,
) -> MeshPlan:
    """Plans ``params`` (global shapes) over an N-D ``mesh``: ``Shard`` on the TP/EP axes,
    RaggedShard on the FSDP axis (planned on the part shapes).

    Pure: no tensor data, no communication; every check (even splits, granules that would
    straddle a TP/EP boundary) runs here. See [Note: plan on the part shapes].

    Args:
        params: pytree of tensors of the *global* shapes (meta tensors are fine).
        specs: pytree or prefix of ``spec.Placements`` / ``{axis: placement}`` dicts /
            granularities (FSDP axis only, replicated elsewhere) / ``spec.Shard(dim)`` (when the
            mesh has one non-FSDP axis) / ``None`` (``Rows(1)`` on FSDP, replicated elsewhere).
        mesh: the :class:`Mesh`.
        fsdp_axis: the FSDP axis; default ``"dp"`` if the mesh has it, else the first axis.
        **plan_options: passed to :func:`~ragged.make_plan` (``align``, ``strategy``,
            ``order``, ``dtype``).

    Returns:
        A frozen :class:`MeshPlan`.

    Raises:
        LayoutError: an uneven split, a granule straddling a boundary, unknown axes (the
            message names the key path, shape, rule and fix).
        TypeError: a spec leaf that is not a placement.

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> mesh = spec.Mesh((2, 2), ("dp", "tp"))
        >>> params = {"up": torch.empty(64, 16, device="meta"), "down": torch.empty(16, 64, device="meta")}
        >>> specs = {"up": {"dp": spec.Blocks(32, 16), "tp": spec.Shard(0)}, "down": {"tp": spec.Shard(1)}}
        >>> mp = spec.make_mesh_plan(params, specs, mesh=mesh)
        >>> [(l.path, l.part_shape) for l in mp.leaves], mp.plan.world_size
        ([("['down']", (16, 32)), ("['up']", (32, 16))], 2)
        >>> spec.make_mesh_plan(params, {"up": {"dp": spec.Blocks(64, 16), "tp": spec.Shard(0)}, "down": None}, mesh=mesh)
        Traceback (most recent call last):
        ...
        ragged._errors.LayoutError: specs['up'] places Blocks(r=64, c=16) on 'dp' and Shard(0) on 'tp' (size 2): params['up'] of shape (64, 16) has part shape (32, 16) on each 'tp' rank, and 32 rows per part is not a multiple of r = 64, so a granule would straddle the 'tp' boundary. Rule: a Blocks granule never crosses a TP/EP or FSDP boundary. Fix: choose r dividing 32, or shard a different dim on 'tp'.
    """
    if not isinstance(mesh, Mesh):
        raise RaggedTypeError(f"make_mesh_plan: mesh must be a ragged.spec.Mesh, got {type(mesh).__name__}.")
    if fsdp_axis is None:
        fsdp_axis = "dp" if "dp" in mesh.names else mesh.names[0]
    if fsdp_axis not in mesh.names:
        raise RaggedValueError(f"make_mesh_plan: fsdp_axis {fsdp_axis!r} is not an axis of the mesh {mesh.names}.")
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(params, namespace="ragged")
    if not leaves:
        raise LayoutError(NO_PARAMS_MSG)
    paths = [keystr(a) for a in accessors]
    placements = placement_leaves(specs, params, treedef, mesh)
    mleaves = []
    for i, (p, leaf, pl) in enumerate(zip(paths, leaves, placements)):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or not isinstance(dtype, torch.dtype):
            raise RaggedTypeError(
                f"params{p} is a {type(leaf).__name__}, not a tensor. make_mesh_plan needs tensors of the global "
                "shapes (meta tensors are fine)."
            )
        mleaves.append(_resolve(p, i, tuple(int(d) for d in shape), dtype, pl, mesh, fsdp_axis))
    parts = optree.tree_unflatten(treedef, [torch.empty(l.part_shape, dtype=l.dtype, device="meta") for l in mleaves])
    grans = optree.tree_unflatten(treedef, [l.granularity for l in mleaves])
    plan = make_plan(parts, grans, world_size=mesh.axis_size(fsdp_axis), **plan_options)
    return MeshPlan(mesh=mesh, fsdp_axis=fsdp_axis, leaves=tuple(mleaves), plan=plan, treedef=treedef)
