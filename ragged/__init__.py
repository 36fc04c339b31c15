"""ragged: functional RaggedShard sharding for PyTorch (veScale-FSDP ideas as pure functions)."""

from ragged import optim as optim
from ragged import spec as spec
from ragged._errors import LayoutError as LayoutError
from ragged._errors import PlanMismatchError as PlanMismatchError
from ragged._errors import RaggedError as RaggedError
from ragged._pytree import pytree as pytree
from ragged.optim import apply_updates as apply_updates
from ragged.spec import LayoutPlan as LayoutPlan
from ragged.spec import make_plan as make_plan

__version__ = "0.1.0"
