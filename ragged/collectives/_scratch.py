"""Scratch buffers reused across calls: the one pool of the collectives and transforms.

[Note: one scratch pool]
The collectives' receive and staging buffers (``_p2p.py``) and the
reduce-scatter's packing buffer (``transforms/_reduce_scatter.py``) live from a call's start to
its ``wait()``; the next call of the same size wants the same buffer. :data:`SCRATCH` keeps up
to two free buffers per (numel, dtype, device): fresh large allocations cost a first touch per
page on the CPU (~5x a warm copy), and a buffer in use by a pending op is never handed out twice
(it is given back only once its op is done). Inside a ``torch.func`` transform a fresh buffer is
handed out instead: ``torch.func.grad`` refuses to mutate a tensor created outside it.

The fsdp runtime's unit buffers are not scratch: they live between the actions of one step,
carry stream fences and are swapped into the units' storages, so they have their own pool
(see [Note: reusing unit buffers] in ``ragged/fsdp/_pool.py``).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["SCRATCH"]


class _Scratch:
    """See [Note: one scratch pool]."""

    def __init__(self, keep: int = 2):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._keep = keep

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements: a free one of that size, or a new one."""
        if not torch._C._are_functorch_transforms_active():
            with self._lock:
                free = self._free.get((numel, dtype, str(device)))
                if free:
                    return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """``t`` (from :meth:`take`) is free again: its op is done."""
        with self._lock:
            free = self._free.setdefault((t.numel(), t.dtype, str(t.device)), [])
            if len(free) < self._keep:
                free.append(t)


SCRATCH = _Scratch()
