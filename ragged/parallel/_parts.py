"""Parts: what one position of the non-FSDP axes (TP, EP) holds of each leaf.

The tensor side of a :class:`~ragged.spec.MeshPlan` (``spec`` holds no tensor data): cutting
global tensors into parts (:func:`parts`), and the strided bookkeeping of [Note: strided
placements] (:func:`part_index`: which global element every element of a part is).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import optree
import torch

from ragged._errors import LayoutError, RaggedTypeError
from ragged.spec._mesh_plan import MeshLeaf, MeshPlan

__all__ = ["parts", "part_index", "part_of", "check_mplan"]


def check_mplan(mplan, where: str) -> None:
    if not isinstance(mplan, MeshPlan):
        raise RaggedTypeError(f"{where}: mplan must be a ragged.spec.MeshPlan (from spec.make_mesh_plan), got {type(mplan).__name__}.")


def part_of(t: torch.Tensor, leaf: MeshLeaf, coords: Mapping[str, int]) -> torch.Tensor:
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


def part_index(leaf: MeshLeaf, coords: Mapping[str, int], *, dtype=torch.int64) -> torch.Tensor:
    """Global flat element index of every element of ``leaf``'s part at ``coords``.

    The strided bookkeeping of [Note: strided placements]: element ``i`` of the flattened part
    is element ``part_index(leaf, coords)[i]`` of the flattened global tensor.

    Examples:
        >>> import torch
        >>> from ragged import spec, parallel
        >>> mp = spec.make_mesh_plan({"w": torch.empty(4, 2)}, {"w": spec.Placements(tp=spec.Shard(1))},
        ...                          mesh=spec.Mesh((1, 2), ("dp", "tp")))
        >>> parallel.part_index(mp.leaves[0], {"dp": 0, "tp": 1}).tolist()
        [1, 3, 5, 7]
    """
    # One index vector per dim, narrowed like the tensor (O(part numel), never the global).
    ndim = len(leaf.shape)
    if ndim == 0:
        return torch.zeros(1, dtype=dtype)
    per_dim = [torch.arange(n, dtype=dtype) for n in leaf.shape]
    for axis, dim, groups, size in leaf.shards:
        n = per_dim[dim].numel()
        chunk = n // groups // size
        c = int(coords[axis])
        per_dim[dim] = per_dim[dim].view(groups, n // groups)[:, c * chunk : (c + 1) * chunk].reshape(-1)
    strides = [math.prod(leaf.shape[i + 1 :]) for i in range(ndim)]
    index = torch.zeros(leaf.part_shape, dtype=dtype)
    for i, (idx, st) in enumerate(zip(per_dim, strides)):
        index += (idx * st).view([-1 if j == i else 1 for j in range(ndim)])
    return index.reshape(-1)


def parts(mplan: MeshPlan, params, coords: Mapping[str, int]):
    """The part of every leaf of ``params`` (global tensors) at mesh ``coords``.

    Pure and local (views where possible); the FSDP axis is ignored.

    Examples:
        >>> import torch
        >>> from ragged import spec, parallel
        >>> mp = spec.make_mesh_plan({"w": torch.empty(4, 2)}, spec.Shard(0), mesh=spec.Mesh((1, 2), ("dp", "tp")))
        >>> parallel.parts(mp, {"w": torch.arange(8.0).view(4, 2)}, {"tp": 1})["w"].tolist()
        [[4.0, 5.0], [6.0, 7.0]]
    """
    check_mplan(mplan, "parts")
    leaves = mplan.treedef.flatten_up_to(params)
    out = []
    for ml, t in zip(mplan.leaves, leaves):
        if tuple(t.shape) != ml.shape:
            raise LayoutError(
                f"params{ml.path} has shape {tuple(t.shape)} but the mesh plan expects the global shape {ml.shape}. "
                "Fix: pass the global (unsharded) tensors the plan was made from.",
                path=ml.path, shape=t.shape,
            )
        out.append(part_of(t, ml, coords))
    return optree.tree_unflatten(mplan.treedef, out)
