"""Data groups: the other groups of ranks that split the batch besides the shard group.

A *data axis* is a mesh axis, named by a string, whose ranks see different data (the FSDP
axis always is one; an EP axis usually is; see [Note: data axes] in
``ragged/parallel/_transforms.py``). ``rg.fsdp`` knows no mesh: it takes each extra data axis
as a :class:`DataGroup`, that axis's ``comm`` and which parameters are replicated over it
(``parallel.data_groups(mplan, mcomm, ("ep",))`` builds them from a mesh plan). After the
reduce-scatter over the shard group, the gradients of the replicated parameters are
all-reduced over each data group and every gradient is divided by its size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ragged._errors import RaggedTypeError
from ragged.fsdp._units import picked_leaves
from ragged.transforms._reduce_scatter import all_reduce_leaves

__all__ = ["DataGroup", "data_groups_option", "reduce_over_data_groups"]


class DataGroup(NamedTuple):
    """One extra data axis of a step: its ``comm`` and ``is_replicated(path) -> bool`` (the
    parameters that hold a copy on every rank of it, paths as in the units).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp, parallel, spec
        >>> mplan = spec.make_mesh_plan({"router": torch.empty(2, 4), "experts": torch.empty(2, 4, 4)},
        ...                             {"router": None, "experts": {"ep": spec.Shard(0)}}, mesh=spec.Mesh((1, 2), ("dp", "ep")))
        >>> def fn(mc):
        ...     (group,) = parallel.data_groups(mplan, mc, ("ep",))
        ...     return isinstance(group, fsdp.DataGroup), group.is_replicated("['router']"), group.is_replicated("['experts']")
        >>> parallel.simulate_mesh(mplan.mesh, fn)[0]
        (True, True, False)
    """

    comm: Any
    is_replicated: Callable[[str], bool]


def data_groups_option(data_groups: Sequence, where: str) -> tuple[DataGroup, ...]:
    """The ``data_groups=`` argument of ``where`` as DataGroups.

    Raises:
        RaggedTypeError: an entry that is not a ``(comm, is_replicated)`` pair.
    """
    out = []
    for entry in data_groups:
        try:
            comm, pred = entry
        except (TypeError, ValueError):
            raise RaggedTypeError(f"{where}: data_groups entries are (comm, is_replicated(path) -> bool) pairs, got "
                                  f"{type(entry).__name__}.") from None
        if not callable(pred) or not hasattr(comm, "all_reduce"):
            raise RaggedTypeError(f"{where}: data_groups entries are (comm, is_replicated(path) -> bool) pairs, got "
                                  f"({type(comm).__name__}, {type(pred).__name__}).")
        out.append(DataGroup(comm, pred))
    return tuple(out)


def reduce_over_data_groups(unit, grad, data_groups: Sequence[DataGroup]) -> None:
    """In place on ``unit``'s gradient shard ``grad`` (over its trainable plan, after its reduce-scatter): the replicated
    parameters' gradients summed over each data group, then everything divided by its size."""
    for group in data_groups:
        all_reduce_leaves(group.comm, grad.data, grad.replicated, grad.plan, grad.rank,
                          picked_leaves(unit, group.is_replicated))
        grad.data.div_(group.comm.world_size)
        grad.replicated.div_(group.comm.world_size)
