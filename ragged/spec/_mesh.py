"""Placements over an N-D device mesh: RaggedShard on the FSDP axis, ``Shard(dim)`` on others.

A leaf of a model trained with FSDP x TP (or x EP) has one placement per mesh axis: a
granularity (``Rows(n)``, ``Blocks(r, c)``, ``Elements(n)``, ``Replicate()``) on the FSDP axis,
and ``Shard(dim)`` or ``Replicate()`` on every other axis. For example a column-parallel weight
is ``{"dp": Rows(1), "tp": Shard(0)}``, a row-parallel one ``{"dp": Rows(1), "tp": Shard(1)}``
and stacked experts ``{"dp": Blocks(32, 32), "ep": Shard(0)}``.

[Note: plan on the local shapes]
``make_mesh_plan`` first applies the ``Shard`` placements (all even) to get each leaf's
*local* shape on one TP/EP rank, then plans the FSDP buffer with :func:`~ragged.make_plan` on
meta tensors of those local shapes. Every rank of a TP/EP group therefore holds the same
:class:`~ragged.spec.LayoutPlan` (local shapes are equal), and the FSDP collectives run over
the FSDP axis only, on TP-local tensors.

[Note: blocks stay whole on every axis]
A granule of the FSDP axis is defined on the *global* tensor; the TP/EP cut must not split
it. ``make_mesh_plan`` checks, before any tensor or communication is touched, that every
``Shard`` cut falls on a granule boundary of the global tensor:

* ``Blocks(r, c)``: cutting dim ``-2`` needs local rows ``% r == 0``; cutting dim ``-1``
  needs local columns ``% c == 0``; cutting a leading (matrix) dim is always fine.
* ``Rows(n)``: cutting a row dim ``d`` needs ``prod(local[d:-1]) % n == 0`` (the local
  tensor's row groups are then global row groups). Cutting the last dim splits every row;
  ``Rows(n)`` then means ``n`` rows of the *local* tensor (a row-parallel weight).
* ``Elements(n)``: cutting dim ``d`` needs ``prod(local[d:]) % n == 0``.

A violation raises :class:`~ragged.LayoutError` naming the key path, the shape, the local
shape, the rule and a fix.

[Note: strided placements]
``Shard(dim, groups=g)`` treats ``dim`` as ``g`` equal consecutive parts (e.g. the Q, K and V
row blocks of a fused QKV weight) and gives each rank its chunk *of every part*, concatenated.
Several axes sharding the same dim apply in mesh order (first axis outermost, as DTensor
does). The FSDP RaggedShard then cuts the local tensor, so a rank's FSDP piece is a strided
set of global elements: :meth:`MeshLeaf.local_index` keeps that bookkeeping (the paper's
StridedRaggedShard), and ``ragged.parallel`` uses it to reassemble global tensors and to
convert to a global layout for checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import optree
import torch

from ragged._errors import NO_PARAMS_MSG, LayoutError, RaggedKeyError, RaggedTypeError, RaggedValueError
from ragged._pytree import key_mismatch, keystr
from ragged.spec._granularity import GRANULARITY_TYPES, Blocks, Elements, Replicate, Rows
from ragged.spec._plan import LayoutPlan
from ragged.spec._planning import make_plan

__all__ = ["Shard", "Mesh", "Placements", "MeshLeaf", "MeshPlan", "make_mesh_plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """Even split of dimension ``dim`` over one mesh axis (TP / EP), as DTensor's ``Shard``.

    Attributes:
        dim: the dimension to split (negative counts from the end).
        groups: ``dim`` is ``groups`` equal consecutive parts (a fused QKV weight has 3); each
            rank holds its chunk of every part (see [Note: strided placements]).

    Examples:
        >>> from ragged import spec
        >>> spec.Shard(0), spec.Shard(0) == spec.Shard(0, groups=1), spec.Shard(0, groups=3)
        (Shard(dim=0, groups=1), True, Shard(dim=0, groups=3))
    """

    dim: int
    groups: int = 1

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise RaggedTypeError(f"Shard.dim must be an int, got {self.dim!r}.")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise RaggedValueError(f"Shard.groups must be a positive int, got {self.groups!r}.")

    replace = dataclasses.replace


@dataclasses.dataclass(frozen=True, slots=True)
class Mesh:
    """Axis names and sizes of an N-D device mesh (no devices, no process groups).

    The same order and names as ``torch.distributed.device_mesh.init_device_mesh(device,
    shape, mesh_dim_names=names)``; ranks are laid out row-major (the last axis varies
    fastest).

    Examples:
        >>> from ragged import spec
        >>> mesh = spec.Mesh((2, 4), ("dp", "tp"))
        >>> mesh.size, mesh.axis_size("tp"), mesh.coords(5)
        (8, 4, {'dp': 1, 'tp': 1})
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self):
        shape, names = tuple(self.shape), tuple(self.names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)
        if len(shape) != len(names) or not shape:
            raise RaggedValueError(f"Mesh needs one name per axis and at least one axis; got shape {shape}, names {names}.")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise RaggedValueError(f"Mesh axis names must be distinct non-empty strings, got {names}.")
        for n, s in zip(names, shape):
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise RaggedValueError(f"Mesh axis {n!r} has size {s!r}; sizes must be positive ints.")

    replace = dataclasses.replace

    @property
    def size(self) -> int:
        """Number of ranks."""
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return self.shape[self._index(name)]

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise RaggedValueError(f"mesh has axes {self.names}, no axis {name!r}.") from None

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates (axis -> index) of global ``rank`` (row-major)."""
        if not 0 <= rank < self.size:
            raise RaggedValueError(f"rank must be in [0, {self.size}), got {rank}.")
        out = {}
        for name, s in zip(reversed(self.names), reversed(self.shape)):
            out[name] = rank % s
            rank //= s
        return {n: out[n] for n in self.names}

    def rank(self, coords: Mapping[str, int]) -> int:
        """The global rank at ``coords`` (inverse of :meth:`coords`)."""
        r = 0
        for name, s in zip(self.names, self.shape):
            r = r * s + int(coords[name])
        return r


PlacementValue = Any  # a granularity (FSDP axis) or Shard / Replicate (other axes)


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
            if not isinstance(p, (Shard, *GRANULARITY_TYPES)):
                raise RaggedTypeError(
                    f"Placements[{axis!r}] is {p!r} of type {type(p).__name__}; a placement is spec.Shard(dim), "
                    "spec.Replicate(), or (on the FSDP axis) spec.Rows(n) / spec.Blocks(r, c) / spec.Elements(n)."
                )
        object.__setattr__(self, "axes", tuple(sorted(items.items())))

    def __getitem__(self, axis: str):
        for a, p in self.axes:
            if a == axis:
                return p
        raise RaggedKeyError(axis)

    def get(self, axis: str, default=None):
        for a, p in self.axes:
            if a == axis:
                return p
        return default

    def __repr__(self) -> str:
        return "Placements(" + ", ".join(f"{a}={p!r}" for a, p in self.axes) + ")"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshLeaf:
    """One leaf's placement over the mesh, resolved against its shape.

    Attributes:
        path: key path.
        index: position in the flattened parameter tree.
        shape: global shape.
        local_shape: shape on one rank of the non-FSDP axes (what the FSDP plan sees).
        dtype: the leaf's dtype.
        granularity: the FSDP-axis placement.
        shards: ``(axis, dim, groups, axis_size)`` for every ``Shard`` axis, in mesh order
            (``dim`` non-negative).
        replicated_on: non-FSDP axes on which the leaf is replicated.
    """

    path: str
    index: int
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: PlacementValue
    shards: tuple[tuple[str, int, int, int], ...]
    replicated_on: tuple[str, ...]

    replace = dataclasses.replace

    def sharded_on(self, axis: str) -> bool:
        return any(a == axis for a, *_ in self.shards)

    def local_index(self, coords: Mapping[str, int], *, dtype=torch.int64) -> torch.Tensor:
        """Global flat element index of every element of the local tensor at ``coords``.

        The strided bookkeeping of [Note: strided placements]: element ``i`` of the flattened
        local tensor is element ``local_index(coords)[i]`` of the flattened global tensor.

        Examples:
            >>> import torch, ragged as rg
            >>> from ragged import spec
            >>> mp = spec.make_mesh_plan({"w": torch.empty(4, 2)}, {"w": spec.Placements(tp=spec.Shard(1))},
            ...                          mesh=spec.Mesh((1, 2), ("dp", "tp")))
            >>> mp.leaves[0].local_index({"dp": 0, "tp": 1}).tolist()
            [1, 3, 5, 7]
        """
        # One index vector per dim, narrowed like the tensor (O(local numel), never the global).
        ndim = len(self.shape)
        if ndim == 0:
            return torch.zeros(1, dtype=dtype)
        per_dim = [torch.arange(n, dtype=dtype) for n in self.shape]
        for axis, dim, groups, size in self.shards:
            n = per_dim[dim].numel()
            chunk = n // groups // size
            c = int(coords[axis])
            per_dim[dim] = per_dim[dim].view(groups, n // groups)[:, c * chunk : (c + 1) * chunk].reshape(-1)
        strides = [math.prod(self.shape[i + 1 :]) for i in range(ndim)]
        index = torch.zeros(self.local_shape, dtype=dtype)
        for i, (idx, st) in enumerate(zip(per_dim, strides)):
            index += (idx * st).view([-1 if j == i else 1 for j in range(ndim)])
        return index.reshape(-1)

    def fingerprint_fields(self) -> tuple:
        return (self.path, self.index, self.shape, self.local_shape, str(self.dtype), repr(self.granularity),
                self.shards, self.replicated_on)


def local_part(t: torch.Tensor, leaf: MeshLeaf, coords: Mapping[str, int]) -> torch.Tensor:
    """The part of global tensor ``t`` that mesh position ``coords`` holds (a view when the
    placements allow, else a copy is made by ``reshape``)."""
    for axis, dim, groups, size in leaf.shards:
        n = t.shape[dim]
        chunk = n // groups // size
        c = int(coords[axis])
        if groups == 1:
            t = t.narrow(dim, c * chunk, chunk)
        else:
            t = t.unflatten(dim, (groups, n // groups)).narrow(dim + 1, c * chunk, chunk).flatten(dim, dim + 1)
    return t


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MeshPlan:
    """A plan over an N-D mesh: per-leaf placements plus the FSDP :class:`LayoutPlan` of the
    local shapes (equal on every rank; see [Note: plan on the local shapes]).

    Attributes:
        mesh: the mesh.
        fsdp_axis: the axis the RaggedShard buffer is sharded over.
        leaves: one :class:`MeshLeaf` per params leaf, in tree order.
        plan: the FSDP layout of the local shapes (``world_size == mesh.axis_size(fsdp_axis)``).
        treedef: the params tree structure.
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

    def fingerprint(self) -> str:
        """A digest equal on two processes exactly when their mesh plans are equal."""
        import hashlib

        text = repr((self.mesh, self.fsdp_axis, [l.fingerprint_fields() for l in self.leaves], self.plan.fingerprint()))
        return hashlib.sha256(text.encode()).hexdigest()

    def leaf(self, path: str) -> MeshLeaf:
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise RaggedKeyError(f"no leaf at {path!r}; paths are {[l.path for l in self.leaves]}")

    def local_shapes(self):
        """A tree like the params holding each leaf's local shape (a tuple)."""
        return optree.tree_unflatten(self.treedef, [l.local_shape for l in self.leaves])

    def local_meta(self):
        """A tree like the params of meta tensors of the local shapes."""
        return optree.tree_unflatten(
            self.treedef, [torch.empty(l.local_shape, dtype=l.dtype, device="meta") for l in self.leaves]
        )

    def __rich__(self):
        """A table: one row per leaf with its global shape, placements, local shape and granule."""
        from rich.table import Table

        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.shape))
        plan = self.plan
        table = Table(title=f"MeshPlan ({mesh}; FSDP over {self.fsdp_axis!r}: S={plan.shard_size}, "
                            f"padding {plan.padding} = {plan.overhead:.2%})")
        for col in ("leaf", "shape", *self.mesh.names, "local shape", "granule"):
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
            table.add_row(l.path, str(l.shape), *per_axis, str(l.local_shape), str(granules.get(l.index, "-")))
        return table

    def __repr__(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.shape))
        return f"MeshPlan(mesh=({mesh}), fsdp_axis={self.fsdp_axis!r}, leaves={len(self.leaves)}, plan={self.plan!r})"


