"""Conversion between a mesh layout (FSDP x TP/EP) and a global ragged layout (checkpoints).

[Note: checkpoints of a mesh run are global]
A rank of an FSDP x TP run holds FSDP pieces of parts: strided sets of global
elements (see [Note: strided placements]). ``to_global`` moves every element to its place
in a plain :class:`~ragged.LayoutPlan` of the *global* shapes over every rank of the mesh
(``global_plan``), with one all-to-all over the whole mesh (each element is sent once, by the
rank at coordinate 0 of every axis the leaf is replicated on). The result is an ordinary
DBuffer: ``rg.checkpoint.save`` writes it as one 1-D tensor per leaf, so the checkpoint is
independent of the mesh and loads on any world size or mesh (``rg.checkpoint.load`` into a
plain plan, or into ``global_plan`` and then ``from_global`` onto another mesh).
``from_global`` is the inverse: each rank requests the global positions of its own elements
from their owners (all-to-all of positions, then of values). Both run on any pytree of
DBuffers (params, optimizer moments); other leaves pass through unchanged. Cost: besides the
all-to-all of the values, an int64 position per element is built and exchanged (about 4x the
fp32 state in transient memory and traffic); fine for checkpoints of small and medium
models, not tuned for very large ones (writing strided pieces straight as DCP chunks would
avoid it).
"""

from __future__ import annotations

import functools

import optree
import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._pytree import pytree
from ragged.spec._granularity import Replicate, Rows
from ragged.spec._mesh_plan import MeshPlan
from ragged.spec._plan import LayoutPlan
from ragged.spec._planning import make_plan
from ragged.parallel._parts import part_index
from ragged.parallel._transforms import check_mesh_plan
from ragged.spec._concat import replicated_size
from ragged._errors import RaggedValueError

__all__ = ["global_plan", "to_global", "from_global"]


def global_plan(mplan: MeshPlan, world_size: int | None = None) -> LayoutPlan:
    """A plain ragged plan of the global shapes over ``world_size`` ranks (default: the whole
    mesh): FSDP granularities kept, ``Replicate()`` leaves sharded as ``Rows(1)``.

    Examples:
        >>> import torch
        >>> from ragged import spec, parallel
        >>> mp = spec.make_mesh_plan({"w": torch.empty(8, 4)}, spec.Shard(0), mesh=spec.Mesh((2, 2), ("dp", "tp")))
        >>> gp = parallel.global_plan(mp)
        >>> gp.world_size, gp.leaves[0].shape
        (4, (8, 4))
    """
    world_size = mplan.mesh.size if world_size is None else world_size
    shapes = optree.tree_unflatten(mplan.treedef, [torch.empty(l.shape, dtype=l.dtype, device="meta") for l in mplan.leaves])
    grans = optree.tree_unflatten(
        mplan.treedef, [Rows(1) if isinstance(l.granularity, Replicate) else l.granularity for l in mplan.leaves]
    )
    return make_plan(shapes, grans, world_size=world_size, dtype=mplan.plan.dtype)


def _coords_key(coords) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in coords.items()))


@functools.lru_cache(maxsize=2)  # index tensors: 16 bytes per local element, keep few
def _local_map(mplan: MeshPlan, gplan: LayoutPlan, coords: tuple, canonical_only: bool):
    """(local positions in cat(data, replicated), global buffer positions) of this rank's
    elements; with ``canonical_only`` only elements this rank is the designated sender of."""
    coords = dict(coords)
    plan = mplan.plan
    fsdp_rank = coords[mplan.fsdp_axis]
    S = plan.shard_size
    gleaf = {l.index: l for l in gplan.leaves}
    pieces = {}
    for p in plan.local_pieces(fsdp_rank):
        pieces.setdefault(p.leaf.index, []).append(p)
    rep = {l.index: l for l in plan.replicated}
    src, dst = [], []
    for ml in mplan.leaves:
        if canonical_only and any(coords[a] != 0 for a in ml.replicated_on):
            continue
        if ml.index in rep and canonical_only and fsdp_rank != 0:
            continue
        gidx = part_index(ml, coords)
        off = gleaf[ml.index].offset
        if ml.index in rep:
            l = rep[ml.index]
            src.append(torch.arange(S + l.offset, S + l.stop))
            dst.append(gidx + off)
        for p in pieces.get(ml.index, ()):
            src.append(torch.arange(p.local_offset, p.local_offset + p.numel))
            dst.append(gidx[p.start : p.stop] + off)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)
    return cat(src), cat(dst)


def _routes(mplan: MeshPlan, gplan: LayoutPlan, mcomm, canonical_only: bool):
    """Where this rank's elements go in ``gplan`` (``to_global``) or come from (``from_global``):
    ``(local positions sorted by their owner rank in gplan, per-owner counts, counts from every
    rank, the offsets in this rank's gplan shard that the other ranks asked for)``; one exchange
    of counts and one of offsets over ``mcomm.world`` (any number of buffers: ``plan.locate``)."""
    world = mcomm.world
    W = world.world_size
    mine, positions = _local_map(mplan, gplan, _coords_key(mcomm.coords), canonical_only)
    owner, local = gplan.locate(positions)
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=W) if positions.numel() else torch.zeros(W, dtype=torch.int64)
    recv_counts = torch.empty(W, dtype=torch.int64)
    world.all_to_all(recv_counts, counts.to(torch.int64), [1] * W, [1] * W)
    theirs = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
    world.all_to_all(theirs, local[order], recv_counts.tolist(), counts.tolist())
    return mine[order], counts, recv_counts, theirs


