"""Per-unit records of the step's runtime, per call: :class:`UnitRecord` holds the unit's
gathered buffer, its leaves and their state (the run's), :class:`GradRecord` its gradient
buffers (the :class:`~ragged.fsdp._reducing.Gradients`'); no parallel lists."""

from __future__ import annotations

import enum

import torch
from ragged.transforms._quantized import quantize_replicated

__all__ = ["UnitRecord", "GradRecord", "UnitState", "storage_key"]


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
