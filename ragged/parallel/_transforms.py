"""FSDP over one axis of an N-D mesh: shard / gather / reduce_scatter of TP/EP-local tensors,
reassembly of global tensors, and export to DTensor.

[Note: data axes]
The FSDP axis always splits the batch: ``reduce_scatter`` sums over it. Another axis may split
the batch too: an EP axis usually does (each EP rank routes its own tokens; experts see tokens
of every EP rank through the all-to-all, so an expert's gradient is already complete, but a
parameter *replicated* on the EP axis, such as the router, holds only its own tokens' part).
``reduce_scatter(..., data_axes=("ep",))`` therefore all-reduces, over each data axis, exactly
the leaves replicated on it (one extra all-reduce of just those elements), and ``"mean"``
divides every leaf by ``fsdp size x prod(data axis sizes)``. TP axes are not data axes: with
``copy_to`` / ``reduce_from`` (see [Note: f and g]) gradients of TP-replicated leaves are
already equal across TP ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import optree
import torch

from ragged._dbuffer import DBuffer
from ragged.spec._mesh import MeshPlan, local_part
from ragged.transforms import gather as _gather
from ragged.transforms import reduce_scatter as _reduce_scatter
from ragged.transforms import shard as _shard
from ragged.transforms._reduce_scatter import all_reduce_leaves
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["local_params", "shard", "gather", "reduce_scatter", "full_params", "to_dtensor", "global_norm",
           "step_data_axes"]


def _check_mplan(mplan, where):
    if not isinstance(mplan, MeshPlan):
        raise RaggedTypeError(f"{where}: mplan must be a ragged.spec.MeshPlan (from spec.make_mesh_plan), got {type(mplan).__name__}.")


def _check_mesh(mplan: MeshPlan, mcomm, where):
    if tuple(mcomm.mesh.names) != mplan.mesh.names or tuple(mcomm.mesh.shape) != mplan.mesh.shape:
        raise RaggedValueError(
            f"{where}: the plan is for mesh {mplan.mesh.shape} {mplan.mesh.names} but the MeshComm's mesh is "
            f"{mcomm.mesh.shape} {mcomm.mesh.names}. Fix: plan with spec.make_mesh_plan(..., mesh=mcomm.mesh)."
        )


# [Note: mesh plan check]
# ``rg.shard`` / ``rg.gather`` compare the FSDP plan within the FSDP group only. Ranks of one TP
# group that planned different placements (or shapes) would issue TP collectives of different
# sizes. So ``shard``, ``reduce_scatter``, ``full_params``, ``to_global`` and ``from_global`` first
# make the whole mesh (``mcomm.world``) agree on the mesh plan's fingerprint, as the flat
# transforms do (see [Note: plan check before collectives] in ragged/transforms/_check.py: one
# all-reduce of two int64s, every call or, with ``world.plan_check == "first_use"``, once per
# plan), and raise :class:`~ragged.PlanMismatchError` on every rank if any differ, naming what.
def check_mesh_plan(mplan: MeshPlan, mcomm) -> None:
    """See [Note: mesh plan check]. A no-op without ``mcomm.world``."""
    from ragged.transforms._check import ranks_agree

    world = getattr(mcomm, "world", None)
    if world is None:
        return
    fp = mplan.fingerprint()
    if getattr(world, "plan_check", "every_call") == "first_use" and fp in mcomm.checked_plans:
        return
    if not ranks_agree(world, fp):
        summary = (fp, {l.path: (l.shape, l.local_shape, repr(l.granularity), l.shards) for l in mplan.leaves})
        everything = world.all_gather_object(summary)
        other_rank, other = next((r, s) for r, s in enumerate(everything) if s[0] != everything[0][0])
        first = everything[0][1]
        diffs = [
            f"{p}: {first.get(p)} vs {other[1].get(p)}" for p in sorted(set(first) | set(other[1]))
            if first.get(p) != other[1].get(p)
        ]
        from ragged._errors import PlanMismatchError

        raise PlanMismatchError(
            f"ranks hold different mesh plans: rank 0 vs rank {other_rank} differ in "
            f"{'; '.join(diffs[:3]) or 'mesh, FSDP axis or planning options'} (path: (shape, local shape, "
            "granularity, shards)). Fix: build the mesh plan identically on every rank."
        )
    mcomm.checked_plans.add(fp)


def local_params(mplan: MeshPlan, params, coords: Mapping[str, int]):
    """The TP/EP-local part of every leaf of ``params`` (global tensors) at mesh ``coords``.

    Pure and local (views where possible); the FSDP axis is ignored.

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> import ragged as rg
        >>> mp = spec.make_mesh_plan({"w": torch.empty(4, 2)}, spec.Shard(0), mesh=spec.Mesh((1, 2), ("dp", "tp")))
        >>> rg.parallel.local_params(mp, {"w": torch.arange(8.0).view(4, 2)}, {"tp": 1})["w"].tolist()
        [[4.0, 5.0], [6.0, 7.0]]
    """
    _check_mplan(mplan, "local_params")
    leaves = mplan.treedef.flatten_up_to(params)
    out = []
    for ml, t in zip(mplan.leaves, leaves):
        if tuple(t.shape) != ml.shape:
            from ragged._errors import LayoutError

            raise LayoutError(
                f"params{ml.path} has shape {tuple(t.shape)} but the mesh plan expects the global shape {ml.shape}. "
                "Fix: pass the global (unsharded) tensors the plan was made from.",
                path=ml.path, shape=t.shape,
            )
        out.append(local_part(t, ml, coords))
    return optree.tree_unflatten(mplan.treedef, out)


def shard(mplan: MeshPlan, params, mcomm) -> DBuffer:
    """This rank's DBuffer: the FSDP shard of its TP/EP-local tensors.

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
        ...     return parallel.shard(mp, {"w": w}, mc).views()["w"][:, 0].tolist()
        >>> parallel.simulate_mesh(mesh, fn)   # ranks (dp, tp) = (0,0) (0,1) (1,0) (1,1)
        [[0.0, 4.0], [16.0, 20.0], [8.0, 12.0], [24.0, 28.0]]
    """
    _check_mplan(mplan, "shard")
    _check_mesh(mplan, mcomm, "shard")
    local = local_params(mplan, params, mcomm.coords)
    check_mesh_plan(mplan, mcomm)
    return _shard(mplan.plan, local, mcomm[mplan.fsdp_axis])


def gather(dbuf: DBuffer, mcomm, dtype: torch.dtype | None = None, *, fsdp_axis: str = "dp"):
    """The TP/EP-local full tensors: one all-gather over the FSDP axis only.

    Differentiable like :func:`ragged.gather` (backward: reduce-scatter over the FSDP axis).

    Args:
        dbuf: this rank's shard.
        mcomm: this rank's :class:`MeshComm`.
        dtype: compute dtype.
        fsdp_axis: the plan's FSDP axis.
    """
    return _gather(dbuf, mcomm[fsdp_axis], dtype)


def reduce_scatter(
    mplan: MeshPlan,
    grads,
    mcomm,
    op: str = "mean",
    dtype: torch.dtype | None = None,
    *,
    data_axes: Sequence[str] = (),
) -> DBuffer:
    """This rank's FSDP shard of the reduced TP/EP-local gradients.

    One reduce-scatter(sum) over the FSDP axis (:func:`ragged.reduce_scatter`), then, for each
    axis in ``data_axes``, one all-reduce over that axis of the leaves replicated on it (see
    [Note: data axes]).

    Args:
        mplan: the mesh plan.
        grads: a pytree of TP/EP-local gradients (or a flat ``plan.buffer_numel`` tensor when
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
        ...     g = rg.pytree.map(lambda t: torch.full(t.shape, mc.rank + 1.0), parallel.local_params(mp, params, mc.coords))
        ...     out = parallel.reduce_scatter(mp, g, mc, op="sum", data_axes=("ep",))
        ...     return {k: v.reshape(-1).tolist() for k, v in parallel.gather(out, mc).items()}
        >>> parallel.simulate_mesh(mesh, fn)[0]   # experts: summed over dp (1 + 3); router: over dp and ep
        {'experts': [4.0, 4.0], 'router': [10.0, 10.0]}
    """
    _check_mplan(mplan, "reduce_scatter")
    _check_mesh(mplan, mcomm, "reduce_scatter")
    if op not in ("mean", "sum"):
        raise RaggedValueError(f"reduce_scatter: op must be 'mean' or 'sum', got {op!r}.")
    data_axes = tuple(data_axes)
    for a in data_axes:
        if a not in mplan.other_axes:
            raise RaggedValueError(
                f"reduce_scatter: data_axes entry {a!r} is not a non-FSDP axis of the mesh "
                f"({mplan.other_axes}); the FSDP axis {mplan.fsdp_axis!r} is always reduced."
            )
    fsdp = mcomm[mplan.fsdp_axis]
    check_mesh_plan(mplan, mcomm)
    out = _reduce_scatter(mplan.plan, grads, fsdp, op="sum", dtype=dtype)
    data, rep = out.data, out.replicated
    n = fsdp.world_size
    for a in data_axes:
        comm = mcomm[a]
        n *= comm.world_size
        picked = frozenset(ml.index for ml in mplan.leaves if a in ml.replicated_on)
        all_reduce_leaves(comm, data, rep, mplan.plan, fsdp.rank, picked)
    if op == "mean" and n > 1:
        data.div_(n)
        rep.div_(n)
    return out


def global_norm(mplan: MeshPlan, dbuf: DBuffer, mcomm) -> torch.Tensor:
    """The L2 norm of the whole model that ``dbuf`` (this rank's FSDP shard of its TP/EP-local
    tensors, e.g. gradients from :func:`reduce_scatter`) is part of; equal on every rank.

    Each element is weighted by 1 / (its number of copies over the non-FSDP axes, i.e. the
    product of the sizes of the axes it is replicated on); the weighted sums are all-reduced over
    the FSDP axis and over every other axis, so each global element counts once. For
    ``rg.optim.clip_by_global_norm(max_norm, comm=mcomm[fsdp_axis], norm=lambda g:
    parallel.global_norm(mplan, g, mcomm))``.
    """
    from ragged.transforms._reduce_scatter import reduce_square_sums, weighted_square_sums

    check_mesh_plan(mplan, mcomm)
    weights = {}
    for ml in mplan.leaves:
        copies = math.prod(mcomm[a].world_size for a in ml.replicated_on)
        if copies > 1:
            weights[ml.index] = 1.0 / copies
    sharded, replicated = weighted_square_sums(mplan.plan, dbuf.data, dbuf.replicated, dbuf.rank, weights)
    others = [mcomm[a] for a in mplan.other_axes]
    return torch.sqrt(reduce_square_sums(sharded, replicated, mcomm[mplan.fsdp_axis], others))


@dataclasses.dataclass(frozen=True)
class _ReplicatedOn:
    """``is_replicated(path)`` for ``rg.fsdp.make_step(data_axes=...)``: whether the mesh leaf
    at ``path`` is replicated on ``axis`` (a frozen value, so the step caches its positions)."""

    mplan: MeshPlan
    axis: str

    def __call__(self, path: str) -> bool:
        return self.axis in self.mplan.leaf(path).replicated_on


def step_data_axes(mplan: MeshPlan, mcomm, axes: Sequence[str]) -> tuple:
    """``data_axes`` for :func:`ragged.fsdp.make_step` on units of ``mplan.local_meta()``.

    The step reduce-scatters over the FSDP axis; for each axis here (e.g. ``"ep"``) it then
    all-reduces the gradients of the leaves replicated on it, as :func:`reduce_scatter` does
    with ``data_axes`` (see [Note: data axes]).

    Examples:
        >>> from ragged import spec, parallel
        >>> import torch
        >>> mp = spec.make_mesh_plan({"router": torch.empty(4, 8), "experts": torch.empty(4, 8, 8)},
        ...                          {"router": None, "experts": {"ep": spec.Shard(0)}},
        ...                          mesh=spec.Mesh((1, 2), ("dp", "ep")))
        >>> def fn(mc):
        ...     (comm, replicated), = parallel.step_data_axes(mp, mc, ("ep",))
        ...     return comm.world_size, replicated("['router']"), replicated("['experts']")
        >>> parallel.simulate_mesh(mp.mesh, fn)[0]
        (2, True, False)
    """
    for a in axes:
        if a not in mplan.other_axes:
            raise RaggedValueError(
                f"step_data_axes: {a!r} is not a non-FSDP axis of the mesh ({mplan.other_axes}); the FSDP axis "
                f"{mplan.fsdp_axis!r} is the step's own comm."
            )
    return tuple((mcomm[a], _ReplicatedOn(mplan, a)) for a in axes)


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
        ...     full = rg.parallel.full_params(mp, rg.parallel.shard(mp, params, mc), mc)
        ...     return all(torch.equal(full[k], params[k]) for k in params)
        >>> rg.parallel.simulate_mesh(mesh, fn)
        [True, True, True, True]
    """
    _check_mplan(mplan, "full_params")
    _check_mesh(mplan, mcomm, "full_params")
    check_mesh_plan(mplan, mcomm)
    with torch.no_grad():
        local = _gather(dbuf.replace(data=dbuf.data.detach(), replicated=dbuf.replicated.detach()), mcomm[mplan.fsdp_axis])
        tensors = [t.clone() for t in mplan.treedef.flatten_up_to(local)]
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


def to_dtensor(mplan: MeshPlan, local_tree, device_mesh):
    """Wraps TP/EP-local tensors as ``DTensor`` s over the non-FSDP sub-mesh, for DTensor-based
    TP code (``DTensor.from_local(local, device_mesh[tp], [Shard(d)])``).

    Differentiable: gradients flow back to the local tensors (and from there through
    :func:`gather` to the FSDP shard).

    Args:
        mplan: the mesh plan.
        local_tree: TP/EP-local tensors, e.g. from :func:`gather`.
        device_mesh: the torch ``DeviceMesh`` of the whole mesh (or ``mcomm.device_mesh``).

    Returns:
        A tree like ``local_tree`` of DTensors (global shape = the leaf's shape), or the tensors
        themselves when the mesh has only the FSDP axis.

    Raises:
        ValueError: a strided ``Shard(dim, groups>1)`` leaf (DTensor has no public placement
            for it; use the local tensor directly).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    _check_mplan(mplan, "to_dtensor")
    others = mplan.other_axes
    if not others:
        return local_tree
    sub = device_mesh[others[0]] if len(others) == 1 else device_mesh[others]
    leaves = mplan.treedef.flatten_up_to(local_tree)
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
                    "placement. Fix: use the local tensor for this leaf (e.g. split Q, K, V locally)."
                )
            placements.append(DShard(dim))
        stride = tuple(math.prod(ml.shape[i + 1 :]) for i in range(len(ml.shape)))
        out.append(DTensor.from_local(t, sub, placements, run_check=False, shape=torch.Size(ml.shape), stride=stride))
    return optree.tree_unflatten(mplan.treedef, out)
