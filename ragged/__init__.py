"""ragged: functional RaggedShard sharding for PyTorch (veScale-FSDP ideas as pure functions)."""

import importlib

from ragged import optim as optim
from ragged import parallel as parallel
from ragged import spec as spec
from ragged._errors import CollectiveError as CollectiveError
from ragged._errors import LayoutError as LayoutError
from ragged._errors import PlanMismatchError as PlanMismatchError
from ragged._errors import RaggedError as RaggedError
from ragged._errors import RaggedKeyError as RaggedKeyError
from ragged._errors import RaggedTypeError as RaggedTypeError
from ragged._errors import RaggedValueError as RaggedValueError
from ragged._pytree import pytree as pytree
from ragged import collectives as collectives
from ragged import quant as quant
from ragged import transforms as transforms
from ragged import fsdp as fsdp
from ragged import predict as predict
from ragged._dbuffer import DBuffer as DBuffer
from ragged._dbuffer import unflatten as unflatten
from ragged.transforms import gather as gather
from ragged.transforms import gather_start as gather_start
from ragged.transforms import gather_wait as gather_wait
from ragged.transforms import global_norm as global_norm
from ragged.transforms import owned_plan as owned_plan
from ragged.transforms import redistribute as redistribute
from ragged.transforms import reduce_scatter as reduce_scatter
from ragged.transforms import reduce_scatter_start as reduce_scatter_start
from ragged.transforms import reduce_scatter_wait as reduce_scatter_wait
from ragged.transforms import shard as shard
from ragged.optim import apply_updates as apply_updates
from ragged.spec import LayoutPlan as LayoutPlan
from ragged.spec import make_plan as make_plan
from ragged._viz import rank_table as rank_table
from ragged._viz import visualize as visualize
from ragged import testing as testing

__version__ = "0.1.0"


def __getattr__(name):
    # ragged.checkpoint pulls in torch.distributed.checkpoint (~0.7 s at import on CPU), which
    # most processes (every gloo worker, every training rank) never use: load it on first use.
    if name == "checkpoint":
        return importlib.import_module("ragged.checkpoint")
    raise AttributeError(f"module 'ragged' has no attribute {name!r}")
