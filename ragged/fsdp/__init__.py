"""Functional FSDP: units, and a training step that threads ``(shards, opt_state)``."""

from ragged.fsdp._units import REST as REST
from ragged.fsdp._units import Unit as Unit
from ragged.fsdp._units import Units as Units
from ragged.fsdp._units import make_units as make_units
from ragged.fsdp._step import Step as Step
from ragged.fsdp._step import TrainState as TrainState
from ragged.fsdp._step import gather as gather
from ragged.fsdp._step import global_norm as global_norm
from ragged.fsdp._step import init as init
from ragged.fsdp._step import make_step as make_step
from ragged.fsdp._step import shard as shard
