"""What differs between torch 2.11 and 2.14 for ragged, decided once, at import.

Every call of an API that differs goes through this module, and every other difference is a flag
here; nothing else in the package looks at ``torch.__version__`` or probes for a torch function.

[Note: torch 2.11 to 2.14]
ragged supports torch ``>=2.11,<2.15`` (``pyproject.toml``; the whole suite runs on 2.11.0 and
2.14.1 with ``scripts/compat_check.sh``, on 2.13.0 in CI). What differs in that range and what
ragged does about it:

* **The flat all-gather and reduce-scatter.** torch 2.13 added ``all_gather_single`` /
  ``reduce_scatter_single`` and deprecated ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
  (a ``FutureWarning`` per call site; the old names are thin wrappers that call the new ones).
  torch 2.11 and 2.12 have only the old names. Both pairs take the same arguments
  ``(output, input[, op], group=, async_op=)``, so :data:`all_gather_single` /
  :data:`reduce_scatter_single` bind the new function when ``torch.distributed`` has it and the
  old one otherwise: no warning on 2.13+, no missing attribute on 2.11. Inside
  ``torch.distributed._coalescing_manager`` (NCCL, several buffers in one launch) torch
  records the op by identity (2.13 compares with ``all_gather_single``, 2.11 with
  ``all_gather_into_tensor``): the function bound here is the one the installed torch expects.
* **Moving memory into a storage that keeps its identity.** The step's runtime reuses unit
  buffers by moving a pool block's memory into a unit's storage
  (``UntypedStorage._swap_data_ptr_``; [Note: reusing unit buffers] in ``ragged/fsdp/_pool.py``).
  torch 2.13 and 2.14 have it, torch 2.11 does not. :data:`CAN_SWAP_STORAGE` says which: without
  it the runtime resizes the unit's storage instead (the same results, no reuse) and tells the
  streams strategy about that memory all the same, so the recording fake of the CUDA streams
  checks that path's ordering too (``tests/fsdp/test_streams.py`` runs both paths on any torch).
* **torch.compile of an optimizer update.** A compiled ``opt.update`` traces optree through
  dynamo's polyfill, whose tree spec is a Python object made while tracing. torch 2.11's dynamo
  compares two tree specs' node classes with ``cls.__eq__(other)`` (its ``cmp_eq`` polyfill), which
  fails for a class with a Python ``__eq__`` such as :class:`~ragged.DBuffer`: a graph break. Where
  the trace then used that tree spec across the break (``treedef.flatten_up_to``), dynamo could
  not resume and the polyfill's tree spec reached eager code (``ValueError: length mismatch``). So
  ragged's updates check the trees' structures (``check_like_state``) and then zip
  ``pytree.leaves``, never a tree spec made in the trace; on torch 2.11 the check's comparison is
  the one graph break (:data:`DYNAMO_TRACES_TREESPEC_EQ`), torch 2.13 and 2.14 trace it.
* **Inductor on the CPU, float64 attention.** torch 2.11's inductor generates a backward of
  float64 causal ``scaled_dot_product_attention`` on the CPU that fails (``RuntimeError: expected
  scalar type Double but found Float``, in ``_scaled_dot_product_flash_attention_for_cpu_backward``;
  a compiled function of that one call fails alike, without ragged; float32, ``aot_eager`` and
  torch 2.13 / 2.14 pass). It is torch's, in the user's compiled blocks, so ragged does not work
  around it: :data:`INDUCTOR_CPU_FP64_ATTENTION_BACKWARD` says where the float64 inductor test runs.
* **Older torch.** Below 2.11 nothing is tested; importing ragged raises :class:`ImportError`
  naming the range instead of failing later in some collective. Above the range (2.15+)
  ragged imports: the bound in ``pyproject.toml`` says what was tested, an import does not
  refuse what may well work.

Examples:
    >>> import torch.distributed as dist
    >>> from ragged import _compat
    >>> _compat.all_gather_single in (getattr(dist, "all_gather_single", None), dist.all_gather_into_tensor)
    True
    >>> _compat.TORCH_RANGE
    ('2.11', '2.15')
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

__all__ = [
    "TORCH_RANGE", "CAN_SWAP_STORAGE", "DYNAMO_TRACES_TREESPEC_EQ", "INDUCTOR_CPU_FP64_ATTENTION_BACKWARD",
    "all_gather_single", "reduce_scatter_single",
]

TORCH_RANGE = ("2.11", "2.15")  # supported: >= first, < second (pyproject.toml says the same)

if TorchVersion(torch.__version__) < TORCH_RANGE[0]:
    raise ImportError(
        f"ragged needs torch >= {TORCH_RANGE[0]} (tested: >={TORCH_RANGE[0]},<{TORCH_RANGE[1]}); this is torch "
        f"{torch.__version__}. Upgrade it: pip install 'torch>={TORCH_RANGE[0]},<{TORCH_RANGE[1]}'."
    )

#: ``all_gather_single(output, input, group=None, async_op=False)``: torch 2.13+'s
#: ``all_gather_single``, else ``all_gather_into_tensor`` (see [Note: torch 2.11 to 2.14]).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: ``reduce_scatter_single(output, input, op=SUM, group=None, async_op=False)``: torch 2.13+'s
#: ``reduce_scatter_single``, else ``reduce_scatter_tensor`` (see [Note: torch 2.11 to 2.14]).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: Whether ``torch.UntypedStorage._swap_data_ptr_`` exists (torch 2.13+; see [Note: torch 2.11 to
#: 2.14]): the step's runtime reuses unit buffers through it, else resizes the unit's storage.
CAN_SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

#: Whether torch.compile traces ``==`` of two optree tree specs holding a DBuffer without a graph
#: break: not torch 2.11's dynamo (see [Note: torch 2.11 to 2.14]); torch 2.13 and 2.14 do
#: (2.12 not run). What a test of a compiled update expects.
DYNAMO_TRACES_TREESPEC_EQ = TorchVersion(torch.__version__) >= "2.13"

#: Whether inductor's backward of float64 ``scaled_dot_product_attention`` on the CPU runs: not on
#: torch 2.11 (see [Note: torch 2.11 to 2.14]); torch 2.13 and 2.14 (2.12 not run).
INDUCTOR_CPU_FP64_ATTENTION_BACKWARD = TorchVersion(torch.__version__) >= "2.13"

