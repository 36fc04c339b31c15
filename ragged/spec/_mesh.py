"""`Mesh`: the axis names and sizes of an N-D device mesh (a value: no devices, no process groups).

Plans over a mesh are in ``_mesh_plan.py``; the placements a leaf takes on each axis in
``_placements.py``; the collectives of one rank over every axis in ``ragged.parallel``
(:class:`~ragged.parallel.MeshComm`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ragged._errors import RaggedValueError, check_int

__all__ = ["Mesh"]


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
            check_int(f"the size of mesh axis {n!r}", s)

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
