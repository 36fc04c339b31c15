"""Scratch buffers reused across calls: the one pool of the collectives and transforms.

[Note: one scratch pool]
The collectives' receive and staging buffers (``_p2p.py``), the reduce-scatter's packing buffer
(``transforms/_reduce_scatter.py``) and the quantized collectives' chunks of bytes
(``transforms/_quantized.py``) live from a call's start to its ``wait()``; the next call of the
same size wants the same buffer. :data:`SCRATCH` keeps up to two free buffers per (numel, dtype,
device, stream): fresh large allocations cost a first touch per page on the CPU (~5x a warm
copy), and a buffer in use by a pending op is never handed out twice (it is given back only once
its op is done, see [Note: scratch across streams]). Inside a ``torch.func`` transform a fresh
buffer is handed out instead: ``torch.func.grad`` refuses to mutate a tensor created outside it.

The fsdp runtime's unit buffers are not scratch: they live between the actions of one step,
carry stream fences and are swapped into the units' storages, so they have their own pool
(see [Note: reusing unit buffers] in ``ragged/fsdp/_pool.py``).

[Note: scratch across streams]
On CUDA "its op is done" is an ordering, not a completion: a handle's ``wait()`` makes the
*current* stream wait on the collective (NCCL's ``work.wait()``), and the quantized collectives
then queue their decode on that stream, so ``give`` runs on the host while the device may still
read the buffer. What ``give`` may assume, and every caller guarantees, is that every use of
the buffer is ordered before the work queued next on the stream current at ``give`` (the start's
writes come before the collective's launch, the collective before the waiting stream, the
decode is queued on it). So a free buffer is handed only to a ``take`` on that same stream: the
pool is keyed by the current stream (``None`` off CUDA, where ``wait()`` is the host's). Shared
across streams it was wrong: the fsdp step gathers on one side stream and reduce-scatters on
another (``fsdp/_device.py``); a unit's quantized gather and its quantized reduce-scatter have
chunks of the same size whenever their formats and the dtypes of the leaves left unquantized
agree, and in backward an all-gather issued right after a reduce-scatter took the buffer that
reduce-scatter had just given back, writing into it while the reduce stream still summed out of
it (``tests/fsdp/test_streams.py`` catches it with the race detector). Keyed by stream, two
streams never share a free buffer, and no stream waits on another for one (FSDP2 likewise keeps
each stream's collective buffers to that stream).

A buffer given back on another stream than the one that allocated it (a caller that starts on
one stream and waits on another; never the fsdp step, whose start and wait run on the same side
stream) is also marked used there with ``Tensor.record_stream``: when the pool drops it, the
caching allocator hands its memory to the allocating stream's next allocation only once the
giving stream has passed the free. On the allocating stream ``record_stream`` is a no-op, so the
step's memory never depends on timing (see [Note: streams and lifetimes] in ``fsdp/_device.py``).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["SCRATCH", "current_stream"]


def current_stream(device):
    """The stream work on ``device`` is queued on now: CUDA's current stream, ``None`` off CUDA
    (see [Note: scratch across streams])."""
    device = torch.device(device)
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class _Scratch:
    """See [Note: one scratch pool]."""

    def __init__(self, keep: int = 2):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.keep = keep  # free buffers kept per key (``step.lower`` walks the pool: ragged/predict/_timeline.py)

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements: a free one of that size given back on the current
        stream, or a new one (allocated on it)."""
        if not torch._C._are_functorch_transforms_active():
            key = (numel, dtype, str(device), current_stream(device))
            with self._lock:
                free = self._free.get(key)
                if free:
                    return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """``t`` (from :meth:`take`) is free again: every use of it is ordered before the current
        stream's next work (see [Note: scratch across streams])."""
        stream = current_stream(t.device)
        if t.is_cuda:
            t.record_stream(stream)
        with self._lock:
            free = self._free.setdefault((t.numel(), t.dtype, str(t.device), stream), [])
            if len(free) < self.keep:
                free.append(t)


SCRATCH = _Scratch()
