"""The predictor: what a training step costs per rank (memory, collectives, time) without running
it, at any world size. ``step.lower(...)`` returns a :class:`Lowered` (see [Note: lowering a step]
in ``ragged/predict/_lower.py``); on the command line, ``plan --predict`` lowers a bundled model's step
and prints it beside the FSDP2 and ZeRO-3 rules.

It sits above ``ragged.fsdp`` (it reads a step's units, layouts and collective schedule), so
``fsdp`` reaches it only when a step is lowered. Its public names are also reachable as
``rg.fsdp.<name>``, where they were first published."""

from ragged.predict._lower import Lowered as Lowered
from ragged.predict._lower import MemoryAnalysis as MemoryAnalysis
from ragged.predict._cost import Collective as Collective
from ragged.predict._cost import CostAnalysis as CostAnalysis
from ragged.predict._activations import Activations as Activations
from ragged.predict._activations import profile_activations as profile_activations
from ragged.predict._time import Link as Link
from ragged.predict._time import Network as Network
from ragged.predict._time import TimeEstimate as TimeEstimate
