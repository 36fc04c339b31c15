"""What a training step threads and how it is made and read: :class:`TrainState`, :func:`init`,
:func:`shard`, :func:`gather` and the whole-model :func:`global_norm` over ``{unit name: DBuffer}``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ragged import transforms
from ragged._dbuffer import DBuffer
from ragged.fsdp._units import Units, picked_leaves
from ragged.fsdp._donate import check_not_donated
from ragged.transforms._reduce_scatter import reduce_square_sums, weighted_square_sums

__all__ = ["TrainState", "shard", "gather", "init", "global_norm"]


class TrainState(NamedTuple):
    """What a step threads: this rank's parameter shards (``{unit name: DBuffer}``) and the
    optimizer state over them."""

    shards: dict[str, DBuffer]
    opt_state: Any


def shard(units: Units, params, comm) -> dict[str, DBuffer]:
    """This rank's shard of every unit (``params``: the full tree or the module, same on
    every rank).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> params = {"a": torch.arange(6.0).view(3, 2), "b": torch.ones(4)}
        >>> units = fsdp.make_units(params, world_size=2, groups=lambda p: p)
        >>> def fn(comm):
        ...     return {k: v.data.tolist() for k, v in fsdp.shard(units, params, comm).items()}
        >>> rg.collectives.simulate(2, fn)[1]["['a']"]
        [4.0, 5.0, 0.0, 0.0]
    """
    trees = units.split(params)
    return {u.name: transforms.shard(u.plan, {p: t.detach() for p, t in trees[u.name].items()}, comm) for u in units}


def gather(units: Units, shards: dict[str, DBuffer], comm, dtype: torch.dtype | None = None):
    """The full parameter tree (e.g. ``{name: tensor}`` for a module), not differentiable;
    each unit's leaves are views of that unit's gathered buffer."""
    check_not_donated(shards, "fsdp.gather")
    with torch.no_grad():
        return units.merge({u.name: transforms.gather(shards[u.name], comm, dtype=dtype) for u in units})


def global_norm(units: Units, grads: dict[str, DBuffer], comm, *, data_axes=()) -> torch.Tensor:
    """The L2 norm of a whole model's gradients ``{unit name: DBuffer}``, equal on every rank.

    Without ``data_axes`` it is :func:`ragged.optim.global_norm` over ``comm``. With the
    ``data_axes`` of :func:`make_step` (e.g. expert parallelism), the other ranks of each data
    axis hold other parameters (their experts) as well as copies of the replicated ones (router,
    norms): each element is weighted by 1 / (its number of copies over the data axes), and the
    weighted sums are all-reduced over ``comm`` and over every data axis, so every element counts
    once. For ``rg.optim.clip_by_global_norm(max_norm, comm=comm, norm=lambda g:
    fsdp.global_norm(units, g, comm, data_axes=data_axes))``.
    """
    data_axes = tuple(data_axes)
    sharded = replicated = 0.0
    for u in units:
        d = grads[u.name]
        weights: dict[int, float] = {}
        for axis_comm, is_replicated in data_axes:
            for i in picked_leaves(u, is_replicated):
                weights[i] = weights.get(i, 1.0) / axis_comm.world_size
        s, r = weighted_square_sums(u.plan, d.data, d.replicated, d.rank, weights)
        sharded, replicated = sharded + s, replicated + r
    return torch.sqrt(reduce_square_sums(sharded, replicated, comm, [c for c, _ in data_axes]))


def init(units: Units, params, optimizer, comm) -> TrainState:
    """Shards ``params`` and initialises ``optimizer`` over the shards."""
    shards = shard(units, params, comm)
    return TrainState(shards, optimizer.init(shards))
