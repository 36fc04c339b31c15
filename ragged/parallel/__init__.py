"""FSDP composed with tensor and expert parallelism: RaggedShard on one mesh axis,
``Shard(dim)`` on the others (plans: :func:`ragged.spec.make_mesh_plan`).

``parallel.shard``, ``parallel.reduce_scatter`` and ``parallel.global_norm`` are ``rg.shard``,
``rg.reduce_scatter`` and ``rg.global_norm``, which take a :class:`~ragged.spec.MeshPlan` as a
layout (see [Note: one verb, any layout]); ``parallel.gather`` is ``rg.gather`` too, and still
accepts its old form ``parallel.gather(dbuf, mcomm, fsdp_axis=...)``."""

from ragged.parallel._comm import MeshComm as MeshComm
from ragged.parallel._comm import from_device_mesh as from_device_mesh
from ragged.parallel._comm import simulate_mesh as simulate_mesh
from ragged.parallel._global import from_global as from_global
from ragged.parallel._global import global_plan as global_plan
from ragged.parallel._global import to_global as to_global
from ragged.parallel._ops import all_to_all as all_to_all
from ragged.parallel._ops import copy_to as copy_to
from ragged.parallel._ops import reduce_from as reduce_from
from ragged.parallel._parts import local_params as local_params
from ragged.parallel._parts import part_index as part_index
from ragged.parallel._parts import parts as parts
from ragged.parallel._transforms import data_groups as data_groups
from ragged.parallel._transforms import full_params as full_params
from ragged.parallel._transforms import gather as gather
from ragged.parallel._transforms import step_data_axes as step_data_axes
from ragged.parallel._transforms import to_dtensor as to_dtensor
from ragged.transforms import global_norm as global_norm
from ragged.transforms import reduce_scatter as reduce_scatter
from ragged.transforms import shard as shard
