"""Host syncs counted: a dispatch mode that counts what makes the host wait for the device.

On CUDA the host waits at every scalar read (``item()``, ``bool()``, ``float()``, ``int()``:
``aten._local_scalar_dense``), every copy to the host (``tolist()``, ``.cpu()``, ``.to("cpu")``,
``copy_`` into a host tensor), every blocking copy from pageable host memory (``torch.tensor(...,
device=cuda)``, ``.to(cuda)`` of a host tensor: the copy first waits for the stream), and every op
whose output's size depends on the values (``nonzero``, ``masked_select``, ``unique``, indexing
with a boolean mask, ``equal``). ``HostSyncs(device)`` counts those of tensors on ``device``'s
type. On the CPU there is no device: ``HostSyncs("cpu")`` (the default) counts what WOULD be a
sync if the code ran on one: every scalar read and value-sized op, every ``tolist()`` (not a
dispatched op on the CPU: ``Tensor.tolist`` is wrapped while the mode is on, in the thread that
entered it), and every tensor made from host data (``torch.tensor`` / ``torch.as_tensor``, seen
as ``aten.lift_fresh``: on a device that is a copy from the host; one that stays on the host is
counted too, so write such host code with Python numbers). Copies between devices cannot happen
on the CPU, so they are not seen there. Code with a branch of its own for a device is judged by
that branch (:data:`DEVICE_BRANCHES`: what it does on the CPU is not counted); on a GPU
``tests/fsdp/test_nccl_cuda.py`` counts the device's branch itself.

It lives in ``tests/`` (not ``ragged.testing``): it is a check of ragged's own code paths (the
optimizer update, the whole step: ``tests/optim/test_host_syncs.py``), whose rules are CUDA's as
read from ATen, not an API ragged promises to keep.

    with HostSyncs() as syncs:
        opt.update(grads, state, params)
    assert syncs.total == 0, syncs
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncs"]

_aten = torch.ops.aten
_SCALAR_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_VALUE_SIZED = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                _aten.unique_consecutive.default, _aten.unique_dim.default, _aten.repeat_interleave.Tensor}
_FROM_HOST_DATA = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default}  # .to(...) reaches a mode as _to_copy
#: (module, function) -> why: functions whose device branch is free of the syncs their CPU branch
#: shows the CPU's counter (host tensors made from values, tolist() of them)
DEVICE_BRANCHES = {
    ("ragged.collectives._agree", "on_device"): "copies from pinned memory, not blocking",
    ("ragged.collectives._ledger", "_launch"): "the periodic check's digest: copied from pinned memory, not blocking",
    ("ragged.collectives._ledger", "_poll"): "reads a pinned copy of the check once its event says it is done",
    ("ragged.optim._base", "host_schedule_value"): "a schedule at the host's step count: host tensors on every device",
    ("ragged.optim._base", "checked"): "checks a schedule's value in the update only where it is a number or on the CPU",
}


def _in_device_branch() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in DEVICE_BRANCHES:
            return True
        frame = frame.f_back
    return False


def _tensors(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    return []


class HostSyncs(TorchDispatchMode):
    """Counts host syncs (see the module docstring) while active.

    Attributes:
        events: ``(what, op)`` per sync, in order (``what``: "scalar read", "value-sized output",
            "copy to the host", "copy from the host", "tensor from host data", "tolist").
        total: their number.
    """

    def __init__(self, device="cpu"):
        super().__init__()
        self.device_type = torch.device(device).type
        self.events: list[tuple[str, str]] = []
        self._thread = None
        self._tolist = None

    @property
    def total(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"HostSyncs({self.total}: {self.events})"

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device_type

    def __enter__(self):
        if self.device_type == "cpu":  # tolist() of a host tensor reads no dispatched op
            self._thread, self._tolist = threading.get_ident(), torch.Tensor.tolist
            mode, tolist = self, self._tolist

            def counted_tolist(t):
                if threading.get_ident() == mode._thread and not _in_device_branch():
                    mode.events.append(("tolist", "Tensor.tolist"))
                return tolist(t)

            torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if self._tolist is not None:
            torch.Tensor.tolist, self._tolist = self._tolist, None
        return super().__exit__(*exc)

    def _what(self, func, args, kwargs, out) -> str | None:
        ins = _tensors(list(args) + list(kwargs.values()))
        if func in _SCALAR_READS:
            if self.device_type == "cpu" and _in_device_branch():
                return None
            return "scalar read" if any(self._on_device(t) for t in ins) else None
        if func in _VALUE_SIZED or (func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default)
                                    and any(t.dtype == torch.bool for t in _tensors(args[1]))):
            return "value-sized output" if any(self._on_device(t) for t in ins) else None
        if func in _FROM_HOST_DATA:
            if self.device_type == "cpu":
                return None if _in_device_branch() else "tensor from host data"
            return "tensor from host data" if out.device.type != "cpu" else None
        blocking = not kwargs.get("non_blocking", len(args) > 2 and args[2] is True)  # copy_(self, src, non_blocking)
        if func in _COPIES and blocking:
            src = args[1] if func is _aten.copy_.default else args[0]
            dst = args[0] if func is _aten.copy_.default else out
            if src.device.type != dst.device.type:
                return "copy to the host" if dst.device.type == "cpu" else "copy from the host"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        what = self._what(func, args, kwargs, out)
        if what is not None:
            self.events.append((what, str(func)))
        return out
