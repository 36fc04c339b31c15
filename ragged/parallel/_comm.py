"""`MeshComm`: one rank's collectives over every axis of an N-D mesh (gloo/NCCL or simulated).

[Note: one Collectives per mesh axis]
ragged's transforms talk to a 1-D :class:`~ragged.collectives.Collectives`. On an N-D mesh a
rank belongs to one group per axis (its FSDP group, its TP group, ...). A ``MeshComm`` holds
one ``Collectives`` per axis (``mcomm["dp"]``, ``mcomm["tp"]``) and one over every rank of the
mesh (``mcomm.world``, used only to convert to and from a global layout for checkpoints), plus
this rank's coordinates. FSDP collectives run on ``mcomm[plan.fsdp_axis]`` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ragged.collectives import from_torch
from ragged.collectives._simulated import SimulatedCollectives, _Group, run_ranks
from ragged.spec._mesh import Mesh
from ragged._errors import RaggedKeyError, RaggedValueError

__all__ = ["MeshComm", "from_device_mesh", "simulate_mesh"]


@dataclasses.dataclass(frozen=True, eq=False)
class MeshComm:
    """One rank's view of an N-D mesh: a Collectives per axis, one over the whole mesh.

    Attributes:
        mesh: the :class:`~ragged.spec.Mesh` (names and sizes).
        coords: this rank's index along each axis.
        axes: ``axis name -> Collectives`` of this rank's group along that axis.
        world: a Collectives over every rank of the mesh (rank = row-major mesh rank), or None.
        device_mesh: the torch ``DeviceMesh`` it was built from (for DTensor export), or None.

    Examples:
        >>> from ragged import parallel, spec
        >>> def fn(mc):
        ...     return dict(mc.coords), mc["tp"].world_size, mc["dp"].rank
        >>> parallel.simulate_mesh(spec.Mesh((2, 2), ("dp", "tp")), fn)
        [({'dp': 0, 'tp': 0}, 2, 0), ({'dp': 0, 'tp': 1}, 2, 0), ({'dp': 1, 'tp': 0}, 2, 1), ({'dp': 1, 'tp': 1}, 2, 1)]
    """

    mesh: Mesh
    coords: Mapping[str, int]
    axes: Mapping[str, Any]
    world: Any = None
    device_mesh: Any = None

    def __getitem__(self, axis: str):
        try:
            return self.axes[axis]
        except KeyError:
            raise RaggedKeyError(f"mesh has axes {self.mesh.names}, no axis {axis!r}.") from None

    @property
    def rank(self) -> int:
        """This rank's row-major index in the mesh."""
        return self.mesh.rank(self.coords)

    def __repr__(self) -> str:
        return f"MeshComm(mesh={self.mesh.shape} {self.mesh.names}, coords={dict(self.coords)})"


def from_device_mesh(device_mesh, *, plan_check: str | None = None, handshake: str | None = None) -> MeshComm:
    """A :class:`MeshComm` over a torch ``DeviceMesh`` with named dims.

    Each axis gets ``rg.collectives.from_torch(device_mesh[name])``; ``world`` is the default
    process group when the mesh covers it in rank order (else ``None``).

    Args:
        device_mesh: from ``init_device_mesh(device, shape, mesh_dim_names=names)``.
        plan_check, handshake: forwarded to :func:`ragged.collectives.from_torch`.
    """
    names = device_mesh.mesh_dim_names
    if not names:
        raise RaggedValueError("from_device_mesh needs a DeviceMesh with mesh_dim_names (init_device_mesh(..., mesh_dim_names=...)).")
    mesh = Mesh(tuple(int(s) for s in device_mesh.mesh.shape), tuple(names))
    options = dict(plan_check=plan_check, handshake=handshake)
    axes = {n: from_torch(device_mesh[n], **options) for n in names}
    coords = {n: int(device_mesh.get_local_rank(n)) for n in names}
    world = None
    if device_mesh.mesh.flatten().tolist() == list(range(dist.get_world_size())):
        world = from_torch(**options)
    return MeshComm(mesh=mesh, coords=coords, axes=axes, world=world, device_mesh=device_mesh)


def simulate_mesh(mesh: Mesh, fn, *args, timeout: float = 60.0, **kwargs):
    """Runs ``fn(mcomm, *args, **kwargs)`` on every rank of ``mesh`` as threads of this process.

    Each axis group is a simulated group (see :func:`ragged.collectives.simulate`); results
    come back in row-major mesh order.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> def fn(mc):
        ...     t = torch.tensor([float(mc.rank)])
        ...     mc["tp"].all_reduce(t)
        ...     return t.item()
        >>> rg.parallel.simulate_mesh(spec.Mesh((2, 2), ("dp", "tp")), fn)
        [1.0, 1.0, 5.0, 5.0]
    """
    n = mesh.size
    world = _Group(n, timeout, "world")
    groups: list = [world]
    axis_groups: dict[tuple, Any] = {}
    comms = []
    for r in range(n):
        coords = mesh.coords(r)
        axes = {}
        for a in mesh.names:
            key = (a, tuple((b, c) for b, c in coords.items() if b != a))
            if key not in axis_groups:
                axis_groups[key] = _Group(mesh.axis_size(a), timeout, f"{a}{dict(key[1])}")
                groups.append(axis_groups[key])
            axes[a] = SimulatedCollectives(coords[a], axis_groups[key])
        comms.append(MeshComm(mesh=mesh, coords=coords, axes=axes, world=SimulatedCollectives(r, world)))
    return run_ranks(comms, fn, args, kwargs, groups, describe=lambda i: f"simulated mesh rank {i} {mesh.coords(i)}")
