"""The effectful runtime of one call of the FSDP step: buffers, collectives, events.

:class:`Run` executes a :class:`~ragged.fsdp._schedule.Program`. The interceptors
(``_intercept.py``) and compiled regions (``_compiled.py``) reach it only through these methods
and read-only properties, and assign none of its fields: :meth:`Run.read` (a torch call or a
compiled module reads units), :meth:`Run.saved` / :meth:`Run.restored` (autograd saves / unpacks
a tensor), :meth:`Run.grad_ready` (a leaf's gradient is accumulated, through the hooks it
registers itself), :meth:`Run.take_marker` and :meth:`Run.marker_fired` (markers),
:meth:`Run.unit_of` / :meth:`Run.is_leaf` (what a tensor is), :meth:`Run.foreign_read`, and
``busy`` / ``phase``. What a call saw lives in its :class:`~ragged.fsdp._observed.Observer` and
:class:`~ragged.fsdp._observed.Counters`.

[Note: markers and tags]
Entering forward entry ``c`` inside a torch call wraps the first leaf that call reads in an
identity autograd function (the marker) created before the op itself. Autograd runs a node only
after every reachable node created later (the CPU engine pops ready nodes by decreasing
sequence number; gradient accumulation has the highest), and the leaf's own accumulation runs
right after the marker, so when that accumulation is done every forward node from entry ``c`` on
has run: that is event ``c`` (see [Note: a collective order that does not depend on data] in
``_schedule.py``). The marker is on the leaf rather than on the call's activation input so that
the embedding (integer input) gets one too, and so that no activation the model may later
modify in place becomes a view made by a custom function. Every tensor saved in forward is
packed with the entry it was saved in (its *tag*): when the node that saved it unpacks it, it runs
in segment ``q`` or earlier, so events ``> q`` hold; the runtime takes only events ``> q + 1``,
because ``torch.utils.checkpoint`` (non-reentrant) unpacks a region's inputs, saved just before
the region's first entry, while it recomputes that region. Tags cover entries without a marker
(reads under ``no_grad``: a reentrant checkpoint's forward). Events are processed in order, only
once shown; anything that still arrives too early is exact through the late path and teaches the
schedule (``_schedule.py``).

[Note: the marker argument on CUDA]
The argument above is about one ready queue. torch's engine (``torch/csrc/autograd/engine.cpp``,
``engine.h``) keeps one per device: ``ready_queue(cpu_ready_queue, input_buffer.device())``
sends a node to the CPU queue of the graph task (popped by the thread that called backward)
or to its CUDA device's queue (popped by that device's one worker thread, shared by every graph
task); every queue pops ready nodes by reentrant depth, then by decreasing ``sequence_nr``
(``CompareNodeTaskTime``), and a node goes to the queue of the device its incoming gradients are on. So
when every node of the backward pass is on one device (the model, its loss and the leaves on
one GPU, the usual case) there is one queue and one thread, and the argument holds as on the
CPU: the markers, the gradient hooks and the unpacks all run on the device thread, in the same
order. It fails when nodes sit on several devices (a loss computed on the CPU from GPU logits,
two GPUs in one process): two threads pop two queues concurrently, so a marker may run while a
node created later still waits in the other queue, and the runtime's callbacks could interleave.
The runtime does not trust it then: every callback from inside the engine checks that it runs
on the one thread that made the first callback of this backward pass, and a callback from
another thread raises :data:`ENGINE_THREADS_MSG` before changing anything (every rank then raises
it at the end-of-call agreement, before any parameter changes). Events themselves are host-side
and cheap: on CUDA the kernels of the nodes before a marker are only queued when it fires, so
what an event frees is ordered by the stream events of [Note: streams and lifetimes] in
``_device.py``, not by the host.

[Note: the runtime's own torch calls]
Backward runs with the function mode active (see [Note: backward under the mode] in
``_intercept.py``), so the runtime's own copies and collectives would be seen as reads;
``busy`` is raised around them.
"""

from __future__ import annotations

import threading

import torch

