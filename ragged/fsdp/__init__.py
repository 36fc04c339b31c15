"""Functional FSDP: units, the model lifecycle (init from a module, a state dict or ``meta``;
placeholders left on the module; export of full parameters), and a training step that threads
``(shards, opt_state)``."""

from ragged.fsdp._units import REST as REST
from ragged.fsdp._units import Unit as Unit
from ragged.fsdp._units import Units as Units
from ragged.fsdp._units import make_units as make_units
from ragged.fsdp._placeholder import Placeholder as Placeholder
from ragged.fsdp._placeholder import ShardedParameterError as ShardedParameterError
from ragged.fsdp._placeholder import release as release
from ragged.fsdp._placeholder import tied_names as tied_names
from ragged.fsdp._state import TrainState as TrainState
from ragged.fsdp._export import export as export
from ragged.fsdp._state import gather as gather
from ragged.fsdp._state import global_norm as global_norm
from ragged.fsdp._state import init as init
from ragged.fsdp._state import shard as shard
from ragged.fsdp._step import Step as Step
from ragged.fsdp._step import make_step as make_step