def _is_spec_leaf(mesh: Mesh):
    names = set(mesh.names)

    def is_leaf(x):
        if isinstance(x, Placements):
            return True
        return (
            isinstance(x, Mapping) and len(x) > 0 and set(x) <= names
            and all(isinstance(v, (Shard, *GRANULARITY_TYPES)) for v in x.values())
        )

    return is_leaf


def _spec_leaves(specs, params, treedef, mesh: Mesh) -> list:
    n = treedef.num_leaves
    if specs is None:
        return [Placements()] * n
    is_leaf = _is_spec_leaf(mesh)
    if isinstance(specs, (Shard, *GRANULARITY_TYPES)) or is_leaf(specs):
        specs = [specs] * n
        return [_as_placements(s, mesh, "<root>") for s in specs]
    accessors, leaves, _ = optree.tree_flatten_with_accessor(specs, is_leaf=is_leaf, none_is_leaf=True, namespace="ragged")
    for accessor, s in zip(accessors, leaves):
        if s is not None and not isinstance(s, (Shard, *GRANULARITY_TYPES, Placements)) and not is_leaf(s):
            raise RaggedTypeError(
                f"specs{keystr(accessor)} is {s!r} of type {type(s).__name__}, not a placement. Each spec leaf must be "
                "spec.Placements(...) (or a dict {axis: placement} over the mesh axes), a granularity (FSDP axis only), "
                "spec.Shard(dim) (when the mesh has one non-FSDP axis) or None."
            )
    wrapped = optree.tree_map(
        lambda s: _Box(s), specs, is_leaf=is_leaf, none_is_leaf=True, namespace="ragged"
    )
    try:
        full = optree.tree_broadcast_prefix(wrapped, params, namespace="ragged")
    except ValueError:
        errors = optree.prefix_errors(wrapped, params, namespace="ragged")
        if errors:
            said = key_mismatch(wrapped, params, prefix_name="specs", full_name="params")
            if said:
                raise RaggedValueError(f"{said}. Fix: give specs the structure of params, or a prefix of it.") from None
            raise errors[0]("specs") from None
        raise
    boxes = treedef.flatten_up_to(full)
    paths = [keystr(a) for a in treedef.accessors()]
    return [_as_placements(b.value, mesh, p) for b, p in zip(boxes, paths)]