from ragged._errors import RaggedError
from ragged.fsdp._device import COMPUTE, GATHER, streams_for
from ragged.fsdp._pool import Pool
from ragged.fsdp._records import Cursor, UnitRecord, UnitState, storage_key
from ragged.fsdp._reducing import Gradients
from ragged.fsdp._observed import Counters, Observer, tracer
from ragged.fsdp._schedule import Context
from ragged.transforms._flat import _all_gather_flat_start
from ragged.transforms._quantized import unit_gather_start as quantized_gather_start

__all__ = ["Run", "ENGINE_THREADS_MSG"]

ENGINE_THREADS_MSG = (
    "rg.fsdp: autograd ran this backward pass on more than one thread (its nodes are on several devices, e.g. a "
    "loss computed on the CPU from GPU outputs, or two GPUs in one process), so the order the step relies on to "
    "free and reduce-scatter units during backward does not hold (see [Note: the marker argument on CUDA] in "
    "ragged/fsdp/_runtime.py). Every rank raises this, before any parameter changes. Fix: keep the model, its "
    "loss and the batch on the step's device (comm.device)."
)


_thread_id = threading.get_ident  # (a test replaces it)


class Run:
    """State of one call: see the module docstring. Its parts: the :class:`Context`, the
    :class:`Cursor`, one :class:`~ragged.fsdp._records.UnitRecord` per unit (and the indexes of
    their storages and leaves), the :class:`~ragged.fsdp._reducing.Gradients`, and what the call
    saw (:class:`~ragged.fsdp._observed.Observer`, :class:`~ragged.fsdp._observed.Counters`)."""

    def __init__(self, layouts, units, shards, comm, *, schedule, program, lazy, max_inflight_reduce, trace, chunks=None):
        self.ctx, self.cursor = Context.of(layouts, schedule, program), Cursor()
        self.comm, self.shards = comm, shards
        self.trace = trace if callable(trace) else [] if trace else None
        self.log = tracer(self.trace, self.cursor, layouts)
        self.streams = streams_for(comm.device)
        self.pool = Pool(comm.device, self.streams)
        self.units = [UnitRecord(lay, shards[lay.name].plan, shards[lay.name].replicated, comm.device) for lay in layouts]
        self.key_to_unit = {storage_key(u.flat): i for i, u in enumerate(self.units)}
        self.leaf_of = {id(t): (i, j) for i, u in enumerate(self.units) for j, (t, *_) in enumerate(u.spans)}
        self.params_tree = units.merge({lay.name: u.leaves for lay, u in zip(layouts, self.units)})
        self.hooks = [t.register_post_accumulate_grad_hook(self._hook(i, j))
                      for i, u in enumerate(self.units) for j, (t, *_) in enumerate(u.spans)]
        self.seen, self.counts = Observer(), Counters()
        self.gradients = Gradients(layouts, [u.spans for u in self.units], pool=self.pool, streams=self.streams, comm=comm,
                                   counts=self.counts, seen=self.seen, log=self.log,
                                   max_inflight=max_inflight_reduce, lazy=lazy, chunks=chunks)
        self.streams.begin_call()
        self.reset()

    busy = property(lambda self: self.cursor.busy, doc="Whether the runtime runs its own torch calls.")
    phase = property(lambda self: self.cursor.phase, doc='``"forward"`` or ``"backward"``.')

    def reset(self):
        """Start of a micro-batch."""
        self.cursor.start_micro_batch(len(self.ctx.schedule.forward))
        self.counts.new_micro_batch()
        self.gradients.new_micro_batch()

    # ---- what the interceptors call (see the module docstring) ------------------------------------
    def unit_of(self, t: torch.Tensor) -> int | None:
        """The unit whose gathered storage ``t`` is a view of (``None``: not a unit's)."""
        return self.key_to_unit.get(storage_key(t))

    def is_leaf(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of the step's trainable leaves (a marker may wrap it)."""
        return id(t) in self.leaf_of

    def take_marker(self) -> int | None:
        """The forward entry whose marker the current call should place (once)."""
        entry, self.cursor.marker = self.cursor.marker, None
        return entry

    def foreign_read(self, p: torch.Tensor) -> None:
        self.seen.foreign_read(p)

    def read(self, touched, call):
        """Runs ``call(mark)``, a call that reads the units ``touched``, with each of them gathered
        (moving the schedule on, see :meth:`use`) and none freed before it returns; ``mark``:
        whether the call should place the marker of the entry just entered (see [Note: markers and
        tags])."""
        self.cursor.protect = set(touched)
        try:
            for i in touched:
                if i != self.cursor.active or self.units[i].state is not UnitState.READY or self.cursor.phase == "forward" and (
                        self.cursor.entry < 0 or self.ctx.schedule.forward[self.cursor.entry] != i):
                    self.use(i)
            return call(self.cursor.marker is not None and torch.is_grad_enabled())
        finally:
            self.call_done()

    def _hook(self, i: int, j: int):
        def hook(t: torch.Tensor):
            self.grad_ready(i, j, t)
        return hook

    def grad_ready(self, i: int, j: int, t: torch.Tensor):
        """Trainable leaf ``j`` of unit ``i`` has its gradient for this micro-batch (its hook)."""
        backward = self.cursor.phase == "backward"
        if backward:
            self.in_engine()
        self.cursor.busy += 1
        try:
            if t.grad is not None:
                self.gradients.arrived(i, j, t, self.cursor.event - 1 if backward else -1)
            entry = self.cursor.armed.pop(id(t), None)
            if entry is not None:
                self.reached(entry)
        finally:
            self.cursor.busy -= 1

    def in_engine(self):
        """A callback from inside the autograd engine: see [Note: the marker argument on CUDA]."""
        t = _thread_id()
        if self.cursor.engine_thread is None:
            self.cursor.engine_thread = t
        elif t != self.cursor.engine_thread:
            raise RaggedError(ENGINE_THREADS_MSG)

    # ---- gathered storage (see [Note: reusing unit buffers] in _pool.py) -----------------------
    # ---- parameters: the one all-gather call site ----------------------------------------------
    def _gather_unit_start(self, i: int, label: str):
        """Issues unit ``i``'s all-gather (every rank issues it at the same point of the program)."""
        u, streams = self.units[i], self.streams
        if u.state is UnitState.PENDING:
            self._wait(i)
        if u.state is UnitState.READY:  # zeros served after a deviation: compute may still read them
            streams.wait(GATHER, streams.record(COMPUTE))
        with streams.on(GATHER):
            if u.state is UnitState.FREE:
                self.counts.gathered(u.materialize(self.pool, self.streams))
            lay, shard = self.ctx.layouts[i], self.shards[self.ctx.layouts[i].name]
            if lay.gather_formats is not None:  # one collective of codes, scales and values for the whole unit
                parts = []
                u.source, works = [shard.data], [quantized_gather_start(lay, u, shard, self.comm, label)]
            elif lay.frozen_plan is None:  # one dtype: one launch for every buffer
                parts = [(shard.plan, u.flat, shard.data, label)]
            else:  # the frozen part in its own dtype: its own call, after the trainable part's
                n = lay.grad_plan.shard_size if lay.grad_plan is not None else 0
                parts = [(lay.frozen_plan, u.frozen_flat, shard.data[n:], label + " (frozen part)")]
                if n:
                    parts.insert(0, (lay.grad_plan, u.flat, shard.data[:n], label))
            if parts:
                u.source, works = [], []
            for plan, out, data, what in parts:
                u.source.append(data if data.dtype == out.dtype else data.to(out.dtype))
                works.append(_all_gather_flat_start(plan, out, u.source[-1], self.comm, label=what))
            streams.access(GATHER, ("shard", i))
            streams.access(GATHER, self.units[i].memory, write=True)
            u.handle = [streams.issued(GATHER, w) for w in works]
        u.state, u.scheduled = UnitState.PENDING, True
        self.counts.gathers += 1
        self.log("gather_start", i)

    def _wait(self, i: int):
        u = self.units[i]
        if u.state is UnitState.PENDING:
            for h in u.handle:
                self.streams.done(COMPUTE, h)
            self.streams.access(COMPUTE, self.units[i].memory)
            u.handle = u.source = None
            u.state = UnitState.READY
            self.log("gather_done", i)

    def _release(self, i: int):
        u = self.units[i]
        if u.state is UnitState.FREE:
            return
        self._wait(i)
        self.units[i].dematerialize(self.pool, self.streams)
        self.counts.live -= self.ctx.layouts[i].nbytes
        u.state = UnitState.FREE
        if self.cursor.active == i:
            self.cursor.active = None
        self.log("free", i)

    def _plan_free(self, i: int):
        self.units[i].scheduled = False
        if i in self.cursor.protect:  # read by the torch call in progress: free once it returns
            self.cursor.deferred.add(i)
        else:
            self._release(i)

    def _serve_zeros(self, i: int, what: str):
        """A deviation: the schedule has unit ``i`` freed here. Communicating now would pair with
        another collective on the peers, so this rank computes on zeros and reports it."""
        self.seen.deviations.append(what)
        u, streams = self.units[i], self.streams
        self._wait(i)
        if u.state is UnitState.READY:
            streams.wait(GATHER, streams.record(COMPUTE))
        with streams.on(GATHER):
            if u.state is UnitState.FREE:
                self.counts.gathered(u.materialize(self.pool, self.streams))
            with torch.no_grad():
                u.flat.zero_()
                u.frozen_flat.zero_()
            streams.access(GATHER, self.units[i].memory, write=True)
            done = streams.record(GATHER)
        streams.wait(COMPUTE, done)
        u.state = UnitState.READY
        self.pool.settle()

    # ---- forward -----------------------------------------------------------------------------
    def _enter(self, c: int):
        self.log("enter", self.ctx.schedule.forward[c])
        frees, gathers = self.ctx.program.forward[c]
        for i in frees:
            self._plan_free(i)
        for i in gathers:
            self._gather_unit_start(i, f"gather {self.ctx.layouts[i].name} forward entry {c}")
        self.cursor.entry = c
        if self.cursor.marker is None:
            self.cursor.marker = c

    def use(self, i: int, tag: int | None = None):
        """A torch call (``tag is None``) or an unpacked saved tensor (``tag``: its entry) reads unit ``i``."""
        self.cursor.busy += 1
        try:
            u = self.units[i]
            if self.cursor.phase == "forward":
                fwd = self.ctx.schedule.forward
                if self.cursor.entry < 0 or fwd[self.cursor.entry] != i:
                    nxt = next((c for c in self.ctx.entries_of[i] if c > self.cursor.entry), None)
                    if nxt is not None:
                        for c in range(self.cursor.entry + 1, nxt + 1):
                            self._enter(c)
                        self.pool.settle()
                    elif u.state is UnitState.FREE:
                        self.seen.inserts.append((self.cursor.entry + 1, i))
                        self._serve_zeros(i, f"unit {self.ctx.layouts[i].name!r} read in forward after entry "
                                             f"{self.cursor.entry}, where the schedule has no entry of it")
                if self.cursor.entry >= 0 and fwd[self.cursor.entry] == i:
                    self.seen.used.add(self.cursor.entry)
            else:
                self.in_engine()
                self._prefetch_pending()
                if tag is not None:
                    self.reached(tag + 2)
                self.seen.needs.add((self.cursor.event - 1, i))
                if u.state is UnitState.FREE:
                    self.seen.missing.append((self.cursor.event - 1, i))
                    self._serve_zeros(i, f"unit {self.ctx.layouts[i].name!r} read in backward segment {self.cursor.event - 1}, "
                                         "where the schedule has it freed")
            self._wait(i)
            if self.cursor.active != i:
                self.cursor.active = i
                self.log("compute", i)
        finally:
            self.cursor.busy -= 1

    def end_forward(self):
        """After the loss: the rest of the forward entries (gathers peers may be waiting for)."""
        self.cursor.busy += 1
        try:
            for c in range(self.cursor.entry + 1, len(self.ctx.schedule.forward)):
                self._enter(c)
            self.cursor.marker = None
            self.pool.settle()
        finally:
            self.cursor.busy -= 1

    def call_done(self):
        """The torch call that read units returned: deferred frees run now."""
        self.cursor.protect = set()
        self.cursor.marker = None
        if self.cursor.deferred:
            for i in sorted(self.cursor.deferred):
                if not self.units[i].scheduled:
                    self._release(i)
            self.cursor.deferred = set()
            self.pool.settle()

    # ---- saved tensors -----------------------------------------------------------------------
    def saved(self, t: torch.Tensor):
        i = self.key_to_unit.get(storage_key(t))
        forward = self.cursor.phase == "forward"
        if i is None:
            if not forward:
                return t
            self.counts.saved += t.numel() * t.element_size()
            return self.cursor.entry, t
        return (i, t.storage_offset(), tuple(t.shape), tuple(t.stride()), self.cursor.entry if forward else None,
                t.dtype)

    def restored(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if len(packed) == 2:
            tag, t = packed
            if self.cursor.phase == "backward" and tag is not None and self.cursor.event > tag + 2:
                self.in_engine()
                self.cursor.busy += 1
                try:
                    self.reached(tag + 2)
                finally:
                    self.cursor.busy -= 1
            return t
        i, offset, size, stride, tag, dtype = packed
        if self.cursor.phase != "backward":
            tag = None
        if self.cursor.active != i or self.units[i].state is not UnitState.READY or (tag is not None and self.cursor.event > tag + 2):
            self.use(i, tag)
        u = self.units[i]
        return (u.flat if dtype == u.flat.dtype else u.frozen_flat).as_strided(size, stride, offset)

    # ---- backward events -----------------------------------------------------------------------
    def begin_backward(self):
        self.cursor.phase = "backward"
        self.cursor.engine_thread = None
        self.cursor.busy += 1
        try:
            self.reached(len(self.ctx.schedule.forward))
            self.cursor.prefetch = list(self.ctx.program.start_prefetch)
        finally:
            self.cursor.busy -= 1

    def _prefetch_pending(self):
        while self.cursor.prefetch:
            i = self.cursor.prefetch.pop(0)
            self._gather_unit_start(i, f"gather {self.ctx.layouts[i].name} backward start (prefetch)")

    def marker_fired(self, entry: int, leaf_id: int):
        """The marker of ``entry`` ran: event ``entry`` holds once that leaf's gradient is in."""
        self.in_engine()
        self.cursor.armed[leaf_id] = min(entry, self.cursor.armed.get(leaf_id, entry))

    def reached(self, e: int):
        """Processes events down to ``e`` (each proven: see [Note: markers and tags])."""
        self._prefetch_pending()
        self.gradients.finish_completed()
        while self.cursor.event > max(e, 0):
            self.cursor.event -= 1
            fwd = self.ctx.schedule.forward
            self.log("event", fwd[self.cursor.event] if self.cursor.event < len(fwd) else None)
            reduces, frees, gathers = self.ctx.program.backward[self.cursor.event]
            for i in reduces:
                self.gradients.reduce(i, f"reduce-scatter {self.ctx.layouts[i].name} backward event {self.cursor.event}")
            for i in frees:
                self._plan_free(i)
            for i in self.ctx.completing.get(self.cursor.event, ()):
                if i in self.gradients.hold:
                    self.gradients.unhold(i)
            for i in gathers:
                self._gather_unit_start(i, f"gather {self.ctx.layouts[i].name} backward event {self.cursor.event}")
        self.pool.settle()

    def end_backward(self):
        """After the engine (or instead of it, when the loss failed): every remaining action."""
        self.cursor.busy += 1
        try:
            self.cursor.phase = "backward"
            self.reached(0)
            for i in self.ctx.program.end:
                self.gradients.reduce(i, f"reduce-scatter {self.ctx.layouts[i].name} after backward")
            for i in range(len(self.units)):
                self._plan_free(i)
            self.cursor.armed = {}
            self.cursor.active = None
            self.pool.settle()
        finally:
            self.cursor.busy -= 1

    def close(self):
        """Breaks the leaf -> hook -> run cycle (through C++ hook storage the garbage collector
        cannot see) and drops every buffer of this call."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.gradients.close()
        for i, u in enumerate(self.units):
            if u.state is not UnitState.FREE:
                self._release(i)
            # a leaf that outlives the call (kept by the loss or a traceback) must not point into
            # released storage: printing it would read freed memory
            for t in u.leaves.values():
                t.data = t.data.new_empty((0,))
            u.source = u.handle = None
        self.pool.settle()
        self.streams.end_call()
        self.units = []
        self.params_tree = None
        self.seen.foreign.clear()
        self.key_to_unit, self.leaf_of = {}, {}
