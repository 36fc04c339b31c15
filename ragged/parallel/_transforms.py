"""FSDP over one axis of an N-D mesh: the :class:`~ragged.spec.MeshPlan` layout of the verbs
(``rg.shard`` / ``rg.gather`` / ``rg.reduce_scatter`` / ``rg.global_norm`` of a mesh plan, see
[Note: one verb, any layout]) over the parts, the step's data groups, reassembly of global
tensors, and export to DTensor.

[Note: data axes]
The FSDP axis always splits the batch: ``reduce_scatter`` sums over it. Another axis may split
the batch too: an EP axis usually does (each EP rank routes its own tokens; experts see tokens
of every EP rank through the all-to-all, so an expert's gradient is already complete, but a
parameter *replicated* on the EP axis, such as the router, holds only its own tokens' part).
``rg.reduce_scatter(mplan, ..., data_axes=("ep",))`` therefore all-reduces, over each data axis, exactly
the leaves replicated on it (one extra all-reduce of just those elements), and ``"mean"``
divides every leaf by ``fsdp size x prod(data axis sizes)``. TP axes are not data axes: with
``copy_to`` / ``reduce_from`` (see [Note: f and g]) gradients of TP-replicated leaves are
already equal across TP ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import optree
import torch

from ragged._dbuffer import DBuffer, norm
from ragged._divide import divisor
from ragged._errors import RaggedValueError
from ragged.fsdp._step import DataGroup
from ragged.parallel._parts import check_mplan, parts
from ragged.spec._mesh_plan import MeshPlan
from ragged.transforms._gather import gather as gather_plan
from ragged.transforms._check import check_plans
from ragged.transforms._layouts import LayoutOps, register_layout
from ragged.transforms._reduce_scatter import all_reduce_leaves
from ragged.transforms._reduce_scatter import reduce_scatter as reduce_scatter_plan
from ragged.transforms._shard import shard as shard_plan

__all__ = ["full_params", "to_dtensor", "data_groups", "check_mesh_plan"]


def _check_mesh(mplan: MeshPlan, mcomm, where):
    if tuple(mcomm.mesh.names) != mplan.mesh.names or tuple(mcomm.mesh.shape) != mplan.mesh.shape:
        raise RaggedValueError(
            f"{where}: the plan is for mesh {mplan.mesh.shape} {mplan.mesh.names} but the MeshComm's mesh is "
            f"{mcomm.mesh.shape} {mcomm.mesh.names}. Fix: plan with spec.make_mesh_plan(..., mesh=mcomm.mesh)."
        )


# [Note: mesh plan check]
# ``rg.shard`` / ``rg.gather`` of a LayoutPlan compare the FSDP plan within the FSDP group only.
# Ranks of one TP group that planned different placements (or shapes) would issue TP collectives of
# different sizes. So ``shard``, ``reduce_scatter``, ``global_norm``, ``full_params``, ``to_global``
# and ``from_global`` of a mesh plan first make the whole mesh (``mcomm.world``) agree on the mesh
# plan, with the same agreement the flat transforms use (``check_plans``, see [Note: plan check
# before collectives] in ragged/transforms/_check.py: one all-reduce of two int64s, every call or,
# with ``world.plan_check == "first_use"``, once per plan), and raise
# :class:`~ragged.PlanMismatchError` on every rank if any differ, naming what.
def check_mesh_plan(mplan: MeshPlan, mcomm) -> None:
    """See [Note: mesh plan check]. A no-op without ``mcomm.world``."""
    world = getattr(mcomm, "world", None)
    if world is not None:
        check_plans((mplan,), world, "mesh_plan", summary=_mesh_summary, explain=_explain_mesh)


def _mesh_summary(mplan: MeshPlan) -> dict:
    return {l.path: (l.shape, l.part_shape, repr(l.granularity), l.shards) for l in mplan.leaves}


def _explain_mesh(calls) -> str:
    """``calls``: per world rank ``(operation, fingerprints, [summary])``; at least two differ."""
    first = calls[0]
    other_rank, other = next(((r, c) for r, c in enumerate(calls) if c[1] != first[1]), (len(calls) - 1, calls[-1]))
    a, b = first[2][0], other[2][0]
    diffs = [f"{p}: {a.get(p)} vs {b.get(p)}" for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)]
    return (
        f"ranks hold different mesh plans: rank 0 vs rank {other_rank} differ in "
        f"{'; '.join(diffs[:3]) or 'mesh, FSDP axis or planning options'} (path: (shape, part shape, "
        "granularity, shards)). Fix: build the mesh plan identically on every rank."
    )


def _check_data_axes(mplan: MeshPlan, axes: Sequence[str], where: str) -> tuple[str, ...]:
    """``axes`` as a tuple, each a non-FSDP axis of the mesh (see [Note: data axes])."""
    for a in axes:
        if a not in mplan.other_axes:
            raise RaggedValueError(
                f"{where} {a!r} is not a non-FSDP axis of the mesh ({mplan.other_axes}); the FSDP axis "
                f"{mplan.fsdp_axis!r} is always reduced (by the step's own comm)."
            )
    return tuple(axes)


def _shard(mplan: MeshPlan, params, mcomm) -> DBuffer:
    """``rg.shard(mplan, params, mcomm)``: this rank's DBuffer, the FSDP shard of its parts.

    Args:
        mplan: the mesh plan.
        params: global tensors, equal on every rank (e.g. seeded init).
        mcomm: this rank's :class:`MeshComm`.

    Returns:
        A :class:`~ragged.DBuffer` of ``mplan.plan`` (rank = FSDP-axis index).

    Raises:
        LayoutError: ``params`` do not have the plan's global shapes (before any communication).
        PlanMismatchError: ranks hold different mesh plans (see [Note: mesh plan check]).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec, parallel
        >>> mesh = spec.Mesh((2, 2), ("dp", "tp"))
        >>> w = torch.arange(32.0).view(8, 4)
        >>> mp = spec.make_mesh_plan({"w": w}, spec.Shard(0), mesh=mesh, align=1)
        >>> def fn(mc):  # tp splits the rows in halves, then dp splits each half
        ...     return rg.shard(mp, {"w": w}, mc).views()["w"][:, 0].tolist()
        >>> parallel.simulate_mesh(mesh, fn)   # ranks (dp, tp) = (0,0) (0,1) (1,0) (1,1)
        [[0.0, 4.0], [16.0, 20.0], [8.0, 12.0], [24.0, 28.0]]
    """
    _check_mesh(mplan, mcomm, "shard")
    part_tree = parts(mplan, params, mcomm.coords)
    check_mesh_plan(mplan, mcomm)
    return shard_plan(mplan.plan, part_tree, mcomm[mplan.fsdp_axis])


def _gather(mplan: MeshPlan, dbuf: DBuffer, mcomm, dtype: torch.dtype | None = None):
    """``rg.gather(mplan, dbuf, mcomm, dtype)``: this rank's parts, full: one all-gather over the
    plan's FSDP axis only. Differentiable like ``rg.gather`` (backward: reduce-scatter over the
    FSDP axis)."""
    _check_mesh(mplan, mcomm, "gather")
    return gather_plan(dbuf, mcomm[mplan.fsdp_axis], dtype=dtype)


def _reduce_scatter(
    mplan: MeshPlan,
    grads,
    mcomm,
    op: str = "mean",
    dtype: torch.dtype | None = None,
    *,
    data_axes: Sequence[str] = (),
) -> DBuffer:
    """``rg.reduce_scatter(mplan, grads, mcomm, op, dtype, data_axes=...)``: this rank's FSDP
    shard of the reduced gradients of its parts.

    One reduce-scatter(sum) over the FSDP axis (:func:`ragged.reduce_scatter`), then, for each
    axis in ``data_axes``, one all-reduce over that axis of the leaves replicated on it (see
    [Note: data axes]).

    Args:
        mplan: the mesh plan.
        grads: a pytree of the parts' gradients (or a flat ``plan.buffer_numel`` tensor when
            no data axes are given).
        mcomm: this rank's :class:`MeshComm`.
        op: ``"mean"`` (divide by FSDP size x data axis sizes) or ``"sum"``.
        dtype: reduce dtype.
        data_axes: non-FSDP axes that split the batch (e.g. ``("ep",)``).

    Returns:
        A :class:`~ragged.DBuffer` of ``mplan.plan``.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec, parallel
        >>> mesh = spec.Mesh((2, 2), ("dp", "ep"))
        >>> params = {"experts": torch.zeros(2, 2), "router": torch.zeros(2)}
        >>> mp = spec.make_mesh_plan(params, {"experts": {"ep": spec.Shard(0)}, "router": None}, mesh=mesh, align=1)
        >>> def fn(mc):  # every rank's gradient is 1 + its rank
        ...     g = rg.pytree.map(lambda t: torch.full(t.shape, mc.rank + 1.0), parallel.parts(mp, params, mc.coords))
        ...     out = rg.reduce_scatter(mp, g, mc, op="sum", data_axes=("ep",))
        ...     return {k: v.reshape(-1).tolist() for k, v in rg.gather(mp, out, mc).items()}
        >>> parallel.simulate_mesh(mesh, fn)[0]   # experts: summed over dp (1 + 3); router: over dp and ep
        {'experts': [4.0, 4.0], 'router': [10.0, 10.0]}
    """
    _check_mesh(mplan, mcomm, "reduce_scatter")
    if op not in ("mean", "sum"):
        raise RaggedValueError(f"reduce_scatter: op must be 'mean' or 'sum', got {op!r}.")
    data_axes = _check_data_axes(mplan, data_axes, "reduce_scatter: data_axes entry")
    fsdp = mcomm[mplan.fsdp_axis]
    check_mesh_plan(mplan, mcomm)
    out = reduce_scatter_plan(mplan.plan, grads, fsdp, op="sum", dtype=dtype)
    data, rep = out.data, out.replicated
    n = fsdp.world_size
    for a in data_axes:
        comm = mcomm[a]
        n *= comm.world_size
        picked = frozenset(ml.index for ml in mplan.leaves if a in ml.replicated_on)
        all_reduce_leaves(comm, data, rep, mplan.plan, fsdp.rank, picked)
    if op == "mean" and n > 1:  # see [Note: a division every device rounds alike]
        data.div_(divisor(data, n))
        rep.div_(divisor(rep, n))
    return out


def _global_norm(mplan: MeshPlan, dbuf: DBuffer, mcomm) -> torch.Tensor:
    """``rg.global_norm(mplan, dbuf, mcomm)``: the L2 norm of the whole model that ``dbuf`` (this
    rank's FSDP shard of its parts, e.g. gradients from ``rg.reduce_scatter``) is part of; equal
    on every rank.

    Each element is weighted by 1 / (its number of copies over the non-FSDP axes, i.e. the
    product of the sizes of the axes it is replicated on); the weighted sums are all-reduced over
    the FSDP axis and over every other axis, so each global element counts once. For
    ``rg.optim.clip_by_global_norm(max_norm, comm=mcomm[fsdp_axis], norm=lambda g:
    rg.global_norm(mplan, g, mcomm))``.
    """
    _check_mesh(mplan, mcomm, "global_norm")
    check_mesh_plan(mplan, mcomm)
    copies = {ml.index: math.prod(mcomm[a].world_size for a in ml.replicated_on) for ml in mplan.leaves}
    weights = {i: 1.0 / c for i, c in copies.items() if c > 1}
    return norm([(dbuf, weights)], mcomm[mplan.fsdp_axis], others=[mcomm[a] for a in mplan.other_axes])


register_layout(MeshPlan, LayoutOps(shard=_shard, gather=_gather, reduce_scatter=_reduce_scatter, global_norm=_global_norm))


@dataclasses.dataclass(frozen=True)
class _ReplicatedOn:
    """``is_replicated(path)`` for ``rg.fsdp.make_step(data_groups=...)``: whether the mesh leaf
    at ``path`` is replicated on ``axis`` (a frozen value, so the step caches its positions)."""

    mplan: MeshPlan
    axis: str

    def __call__(self, path: str) -> bool:
        return self.axis in self.mplan.leaf(path).replicated_on


def data_groups(mplan: MeshPlan, mcomm, axes: Sequence[str]) -> tuple[DataGroup, ...]:
    """The ``data_groups`` of :func:`ragged.fsdp.make_step` on units of ``mplan.part_meta()``:
    one :class:`~ragged.fsdp.DataGroup` per data axis named in ``axes``.

    The step reduce-scatters over the FSDP axis; for each axis here (e.g. ``"ep"``) it then
    all-reduces the gradients of the leaves replicated on it, as ``rg.reduce_scatter(mplan, ...,
    data_axes=axes)`` does (see [Note: data axes]).

    Examples:
        >>> from ragged import spec, parallel
        >>> import torch
        >>> mp = spec.make_mesh_plan({"router": torch.empty(4, 8), "experts": torch.empty(4, 8, 8)},
        ...                          {"router": None, "experts": {"ep": spec.Shard(0)}},
        ...                          mesh=spec.Mesh((1, 2), ("dp", "ep")))
        >>> def fn(mc):
        ...     (comm, replicated), = parallel.data_groups(mp, mc, ("ep",))
        ...     return comm.world_size, replicated("['router']"), replicated("['experts']")
        >>> parallel.simulate_mesh(mp.mesh, fn)[0]
        (2, True, False)
    """
    return tuple(DataGroup(mcomm[a], _ReplicatedOn(mplan, a)) for a in _check_data_axes(mplan, axes, "data_groups:"))


def _unshard_axis(pieces: list[torch.Tensor], dim: int, groups: int) -> torch.Tensor:
    if groups == 1:
        return torch.cat(pieces, dim=dim)
    chunk = pieces[0].shape[dim] // groups
    return torch.cat([p.unflatten(dim, (groups, chunk)) for p in pieces], dim=dim + 1).flatten(dim, dim + 1)


def full_params(mplan: MeshPlan, dbuf: DBuffer, mcomm):
    """The global tensors (for tests, export and checkpoints): an all-gather over the FSDP axis,
    then one all-gather per TP/EP axis (last mesh axis first), undoing each ``Shard``.

    Every rank returns the same tree. Not differentiable (detached).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> mesh = spec.Mesh((2, 2), ("dp", "tp"))
        >>> params = {"w": torch.randn(8, 6), "b": torch.randn(6)}
        >>> mp = spec.make_mesh_plan(params, {"w": {"tp": spec.Shard(1)}, "b": None}, mesh=mesh)
        >>> def fn(mc):
        ...     full = rg.parallel.full_params(mp, rg.shard(mp, params, mc), mc)
        ...     return all(torch.equal(full[k], params[k]) for k in params)
        >>> rg.parallel.simulate_mesh(mesh, fn)
        [True, True, True, True]
    """
    check_mplan(mplan, "full_params")
    _check_mesh(mplan, mcomm, "full_params")
    check_mesh_plan(mplan, mcomm)
    with torch.no_grad():
        full_parts = gather_plan(dbuf.replace(data=dbuf.data.detach(), replicated=dbuf.replicated.detach()),
                                    mcomm[mplan.fsdp_axis])
        tensors = [t.clone() for t in mplan.treedef.flatten_up_to(full_parts)]
        for axis in reversed(mplan.other_axes):
            comm = mcomm[axis]
            entries = [(ml, [s for s in ml.shards if s[0] == axis][0]) for ml in mplan.leaves if ml.sharded_on(axis)]
            if not entries:
                continue
            flat = torch.cat([tensors[ml.index].reshape(-1) for ml, _ in entries])
            m = comm.world_size
            out = torch.empty(m * flat.numel(), dtype=flat.dtype, device=flat.device)
            comm.all_gather_into(out, flat)
            rows = out.view(m, flat.numel())
            pos = 0
            for ml, (_, dim, groups, _) in entries:
                t = tensors[ml.index]
                k = t.numel()
                pieces = [rows[j, pos : pos + k].view(t.shape) for j in range(m)]
                tensors[ml.index] = _unshard_axis(pieces, dim, groups)
                pos += k
    return optree.tree_unflatten(mplan.treedef, tensors)


def to_dtensor(mplan: MeshPlan, part_tree, device_mesh):
    """Wraps parts as ``DTensor`` s over the non-FSDP sub-mesh, for DTensor-based TP code
    (``DTensor.from_local(part, device_mesh[tp], [Shard(d)])``).

    Differentiable: gradients flow back to the parts (and from there through ``rg.gather`` to
    the FSDP shard).

    Args:
        mplan: the mesh plan.
        part_tree: the parts, e.g. from ``rg.gather(mplan, dbuf, mcomm)``.
        device_mesh: the torch ``DeviceMesh`` of the whole mesh (or ``mcomm.device_mesh``).

    Returns:
        A tree like ``part_tree`` of DTensors (global shape = the leaf's shape), or the tensors
        themselves when the mesh has only the FSDP axis.

    Raises:
        ValueError: a strided ``Shard(dim, groups>1)`` leaf (DTensor has no public placement
            for it; use the part directly).
    """
    # DTensor (torch.distributed.tensor) only when exporting to it, not with import ragged
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    check_mplan(mplan, "to_dtensor")
    others = mplan.other_axes
    if not others:
        return part_tree
    sub = device_mesh[others[0]] if len(others) == 1 else device_mesh[others]
    leaves = mplan.treedef.flatten_up_to(part_tree)
    out = []
    for ml, t in zip(mplan.leaves, leaves):
        placements = []
        for a in others:
            s = [x for x in ml.shards if x[0] == a]
            if not s:
                placements.append(DReplicate())
                continue
            _, dim, groups, _ = s[0]
            if groups != 1:
                raise RaggedValueError(
                    f"to_dtensor: {ml.path} is Shard({dim}, groups={groups}) on {a!r}; DTensor has no public strided "
                    "placement. Fix: use the part itself for this leaf (e.g. split Q, K, V in the part)."
                )
            placements.append(DShard(dim))
        stride = tuple(math.prod(ml.shape[i + 1 :]) for i in range(len(ml.shape)))
        out.append(DTensor.from_local(t, sub, placements, run_check=False, shape=torch.Size(ml.shape), stride=stride))
    return optree.tree_unflatten(mplan.treedef, out)
