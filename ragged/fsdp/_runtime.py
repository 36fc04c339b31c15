"""The effectful runtime of one call of the FSDP step: buffers, collectives, events.

:class:`Run` executes a :class:`~ragged.fsdp._schedule.Program`. The interceptors in
``_intercept.py`` only call its three entry points: :meth:`Run.use` (a torch call reads a
unit), :meth:`Run.saved` / :meth:`Run.restored` (autograd saves / unpacks a tensor) and
:meth:`Run.grad_ready` (a leaf's gradient is accumulated); markers call :meth:`Run.marker_fired`.

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

import collections
import hashlib
import threading

import torch

from ragged._errors import RaggedError
from ragged.fsdp._device import COMPUTE, GATHER, REDUCE, streams_for
from ragged.fsdp._pool import CAN_SWAP, Pool, attach, detach
from ragged.fsdp._records import UnitRecord, UnitState, storage_key
from ragged.fsdp._reducing import Reducing
from ragged.fsdp._schedule import Observation
from ragged.transforms._flat import _all_gather_flat_start

__all__ = ["Run", "ENGINE_THREADS_MSG"]

ENGINE_THREADS_MSG = (
    "rg.fsdp: autograd ran this backward pass on more than one thread (its nodes are on several devices, e.g. a "
    "loss computed on the CPU from GPU outputs, or two GPUs in one process), so the order the step relies on to "
    "free and reduce-scatter units during backward does not hold (see [Note: the marker argument on CUDA] in "
    "ragged/fsdp/_runtime.py). Every rank raises this, before any parameter changes. Fix: keep the model, its "
    "loss and the batch on the step's device (comm.device)."
)


_thread_id = threading.get_ident  # (a test replaces it)


class Run(Reducing):
    """State of one call: see the module docstring (the gradient half: :class:`Reducing`)."""

    def __init__(self, layouts, units, shards, comm, *, schedule, program, lazy, max_inflight_reduce, trace):
        self.layouts, self.comm, self.shards = layouts, comm, shards
        self.schedule, self.program, self.lazy = schedule, program, set(lazy)
        self.max_inflight, self.trace = max_inflight_reduce, ([] if trace else None)
        self.streams = streams_for(comm.device)
        self.pool = Pool(comm.device, self.streams)
        self.units = [UnitRecord(lay, shards[lay.name], comm.device) for lay in layouts]
        self.key_to_unit = {storage_key(u.flat): i for i, u in enumerate(self.units)}
        self.leaf_of = {id(t): (i, j) for i, u in enumerate(self.units) for j, (t, *_) in enumerate(u.spans)}
        self.params_tree = units.merge({lay.name: u.leaves for lay, u in zip(layouts, self.units)})
        self.hooks = [t.register_post_accumulate_grad_hook(self._hook(i, j))
                      for i, u in enumerate(self.units) for j, (t, *_) in enumerate(u.spans)]
        self.entries_of = collections.defaultdict(list)
        for c, i in enumerate(schedule.forward):
            self.entries_of[i].append(c)
        # units whose last gradients arrive in segment e - 1 (their reduce-scatter is at event e - 1)
        self.completing = collections.defaultdict(list)
        for i, e in enumerate(schedule.reduce_at):
            if e >= 0:
                self.completing[e + 1].append(i)
        self.digest = hashlib.blake2b(digest_size=8)
        self.grads, self.rep_grads = {}, {}
        self.rs_pending: collections.deque = collections.deque()
        self.used_entries: set[int] = set()
        self.inserts, self.missing, self.late_seen, self.deviations = [], [], [], []
        self.needs: set[tuple[int, int]] = set()
        self.live_bytes = self.peak_bytes = self.grad_live = self.grad_peak = 0
        self.num_gathers = self.num_reduces = self.saved_bytes = self.saved_peak = 0
        self.busy = 0
        self.protect: set[int] = set()
        self.deferred: set[int] = set()
        self.armed: dict[int, int] = {}
        self.foreign: dict[int, tuple] = {}  # nn.Parameters requiring grad that forward read and the step does not own
        self.engine_thread = None
        self.streams.begin_call()
        self.reset()

    def reset(self):
        """Start of a micro-batch."""
        self.phase, self.cursor, self.event, self.active = "forward", -1, len(self.schedule.forward) + 1, None
        self.marker_entry, self.pending_prefetch = None, []
        self.saved_peak, self.saved_bytes = max(self.saved_peak, self.saved_bytes), 0
        self.hold = set(self.lazy)  # units that keep autograd's leaf gradients for now (see Reducing._reduce)
        for u in self.units:
            u.reduced, u.grads_started, u.held = False, None, []

    # ---- bookkeeping -------------------------------------------------------------------------
    def _log(self, event: str, i: int):
        if self.trace is not None:
            self.trace.append((event, self.layouts[i].name, self.phase))

    def _issued(self, label: str):
        """Every collective of the program passes its label (unit, phase, position) here: folded
        into the digest the next call agrees on, and the one place to hand it to the wire."""
        self.digest.update(label.encode())

    def in_engine(self):
        """A callback from inside the autograd engine: see [Note: the marker argument on CUDA]."""
        t = _thread_id()
        if self.engine_thread is None:
            self.engine_thread = t
        elif t != self.engine_thread:
            raise RaggedError(ENGINE_THREADS_MSG)

    def foreign_read(self, p: torch.Tensor):
        if id(p) not in self.foreign:
            self.foreign[id(p)] = (p, p.grad)

    def foreign_grads(self) -> list:
        """Shapes of the parameters read in forward that are not the step's and got a gradient."""
        return [tuple(p.shape) for p, before in self.foreign.values() if p.grad is not None and p.grad is not before]

    def observation(self) -> Observation:
        return Observation(used=frozenset(self.used_entries), inserts=tuple(self.inserts), needs=frozenset(self.needs),
                           missing=tuple(self.missing), late=tuple(self.late_seen))

    # ---- gathered storage (see [Note: reusing unit buffers] in _pool.py) -----------------------
    def _materialize(self, i: int):
        """Unit ``i``'s storage gets memory on the gather stream (inside ``streams.on(GATHER)``)."""
        u, nbytes = self.units[i], self.layouts[i].nbytes
        if CAN_SWAP:
            u.block = self.pool.take(nbytes, GATHER)
            attach(u.flat.untyped_storage(), u.block)
        else:
            u.flat.untyped_storage().resize_(nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _dematerialize(self, i: int):
        """Unit ``i``'s storage is released once the gather stream is past every read so far."""
        u, streams = self.units[i], self.streams
        if u.block is not None:
            streams.access(COMPUTE, u.block.key)  # the last read of this unit's parameters was queued before
        fence = streams.record(COMPUTE)
        if u.block is not None:
            detach(u.flat.untyped_storage(), u.block)
            self.pool.give(u.block, (fence,))
            u.block = None
        else:
            streams.wait(GATHER, fence)
            u.flat.untyped_storage().resize_(0)
        self.live_bytes -= self.layouts[i].nbytes

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
                self._materialize(i)
            shard = self.shards[self.layouts[i].name]
            u.source = shard.data if shard.data.dtype == u.flat.dtype else shard.data.to(u.flat.dtype)
            self._issued(label)
            work = _all_gather_flat_start(shard.plan, u.flat, u.source, self.comm, label=label)
            streams.access(GATHER, ("shard", i))
            if u.block is not None:
                streams.access(GATHER, u.block.key, write=True)
            u.handle = streams.issued(GATHER, work)
        u.state, u.scheduled, u.served = UnitState.PENDING, True, False
        self.num_gathers += 1
        self._log("gather_start", i)

    def _wait(self, i: int):
        u = self.units[i]
        if u.state is UnitState.PENDING:
            self.streams.done(COMPUTE, u.handle)
            if u.block is not None:
                self.streams.access(COMPUTE, u.block.key)
            u.handle = u.source = None
            u.state = UnitState.READY
            self._log("gather_done", i)

    def _release(self, i: int):
        u = self.units[i]
        if u.state is UnitState.FREE:
            return
        self._wait(i)
        self._dematerialize(i)
        u.state, u.served = UnitState.FREE, False
        if self.active == i:
            self.active = None
        self._log("free", i)

    def _plan_free(self, i: int):
        self.units[i].scheduled = False
        if i in self.protect:  # read by the torch call in progress: free once it returns
            self.deferred.add(i)
        else:
            self._release(i)

    def _serve_zeros(self, i: int, what: str):
        """A deviation: the schedule has unit ``i`` freed here. Communicating now would pair with
        another collective on the peers, so this rank computes on zeros and reports it."""
        self.deviations.append(what)
        u, streams = self.units[i], self.streams
        self._wait(i)
        if u.state is UnitState.READY:
            streams.wait(GATHER, streams.record(COMPUTE))
        with streams.on(GATHER):
            if u.state is UnitState.FREE:
                self._materialize(i)
            with torch.no_grad():
                u.flat.zero_()
            if u.block is not None:
                streams.access(GATHER, u.block.key, write=True)
            done = streams.record(GATHER)
        streams.wait(COMPUTE, done)
        u.state, u.served = UnitState.READY, True
        self.pool.settle()

    # ---- forward -----------------------------------------------------------------------------
    def _enter(self, c: int):
        frees, gathers = self.program.forward[c]
        for i in frees:
            self._plan_free(i)
        for i in gathers:
            self._gather_unit_start(i, f"gather {self.layouts[i].name} forward entry {c}")
        self.cursor = c
        if self.marker_entry is None:
            self.marker_entry = c

    def use(self, i: int, tag: int | None = None):
        """A torch call (``tag is None``) or an unpacked saved tensor (``tag``: its entry) reads unit ``i``."""
        self.busy += 1
        try:
            u = self.units[i]
            if self.phase == "forward":
                fwd = self.schedule.forward
                if self.cursor < 0 or fwd[self.cursor] != i:
                    nxt = next((c for c in self.entries_of[i] if c > self.cursor), None)
                    if nxt is not None:
                        for c in range(self.cursor + 1, nxt + 1):
                            self._enter(c)
                        self.pool.settle()
                    elif u.state is UnitState.FREE:
                        self.inserts.append((self.cursor + 1, i))
                        self._serve_zeros(i, f"unit {self.layouts[i].name!r} read in forward after entry "
                                             f"{self.cursor}, where the schedule has no entry of it")
                if self.cursor >= 0 and fwd[self.cursor] == i:
                    self.used_entries.add(self.cursor)
            else:
                self.in_engine()
                self._prefetch_pending()
                if tag is not None:
                    self.reached(tag + 2)
                self.needs.add((self.event - 1, i))
                if u.state is UnitState.FREE:
                    self.missing.append((self.event - 1, i))
                    self._serve_zeros(i, f"unit {self.layouts[i].name!r} read in backward segment {self.event - 1}, "
                                         "where the schedule has it freed")
            self._wait(i)
            if self.active != i:
                self.active = i
                self._log("compute", i)
        finally:
            self.busy -= 1

    def end_forward(self):
        """After the loss: the rest of the forward entries (gathers peers may be waiting for)."""
        self.busy += 1
        try:
            for c in range(self.cursor + 1, len(self.schedule.forward)):
                self._enter(c)
            self.marker_entry = None
            self.pool.settle()
        finally:
            self.busy -= 1

    def call_done(self):
        """The torch call that read units returned: deferred frees run now."""
        self.protect = set()
        self.marker_entry = None
        if self.deferred:
            for i in sorted(self.deferred):
                if not self.units[i].scheduled:
                    self._release(i)
            self.deferred = set()
            self.pool.settle()

    # ---- saved tensors -----------------------------------------------------------------------
    def saved(self, t: torch.Tensor):
        i = self.key_to_unit.get(storage_key(t))
        forward = self.phase == "forward"
        if i is None:
            if not forward:
                return t
            self.saved_bytes += t.numel() * t.element_size()
            return self.cursor, t
        return (i, t.storage_offset(), tuple(t.shape), tuple(t.stride()), self.cursor if forward else None)

    def restored(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if len(packed) == 2:
            tag, t = packed
            if self.phase == "backward" and tag is not None and self.event > tag + 2:
                self.in_engine()
                self.busy += 1
                try:
                    self.reached(tag + 2)
                finally:
                    self.busy -= 1
            return t
        i, offset, size, stride, tag = packed
        if self.phase != "backward":
            tag = None
        if self.active != i or self.units[i].state is not UnitState.READY or (tag is not None and self.event > tag + 2):
            self.use(i, tag)
        return self.units[i].flat.as_strided(size, stride, offset)

    # ---- backward events -----------------------------------------------------------------------
    def begin_backward(self):
        self.phase = "backward"
        self.engine_thread = None
        self.busy += 1
        try:
            self.reached(len(self.schedule.forward))
            self.pending_prefetch = list(self.program.start_prefetch)
        finally:
            self.busy -= 1

    def _prefetch_pending(self):
        while self.pending_prefetch:
            i = self.pending_prefetch.pop(0)
            self._gather_unit_start(i, f"gather {self.layouts[i].name} backward start (prefetch)")

    def marker_fired(self, entry: int, leaf_id: int):
        """The marker of ``entry`` ran: event ``entry`` holds once that leaf's gradient is in."""
        self.in_engine()
        self.armed[leaf_id] = min(entry, self.armed.get(leaf_id, entry))

    def reached(self, e: int):
        """Processes events down to ``e`` (each proven: see [Note: markers and tags])."""
        self._prefetch_pending()
        self._finish_completed()
        while self.event > max(e, 0):
            self.event -= 1
            reduces, frees, gathers = self.program.backward[self.event]
            for i in reduces:
                self._reduce(i, f"reduce-scatter {self.layouts[i].name} backward event {self.event}")
            for i in frees:
                self._plan_free(i)
            for i in self.completing.get(self.event, ()):
                if i in self.hold:
                    self._unhold(i)
            for i in gathers:
                self._gather_unit_start(i, f"gather {self.layouts[i].name} backward event {self.event}")
        self.pool.settle()

    def end_backward(self):
        """After the engine (or instead of it, when the loss failed): every remaining action."""
        self.busy += 1
        try:
            self.phase = "backward"
            self.reached(0)
            for i in self.program.end:
                self._reduce(i, f"reduce-scatter {self.layouts[i].name} after backward")
            for i in range(len(self.units)):
                self._plan_free(i)
            self.armed = {}
            self.active = None
            self.pool.settle()
        finally:
            self.busy -= 1

    def close(self):
        """Breaks the leaf -> hook -> run cycle (through C++ hook storage the garbage collector
        cannot see) and drops every buffer of this call."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        streams = self.streams
        while self.rs_pending:  # only after a failure: not waited on the host (peers may never issue theirs)
            _, pending, block, _ = self.rs_pending.popleft()
            with streams.on(REDUCE):
                for h in pending.handles:
                    streams.issued(REDUCE, h)
                done = streams.record(REDUCE)
            if block is not None:
                self.pool.give(block, (done,))
        for i, u in enumerate(self.units):
            if u.state is not UnitState.FREE:
                self._release(i)
            # a leaf that outlives the call (kept by the loss or a traceback) must not point into
            # released storage: printing it would read freed memory
            for t, *_ in u.spans:
                t.data = t.data.new_empty((0,))
            for blk in (u.grad_block, u.rgrad_block, u.late_block, u.rlate_block):
                if blk is not None:
                    self.pool.give(blk, (streams.record(COMPUTE),))
            u.grad = u.rgrad = u.late = u.rlate = u.source = u.handle = None
            u.grad_block = u.rgrad_block = u.late_block = u.rlate_block = None
            u.held = []
        self.pool.settle()
        self.streams.end_call()
        self.units = []
        self.params_tree, self.foreign = None, {}
        self.key_to_unit, self.leaf_of = {}, {}
