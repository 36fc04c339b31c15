"""FSDP composed with tensor and expert parallelism: RaggedShard on one mesh axis,
``Shard(dim)`` on the others (plans: :func:`ragged.spec.make_mesh_plan`).

The verbs ``rg.shard``, ``rg.gather``, ``rg.reduce_scatter`` and ``rg.global_norm`` take a
:class:`~ragged.spec.MeshPlan` as a layout (see [Note: one verb, any layout])."""

from ragged.parallel._comm import MeshComm as MeshComm
from ragged.parallel._comm import from_device_mesh as from_device_mesh
from ragged.parallel._comm import simulate_mesh as simulate_mesh
from ragged.parallel._global import from_global as from_global
from ragged.parallel._global import global_plan as global_plan
from ragged.parallel._global import to_global as to_global
from ragged.parallel._ops import all_to_all as all_to_all
from ragged.parallel._ops import copy_to as copy_to
from ragged.parallel._ops import reduce_from as reduce_from
from ragged.parallel._parts import part_index as part_index
from ragged.parallel._parts import parts as parts
from ragged.parallel._transforms import data_groups as data_groups
from ragged.parallel._transforms import full_params as full_params
from ragged.parallel._transforms import to_dtensor as to_dtensor
