"""Records of the step's runtime, per call: :class:`UnitRecord` holds a unit's gathered buffer
(and gives it memory and takes it back), its leaves and their state (the run's),
:class:`GradRecord` its gradient buffers (the :class:`~ragged.fsdp._reducing.Gradients`'); no
parallel lists. :class:`Cursor` is where the call is in its program."""

from __future__ import annotations

import enum

import torch

from ragged import _compat
from ragged.fsdp._device import COMPUTE, GATHER
from ragged.fsdp._pool import attach, detach
from ragged.transforms._quantized import quantize_replicated

__all__ = ["UnitRecord", "GradRecord", "UnitState", "Cursor", "storage_key"]


def storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class UnitState(enum.Enum):
    FREE = "free"  # storage released
    PENDING = "pending"  # an all-gather is writing it
    READY = "ready"  # holds the gathered parameters (or zeros served after a deviation)


class UnitRecord:
    """One unit's buffers and state for one call.

    Attributes:
        flat: the gathered buffer (``layout.numel`` elements, storage released when ``FREE``);
            every sharded leaf is a view of it. With its own ``layout.frozen_dtype``, ``flat`` is
            the trainable part and ``frozen_flat`` the frozen part, two typed views of one storage
            (``frozen_flat`` is ``flat``'s tail otherwise).
        rflat: a copy of the shard's replicated buffer (``spec.Replicate()`` leaves are views of it).
        leaves: ``{path: leaf tensor}`` (a frozen leaf has ``requires_grad=False``); ``spans``:
            ``(leaf, start, stop, replicated)`` per trainable leaf (the ones with a gradient).
        state: a :class:`UnitState`; ``handle`` / ``source``: the all-gather in flight.
        block: the pool block whose memory ``flat`` holds while gathered (``None`` when ``FREE``,
            or when storage is resized instead: see [Note: reusing unit buffers] in ``_pool.py``).
        scheduled: alive according to the program.
    """

    __slots__ = ("layout", "flat", "frozen_flat", "rflat", "leaves", "spans", "state", "handle", "source", "scheduled",
                 "block")

    def __init__(self, layout, plan, replicated: torch.Tensor, device):
        self.layout = layout
        split = layout.grad_numel
        if layout.frozen_plan is None:
            self.flat = torch.empty(layout.numel, dtype=layout.dtype, device=device)
            self.frozen_flat = self.flat[split:]
        else:
            raw = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
            self.flat = raw[: split * layout.dtype.itemsize].view(layout.dtype)
            self.frozen_flat = raw[layout.frozen_offset:].view(layout.frozen_dtype)
        self.rflat = replicated.detach().to(layout.dtype, copy=True)
        if layout.gather_formats is not None:  # quantized leaves as the gather would give them
            self.rflat = quantize_replicated(plan, layout.gather_formats, self.rflat, replicated)
        self.leaves, self.spans = {}, []
        for replicated, table in ((False, layout.leaves), (True, layout.replicated)):
            for path, start, stop, shape in table:
                if replicated:
                    t = self.rflat[start:stop].view(shape)
                elif start >= split and layout.frozen_plan is not None:
                    t = self.frozen_flat[start - split : stop - split].view(shape)
                else:
                    t = self.flat[start:stop].view(shape)
                self.leaves[path] = t
                if path not in layout.frozen:
                    self.spans.append((t.requires_grad_(), start, stop, replicated))
        self.flat.untyped_storage().resize_(0)
        self.state, self.handle, self.source = UnitState.FREE, None, None
        self.scheduled = False
        self.block = None

    @property
    def memory(self):
        """The key of the gathered memory for the streams strategy (``alloc`` / ``access`` /
        ``free``): its pool block's, or the unit's own where the storage is resized instead."""
        return self.block.key if self.block is not None else ("unit", self.layout.index)

    def materialize(self, pool, streams) -> int:
        """The storage gets memory on the gather stream (inside ``streams.on(GATHER)``); its bytes."""
        nbytes = self.layout.nbytes
        if _compat.CAN_SWAP_STORAGE:
            self.block = pool.take(nbytes, GATHER)
            attach(self.flat.untyped_storage(), self.block)
        else:
            self.flat.untyped_storage().resize_(nbytes)
            streams.alloc(GATHER, self.memory, nbytes)
        return nbytes

    def dematerialize(self, pool, streams) -> None:
        """The storage is released once the gather stream is past every read so far."""
        streams.access(COMPUTE, self.memory)  # the last read of this unit's parameters was queued before
        fence = streams.record(COMPUTE)
        if self.block is not None:
            detach(self.flat.untyped_storage(), self.block)
            pool.give(self.block, (fence,))
            self.block = None
        else:
            streams.wait(GATHER, fence)
            self.flat.untyped_storage().resize_(0)
            streams.free(self.memory)


class GradRecord:
    """One unit's gradient buffers for one call.

    Attributes:
        spans: ``(leaf, start, stop, replicated)`` of every trainable leaf (the unit record's).
        grad, rgrad: the flat gradient buffer and its replicated part (``written``: per leaf,
            whether its gradient is in), over pool blocks ``grad_block`` / ``rgrad_block``;
            ``held``: leaf gradients kept for now (see ``Gradients.unhold`` in ``_reducing.py``).
        reduced: reduce-scattered in this micro-batch (later gradients go to ``late`` / ``rlate``,
            over ``late_block`` / ``rlate_block``).
        used: per leaf, whether it got a gradient in any micro-batch of this call.
        grads_started: reduce-scatters issued before its first gradient (the memory hint).
    """

    __slots__ = ("spans", "grad", "rgrad", "written", "held", "reduced", "late", "rlate", "used", "grads_started",
                 "grad_block", "rgrad_block", "late_block", "rlate_block")

    def __init__(self, spans):
        self.spans = spans
        self.grad = self.rgrad = self.late = self.rlate = self.written = None
        self.grad_block = self.rgrad_block = self.late_block = self.rlate_block = None
        self.used = [False] * len(spans)
        self.new_micro_batch()

    def new_micro_batch(self):
        self.reduced, self.grads_started, self.held = False, None, []


class Cursor:
    """Where one call is in its program (see [Note: markers and tags]).

    Attributes:
        phase: ``"forward"`` or ``"backward"``; ``entry``: the forward entry entered last;
            ``event``: the next backward event to process (events run from the last down to 0).
        active: the unit the last torch call computed with (``None``: none yet).
        marker: the forward entry whose marker the next torch call places (``None``: placed).
        prefetch: the start event's prefetches, issued when backward first reaches the model.
        armed: ``id(leaf) -> entry``: markers that fired, proven once that leaf's gradient is in.
        engine_thread: the thread of this backward pass's first engine callback.
        busy: >0 while the runtime runs its own torch calls (see [Note: the runtime's own torch calls]).
        protect, deferred: units the torch call in progress reads, and frees put off until it returns.
    """

    __slots__ = ("phase", "entry", "event", "active", "marker", "prefetch", "armed", "engine_thread", "busy",
                 "protect", "deferred")

    def __init__(self):
        self.busy, self.engine_thread = 0, None
        self.protect: set[int] = set()
        self.deferred: set[int] = set()
        self.armed: dict[int, int] = {}

    def start_micro_batch(self, num_entries: int):
        self.phase, self.entry, self.event, self.active = "forward", -1, num_entries + 1, None
        self.marker, self.prefetch = None, []
