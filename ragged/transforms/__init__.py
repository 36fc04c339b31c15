"""Transforms over layouts and DBuffers: shard, gather, reduce_scatter, global_norm (any layout,
see [Note: one verb, any layout]) and redistribute."""

from ragged.transforms._flat import all_gather_flat as all_gather_flat
from ragged.transforms._flat import reduce_scatter_flat as reduce_scatter_flat
from ragged.transforms._gather import GatherPending as GatherPending
from ragged.transforms._gather import gather_start as gather_start
from ragged.transforms._gather import gather_wait as gather_wait
from ragged.transforms._reduce_scatter import ReduceScatterPending as ReduceScatterPending
from ragged.transforms._reduce_scatter import reduce_scatter_start as reduce_scatter_start
from ragged.transforms._reduce_scatter import reduce_scatter_wait as reduce_scatter_wait
from ragged.transforms._redistribute import owned_plan as owned_plan
from ragged.transforms._redistribute import redistribute as redistribute
from ragged.transforms._layouts import gather as gather
from ragged.transforms._layouts import global_norm as global_norm
from ragged.transforms._layouts import reduce_scatter as reduce_scatter
from ragged.transforms._layouts import shard as shard
