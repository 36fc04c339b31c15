"""Where the step's runtime runs its work and how that work is ordered: one small strategy
object per call, :class:`HostStreams` (CPU: no streams) or :class:`CudaStreams`.

[Note: streams and lifetimes]
On CUDA the runtime uses three streams: ``compute`` (the stream current when the step is
called: the model's forward and backward, and the gradient copies into a unit's flat gradient
buffer, made where autograd produced the gradient), ``gather`` (the cast of the shard to the
compute dtype and the all-gathers) and ``reduce`` (the cast of the flat gradient to the reduce
dtype, the reduce-scatters, the division and the accumulation of the gradient shard). NCCL
runs a collective on its own internal stream, ordered after the stream current when it is
issued; the runtime issues it inside the side stream and waits its work there at once
(``work.wait()`` makes the current stream wait, not the host), so every later operation on
that side stream comes after the collective. The next unit's all-gather then overlaps the
current unit's compute, and a unit's reduce-scatter overlaps the rest of backward.

Ordering, by events only (``record`` on one stream, ``wait`` on another; never a host wait):

* start of a call: both side streams wait on compute (the previous step's optimizer wrote the
  shards on compute);
* a unit's parameters are read on compute only after compute waits on the event recorded on
  the gather stream after its all-gather (``Run._wait``);
* a flat gradient buffer is read on the reduce stream only after it waits on an event recorded
  on compute when the unit's reduce-scatter starts (every copy into it comes before);
* end of a call: compute waits on both side streams (the optimizer reads the gradient shards;
  an all-gather may still be reading a shard the optimizer is about to update).

Lifetimes, by event waits rather than ``record_stream`` (which defers a free to whenever the
allocator next looks, so memory would depend on timing). The caching allocator gives a freed
block only to later allocations on the stream that allocated it, so a block is safe to free
once that stream is ordered after every other stream's use of it:

* a unit's gathered storage is allocated on the gather stream; when the runtime releases it,
  it records an event on compute (after every read queued so far), makes the gather stream
  wait on it, then frees: the block's next user (a later all-gather) runs after every read
  of the old contents;
* a flat gradient buffer is allocated on compute and read on the reduce stream: before it is
  freed, compute waits on the event recorded on the reduce stream after its last reader (the
  cast to the reduce dtype right after the start, else the reduce-scatter itself, when it is
  waited: the point ``max_inflight_reduce`` bounds);
* what a side stream allocates for itself (the cast shard, the cast gradient, the
  reduce-scatter's output) is used by that stream alone until the end-of-call wait;
* the quantized collectives' chunks of bytes come from the collectives' scratch pool, which
  hands a buffer given back on a stream only to that stream again (see [Note: scratch across
  streams] in ``ragged/collectives/_scratch.py``).

On the CPU (gloo, the simulated backend, the fake process group) :class:`HostStreams` makes
every one of these calls a no-op: collectives run on gloo's threads and are waited on the
host, results are unchanged. The same calls also tell the strategy which buffer each stream
allocates, frees, reads or writes (``alloc`` / ``free`` / ``access``), so a recording fake
(``tests/fsdp/_streams.py``) checks these rules with a race detector on every run of the real
step on the CPU, where the real streams cannot run.
"""

from __future__ import annotations

import contextlib

import torch

from ragged.collectives._base import completed

__all__ = ["COMPUTE", "GATHER", "REDUCE", "HostStreams", "CudaStreams", "CudaApi", "streams_for"]

COMPUTE, GATHER, REDUCE = "compute", "gather", "reduce"
_NULL = contextlib.nullcontext()


class HostStreams:
    """No streams: everything runs in program order on the host (see [Note: streams and
    lifetimes]); a collective's work is waited on the host when its result is needed."""

    def begin_call(self) -> None:
        """Side streams wait on compute (what the caller queued before the step)."""

    def end_call(self) -> None:
        """Compute waits on both side streams (what the step queued on them)."""

    def on(self, stream: str):
        """Context: the enclosed work runs on ``stream``."""
        return _NULL

    def record(self, stream: str):
        """An event after the work queued on ``stream`` so far (``None``: nothing to wait on)."""
        return None

    def wait(self, stream: str, event) -> None:
        """``stream``'s later work runs after ``event``."""

    def issued(self, stream: str, work):
        """``work`` (a collective's handle) was issued inside ``on(stream)``; returns its token,
        what :meth:`done` and :meth:`finished` take and a fence for :meth:`wait` (after the
        collective). Host: the handle itself (which :meth:`wait` ignores)."""
        return work

    def done(self, stream: str, pending) -> None:
        """``stream``'s later work sees the collective's result. Host: waits for it."""
        pending.wait()

    def finished(self, token) -> bool:
        """Whether the collective of ``token`` (from :meth:`issued`) has run: a question about
        the device's progress, which differs between ranks, so its answer may decide when memory
        is given back, never whether or when a collective is issued. Host: the handle says."""
        return completed(token)

    # what the runtime tells the strategy about its buffers (for the recording fake)
    def alloc(self, stream: str, key, nbytes: int) -> None:
        """Buffer ``key`` was allocated (and is first written) on ``stream``."""

    def free(self, key) -> None:
        """Buffer ``key`` was freed (its memory may go to the next allocation on its stream)."""

    def access(self, stream: str, key, write: bool = False) -> None:
        """``stream`` reads (or writes) buffer ``key`` now."""


class CudaApi:
    """The ``torch.cuda`` calls :class:`CudaStreams` makes (a test passes a recording stand-in)."""

    current_device = staticmethod(lambda: torch.cuda.current_device())
    current_stream = staticmethod(lambda index: torch.cuda.current_stream(index))
    new_stream = staticmethod(lambda index: torch.cuda.Stream(index, priority=-1))  # high priority, as FSDP2's
    stream = staticmethod(lambda s: torch.cuda.stream(s))


class CudaStreams(HostStreams):
    """Compute (the current stream at the call), gather and reduce streams of one CUDA device."""

    def __init__(self, device: torch.device, api=CudaApi):
        self.api = api
        index = device.index if device.index is not None else api.current_device()
        self.streams = {COMPUTE: api.current_stream(index), **_side_streams(api, index)}

    def begin_call(self):
        ev = self.record(COMPUTE)
        self.wait(GATHER, ev)
        self.wait(REDUCE, ev)

    def end_call(self):
        self.wait(COMPUTE, self.record(GATHER))
        self.wait(COMPUTE, self.record(REDUCE))

    def on(self, stream):
        return _NULL if stream == COMPUTE else self.api.stream(self.streams[stream])

    def record(self, stream):
        return self.streams[stream].record_event()

    def wait(self, stream, event):
        if event is not None:
            self.streams[stream].wait_event(event)

    def issued(self, stream, work):
        work.wait()  # inside on(stream): the side stream waits on the collective (not the host)
        return self.record(stream)

    def done(self, stream, pending):
        self.wait(stream, pending)

    def finished(self, token):
        return token.query()  # the event after the collective: the device's progress, no sync


_SIDE: dict = {}


def _side_streams(api, index: int) -> dict:
    """One gather and one reduce stream per device, for the process (like FSDP2's per-state
    streams; created on first use)."""
    key = (id(api), index)
    if key not in _SIDE:
        _SIDE[key] = {GATHER: api.new_stream(index), REDUCE: api.new_stream(index)}
    return _SIDE[key]


HOST = HostStreams()


def streams_for(device: torch.device) -> HostStreams:
    """The strategy for a comm's device (a new :class:`CudaStreams` per call: it captures the
    current stream as compute)."""
    return CudaStreams(device) if device.type == "cuda" else HOST
