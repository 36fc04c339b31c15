"""Functional FSDP: units, the model lifecycle (init from a module, a state dict or ``meta``;
placeholders left on the module; export of full parameters), and a training step that threads
``(shards, opt_state)``.

The verbs ``rg.shard``, ``rg.gather``, ``rg.reduce_scatter`` and ``rg.global_norm`` take
:class:`Units` as a layout (see [Note: one verb, any layout])."""

from ragged.fsdp._units import REST as REST
from ragged.fsdp._units import Unit as Unit
from ragged.fsdp._units import Units as Units
from ragged.fsdp._units import make_units as make_units
from ragged.fsdp._placeholder import Placeholder as Placeholder
from ragged.fsdp._placeholder import ShardedParameterError as ShardedParameterError
from ragged.fsdp._placeholder import release as release
from ragged.fsdp._placeholder import tied_names as tied_names
from ragged.fsdp._state import TrainState as TrainState
from ragged.fsdp._trainable import trainable_shards as trainable_shards
from ragged.fsdp._export import export as export
from ragged.fsdp._state import init as init
from ragged.fsdp._equal_start import ParamsMismatchError as ParamsMismatchError
from ragged.fsdp._pretrained import save_pretrained as save_pretrained
from ragged.fsdp._fsdp2 import save_fsdp2 as save_fsdp2
from ragged.fsdp._data import DataGroup as DataGroup
from ragged.fsdp._layout import MixedPrecision as MixedPrecision
from ragged.fsdp._grad import ValueAndGrad as ValueAndGrad
from ragged.fsdp._grad import value_and_grad as value_and_grad
from ragged.fsdp._step import Step as Step
from ragged.fsdp._step import make_step as make_step
from ragged.fsdp._lower import Collective as Collective
from ragged.fsdp._lower import CostAnalysis as CostAnalysis
from ragged.fsdp._lower import Lowered as Lowered
from ragged.fsdp._lower import MemoryAnalysis as MemoryAnalysis
from ragged.fsdp._lower_activations import Activations as Activations
from ragged.fsdp._lower_activations import profile_activations as profile_activations
from ragged.fsdp._lower_time import Link as Link
from ragged.fsdp._lower_time import Network as Network
from ragged.fsdp._lower_time import TimeEstimate as TimeEstimate