def _check(mplan, mcomm, where):
    if mcomm.world is None:
        raise RaggedValueError(f"{where} needs mcomm.world (a Collectives over every rank of the mesh); this MeshComm has none.")
    if mcomm.world.world_size != mplan.mesh.size or mcomm.world.rank != mplan.mesh.rank(mcomm.coords):
        raise RaggedValueError(
            f"{where}: mcomm.world (rank {mcomm.world.rank} of {mcomm.world.world_size}) does not match the mesh "
            f"{mplan.mesh.shape} at {dict(mcomm.coords)} (row-major rank {mplan.mesh.rank(mcomm.coords)})."
        )


def to_global(mplan: MeshPlan, tree, mcomm, *, plan: LayoutPlan | None = None):
    """Every DBuffer of ``mplan.plan`` in ``tree`` moved to ``plan`` (default
    ``global_plan(mplan)``) over every rank of the mesh; other leaves unchanged.

    See [Note: checkpoints of a mesh run are global].

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec, parallel
        >>> mesh = spec.Mesh((2, 2), ("dp", "tp"))
        >>> w = torch.arange(24.0).view(4, 6)
        >>> mp = spec.make_mesh_plan({"w": w}, spec.Shard(1), mesh=mesh)
        >>> def fn(mc):
        ...     g = parallel.to_global(mp, rg.shard(mp, {"w": w}, mc), mc)
        ...     return g.data.tolist()
        >>> parallel.simulate_mesh(mesh, fn)[1]   # global rows 2-3 (S = 12 elements per rank)
        [12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 19.0, 20.0, 21.0, 22.0, 23.0]
    """
    _check(mplan, mcomm, "to_global")
    check_mesh_plan(mplan, mcomm)
    gplan = global_plan(mplan) if plan is None else plan
    world = mcomm.world
    W, Sg = world.world_size, gplan.shard_size
    if gplan.world_size != W:
        raise RaggedValueError(f"to_global: plan.world_size={gplan.world_size} but the mesh has {W} ranks.")
    src, counts, recv_counts, recv_pos = _routes(mplan, gplan, mcomm, True)
    n_in = recv_pos.numel()

    def convert(d):
        if not isinstance(d, DBuffer) or d.plan != mplan.plan:
            return d
        flat = torch.cat([d.data.detach(), d.replicated.detach()])
        vals = flat[src.to(flat.device)]
        recv = torch.empty(n_in, dtype=flat.dtype, device=flat.device)
        world.all_to_all(recv, vals, recv_counts.tolist(), counts.tolist())
        data = torch.zeros(Sg, dtype=flat.dtype, device=flat.device)
        data[recv_pos.to(flat.device)] = recv
        rep = torch.zeros(replicated_size(gplan), dtype=flat.dtype, device=flat.device)
        return DBuffer(data=data, replicated=rep, plan=gplan, rank=world.rank)

    return pytree.map(convert, tree, is_leaf=is_dbuffer)


def from_global(mplan: MeshPlan, tree, mcomm):
    """Inverse of :func:`to_global`: every DBuffer of a global plan (any plain plan of the same
    leaves over every rank of the mesh) in ``tree`` becomes this rank's DBuffer of
    ``mplan.plan``; other leaves unchanged.

    Raises:
        ValueError: a DBuffer that is not of a global plan of this mesh's ranks.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec, parallel
        >>> mesh = spec.Mesh((2, 2), ("dp", "tp"))
        >>> w = torch.randn(4, 6)
        >>> mp = spec.make_mesh_plan({"w": w}, spec.Shard(1), mesh=mesh)
        >>> def fn(mc):
        ...     d = rg.shard(mp, {"w": w}, mc)
        ...     return torch.equal(parallel.from_global(mp, parallel.to_global(mp, d, mc), mc).data, d.data)
        >>> parallel.simulate_mesh(mesh, fn)
        [True, True, True, True]
    """
    _check(mplan, mcomm, "from_global")
    check_mesh_plan(mplan, mcomm)
    world = mcomm.world
    W = world.world_size
    fsdp_rank = mcomm.coords[mplan.fsdp_axis]
    S = mplan.plan.shard_size
    R = replicated_size(mplan.plan)
    cache = {}

    def convert(d):
        if not isinstance(d, DBuffer):
            return d
        gplan = d.plan
        if gplan.world_size != W or gplan.replicated or d.rank != world.rank:
            raise RaggedValueError(
                f"from_global: a DBuffer of {gplan!r} at rank {d.rank} is not a global DBuffer of this mesh "
                f"({W} ranks, this is rank {world.rank}; global plans shard every leaf). Fix: load the checkpoint "
                "into DBuffers of parallel.global_plan(mplan) (see parallel.to_global)."
            )
        if gplan not in cache:
            _check_same_leaves(mplan, gplan)
            cache[gplan] = _routes(mplan, gplan, mcomm, False)
        dst, counts, recv_counts, req = cache[gplan]
        src = d.data.detach()
        vals = src[req.to(src.device)]
        got = torch.empty(int(counts.sum()), dtype=src.dtype, device=src.device)
        world.all_to_all(got, vals, counts.tolist(), recv_counts.tolist())
        flat = torch.zeros(S + R, dtype=src.dtype, device=src.device)
        flat[dst.to(src.device)] = got
        return DBuffer(data=flat[:S].clone(), replicated=flat[S:].clone(), plan=mplan.plan, rank=fsdp_rank)

    return pytree.map(convert, tree, is_leaf=is_dbuffer)


def _check_same_leaves(mplan: MeshPlan, gplan: LayoutPlan) -> None:
    want = {l.path: l.shape for l in mplan.leaves}
    have = {l.path: l.shape for l in gplan.leaves}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))
        raise RaggedValueError(
            f"from_global: the global plan's leaves differ from the mesh plan's global shapes: {diff[:4]}. "
            "Fix: load the checkpoint into parallel.global_plan(mplan) first."
        )