class _Box:
    """Hides a spec (possibly a dict) from optree while broadcasting the prefix."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _as_placements(s, mesh: Mesh, path: str) -> Placements:
    if s is None:
        return Placements()
    if isinstance(s, Placements):
        return s
    if isinstance(s, Mapping):
        return Placements(s)
    if isinstance(s, GRANULARITY_TYPES):
        return Placements(__fsdp__=s)
    if isinstance(s, Shard):
        return Placements(__other__=s)
    raise RaggedTypeError(f"specs{path} is {s!r}, not a placement.")


def _resolve(path, index, shape, dtype, placements: Placements, mesh: Mesh, fsdp_axis: str) -> MeshLeaf:
    others = [a for a in mesh.names if a != fsdp_axis]
    table = dict(placements.axes)
    if "__fsdp__" in table:
        table[fsdp_axis] = table.pop("__fsdp__")
    if "__other__" in table:
        if len(others) != 1:
            raise LayoutError(
                f"specs{path} is a bare {table['__other__']!r} but the mesh has non-FSDP axes {tuple(others)}; it is "
                f"ambiguous which axis it shards. Fix: spec.Placements({fsdp_axis}=..., <axis>={table['__other__']!r}).",
                path=path, shape=shape,
            )
        table[others[0]] = table.pop("__other__")
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
    local = list(shape)
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
        if local[dim] % need:
            what = f"{p.groups} parts x {size} ranks" if p.groups > 1 else f"{size} ranks"
            raise LayoutError(
                f"specs{path} places {p!r} on mesh axis {axis!r} (size {size}) but params{path} has shape "
                f"{tuple(shape)}: dim {dim} has {local[dim]} entries{' on this rank' if local[dim] != shape[dim] else ''}, "
                f"not a multiple of {need} ({what}). Rule: Shard(dim) splits a dimension evenly. Fix: pad dim {dim} "
                f"to a multiple of {need}, shard another dim, or Replicate() on {axis!r}.",
                path=path, shape=shape,
            )
        local[dim] //= size
        shards.append((axis, dim, p.groups, size))
    local = tuple(local)
    _check_granules(path, shape, local, gran, shards, fsdp_axis)
    return MeshLeaf(
        path=path, index=index, shape=tuple(shape), local_shape=local, dtype=dtype, granularity=gran,
        shards=tuple(shards), replicated_on=tuple(replicated_on),
    )


def _check_granules(path, shape, local, gran, shards, fsdp_axis) -> None:
    """See [Note: blocks stay whole on every axis]."""
    ndim = len(shape)
    for axis, dim, groups, size in shards:
        problem = None
        local = list(local)
        local[dim] //= groups  # a strided shard's local dim is `groups` separate runs
        local = tuple(local)
        if isinstance(gran, Blocks) and ndim >= 2:
            if dim == ndim - 1 and local[-1] % gran.c:
                problem = (f"{local[-1]} local columns is not a multiple of c = {gran.c}", f"c dividing {local[-1]}")
            elif dim == ndim - 2 and local[-2] % gran.r:
                problem = (f"{local[-2]} local rows is not a multiple of r = {gran.r}", f"r dividing {local[-2]}")
        elif isinstance(gran, Rows) and (dim < ndim - 1 or ndim == 1):
            rows = math.prod(local[dim:-1]) if ndim >= 2 else local[0]
            if rows % gran.n:
                problem = (f"each contiguous run of the local tensor holds {rows} rows, not a multiple of n = {gran.n}",
                           f"n dividing {rows}")
        elif isinstance(gran, Elements):
            run = math.prod(local[dim:])
            if run % gran.n:
                problem = (f"each contiguous run of the local tensor holds {run} elements, not a multiple of n = {gran.n}",
                           f"n dividing {run}")
        if problem is not None:
            raise LayoutError(
                f"specs{path} places {gran!r} on {fsdp_axis!r} and Shard({dim}) on {axis!r} (size {size}): params{path} "
                f"of shape {tuple(shape)} has local shape {tuple(local)} on each {axis!r} rank, and {problem[0]}, so a "
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
    RaggedShard on the FSDP axis (planned on the local shapes).

    Pure: no tensor data, no communication; every check (even splits, granules that would
    straddle a TP/EP boundary) runs here. See [Note: plan on the local shapes].

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
        >>> [(l.path, l.local_shape) for l in mp.leaves], mp.plan.world_size
        ([("['down']", (16, 32)), ("['up']", (32, 16))], 2)
        >>> spec.make_mesh_plan(params, {"up": {"dp": spec.Blocks(64, 16), "tp": spec.Shard(0)}, "down": None}, mesh=mesh)
        Traceback (most recent call last):
        ...
        ragged._errors.LayoutError: specs['up'] places Blocks(r=64, c=16) on 'dp' and Shard(0) on 'tp' (size 2): params['up'] of shape (64, 16) has local shape (32, 16) on each 'tp' rank, and 32 local rows is not a multiple of r = 64, so a granule would straddle the 'tp' boundary. Rule: a Blocks granule never crosses a TP/EP or FSDP boundary. Fix: choose r dividing 32, or shard a different dim on 'tp'.
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
    placements = _spec_leaves(specs, params, treedef, mesh)
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
    local = optree.tree_unflatten(treedef, [torch.empty(l.local_shape, dtype=l.dtype, device="meta") for l in mleaves])
    grans = optree.tree_unflatten(treedef, [l.granularity for l in mleaves])
    plan = make_plan(local, grans, world_size=mesh.axis_size(fsdp_axis), **plan_options)
    return MeshPlan(mesh=mesh, fsdp_axis=fsdp_axis, leaves=tuple(mleaves), plan=plan, treedef=treedef)
