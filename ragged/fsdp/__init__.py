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
from ragged.fsdp._trainable import TrainState as TrainState
from ragged.fsdp._trainable import trainable_shards as trainable_shards
from ragged.fsdp._export import export as export
from ragged.fsdp._state import init as init
from ragged.fsdp._equal_start import ParamsMismatchError as ParamsMismatchError
from ragged.fsdp._step import DataGroup as DataGroup
from ragged.fsdp._layout import MixedPrecision as MixedPrecision
from ragged.fsdp._grad import ValueAndGrad as ValueAndGrad
from ragged.fsdp._grad import value_and_grad as value_and_grad
from ragged.fsdp._step import Step as Step
from ragged.fsdp._step import make_step as make_step
from ragged.fsdp._chunks import local_chunks as local_chunks

# The lowering's types were first published here; they live in ragged.predict, which sits above
# fsdp (it reads a step's schedule), so they are looked up there on first use instead of imported
# (an import here would run upward, and in a circle through the step).
_PREDICT = ("Collective", "CostAnalysis", "Lowered", "MemoryAnalysis", "Activations", "profile_activations", "Link",
            "Network", "TimeEstimate")

# Hugging Face and FSDP2 checkpoints are written where they are read, in ragged.checkpoint (which sits
# above fsdp and loads torch.distributed.checkpoint): their writers are looked up there on first use.
_CHECKPOINT = ("save_pretrained", "save_fsdp2")


def __getattr__(name):
    if name in _PREDICT:
        import ragged.predict  # upward, on first use only (see above)

        return getattr(ragged.predict, name)
    if name in _CHECKPOINT:
        from ragged.checkpoint import _fsdp2, _pretrained  # upward, on first use only (see above)

        return getattr(_pretrained if name == "save_pretrained" else _fsdp2, name)
    raise AttributeError(f"module 'ragged.fsdp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PREDICT) | set(_CHECKPOINT))
