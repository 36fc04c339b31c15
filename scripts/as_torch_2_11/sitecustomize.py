"""torch 2.13+ as ragged sees torch 2.11: put this folder first on ``PYTHONPATH`` and every Python
process started so (torch.multiprocessing's workers too) imports it at start-up, before ragged.
ragged/_compat.py then makes 2.11's choices ([Note: torch 2.11 to 2.14]): the flat collectives'
old names (2.13's are removed from ``torch.distributed``'s namespace; torch's own module keeps
them) and no ``UntypedStorage._swap_data_ptr_`` (hidden: ``hasattr`` is false), so the step's
runtime resizes unit storages instead of swapping pool blocks in. Used by
``scripts/gpu_check.sh`` (stage ``cuda-2.11-path``) and
``tests/distributed/test_compat_gloo.py``; it changes nothing on torch 2.11 or 2.12. A
sitecustomize it shadows (further down the path) runs after it.
"""

import importlib.machinery
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

for _name in ("all_gather_single", "reduce_scatter_single"):
    if hasattr(dist, _name):
        delattr(dist, _name)


class _Absent:
    """A class attribute that is not there: reading it raises AttributeError."""

    def __get__(self, obj, cls=None):
        raise AttributeError("_swap_data_ptr_ (hidden by scripts/as_torch_2_11: torch 2.11 has none)")


if hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
    torch.UntypedStorage._swap_data_ptr_ = _Absent()

# the sitecustomize this one shadows (in a later folder of sys.path), if any, runs as well
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
