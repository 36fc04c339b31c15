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

[Note: when a flat gradient buffer is freed]
A unit's flat gradient buffer (from the pool, see [Note: reusing unit buffers] in ``_pool.py``)
is taken when its first gradient arrives and given back when its reduce-scatter, which reads
it, is waited. That happens at the latest when ``max_inflight_reduce`` are in flight and another
starts (the bound: the host waits, on CUDA the compute stream), and as soon as the handle says
the collective is done otherwise: finished reduce-scatters are waited before a unit takes a new
buffer and at every backward event, so with a fast network one buffer fills while none is in
flight. Results do not depend on when (each unit's parts are accumulated in issue order); the
memory does, within that bound. A unit whose gradients arrive at both ends of backward (the
head and the embedding in one unit) holds autograd's leaf gradients instead of a buffer in
between (the learnt ``lazy`` hint: a held head gradient is smaller than the unit), and copies
them into its buffer at the event before the segment that makes its last ones, after waiting
for the reduce-scatters in flight: at the end of backward only its buffer and the last
gradients are alive (``Run._unhold``).

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
from ragged.collectives._base import completed
from ragged.fsdp._device import COMPUTE, GATHER, REDUCE, streams_for
from ragged.fsdp._pool import CAN_SWAP, Pool, attach, detach
from ragged.fsdp._records import UnitRecord, UnitState, storage_key
from ragged.fsdp._schedule import Observation
from ragged.transforms import all_gather_flat, reduce_scatter_wait
from ragged.transforms._reduce_scatter import _reduce_scatter_start

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
    """State of one call: see the module docstring."""

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
        self.hold = set(self.lazy)  # units that keep autograd's leaf gradients for now (see _reduce)
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
            work = all_gather_flat(shard.plan, u.flat, u.source, self.comm, async_op=True)
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

    # ---- gradients: the one reduce-scatter call site ---------------------------------------------
    def _hook(self, i: int, j: int):
        def hook(t: torch.Tensor):
            self.grad_ready(i, j, t)
        return hook

    def grad_ready(self, i: int, j: int, t: torch.Tensor):
        """Leaf ``j`` of unit ``i`` has its gradient for this micro-batch."""
        if self.phase == "backward":
            self.in_engine()
        self.busy += 1
        try:
            if t.grad is not None:
                u = self.units[i]
                u.used[j] = True
                if u.reduced:  # after the unit's reduce-scatter: exact through the late buffer
                    self.late_seen.append((i, self.event - 1 if self.phase == "backward" else -1))
                    self._copy_grad(i, j, t, late=True)
                else:
                    if u.grads_started is None:
                        u.grads_started = self.num_reduces
                    if i in self.hold:
                        u.held.append((j, t))  # keep autograd's tensor for now (see _reduce)
                    else:
                        self._copy_grad(i, j, t)
            entry = self.armed.pop(id(t), None)
            if entry is not None:
                self.reached(entry)
        finally:
            self.busy -= 1

    def _buffers(self, i: int, late: bool):
        """The unit's flat gradient buffer (laid out like the gathered one) and its replicated part.

        The normal buffer is uninitialised memory with zeroed padding (each leaf's first gradient
        is copied in, a second one added; leaves without one are zeroed at the reduce-scatter);
        the late buffer is zeros. Both are written on compute."""
        u, lay = self.units[i], self.layouts[i]
        g = u.late if late else u.grad
        if g is None:
            self._finish_completed()  # their buffers first
            block = self.pool.take(lay.nbytes, COMPUTE)
            g = block.tensor(lay.dtype, lay.numel)
            self.streams.access(COMPUTE, block.key, write=True)
            if late:
                u.late, u.late_block = g, block
                g.zero_()
            else:
                u.grad, u.grad_block = g, block
                for lo, hi in lay.gaps:
                    g[lo:hi].zero_()
                u.written = [False] * len(u.spans)
                self.grad_live += lay.nbytes
                self.grad_peak = max(self.grad_peak, self.grad_live)
        r = u.rlate if late else u.rgrad
        if r is None:
            rblock = self.pool.take(lay.replicated_numel * g.element_size(), COMPUTE) if lay.replicated_numel else None
            r = rblock.tensor(lay.dtype, lay.replicated_numel).zero_() if rblock else g.new_zeros(0)
            if rblock is not None:
                self.streams.access(COMPUTE, rblock.key, write=True)
            if late:
                u.rlate, u.rlate_block = r, rblock
            else:
                u.rgrad, u.rgrad_block = r, rblock
        return g, r

    def _copy_grad(self, i: int, j: int, t: torch.Tensor, late: bool = False):
        u = self.units[i]
        _, start, stop, replicated = u.spans[j]
        g, r = self._buffers(i, late)
        with torch.no_grad():
            dst = (r if replicated else g)[start:stop].view(t.shape)
            if late or replicated or u.written[j]:
                dst.add_(t.grad)
            else:
                dst.copy_(t.grad)
                u.written[j] = True
        t.grad = None

    def _unhold(self, i: int):
        """Unit ``i`` held autograd's leaf gradients (e.g. the head's, next to the embedding in one
        unit) and its last ones arrive in the next segment: its buffer now, after the reduce-scatters
        in flight (their buffers go first), so that the held gradients are gone before the last ones
        are made."""
        self.hold.discard(i)
        u = self.units[i]
        if u.held:
            self._finish_inflight()
            self.pool.settle()
            for j, t in u.held:
                self._copy_grad(i, j, t)
            u.held = []

    def _reduce(self, i: int, label: str):
        u = self.units[i]
        for j, t in u.held:
            self._copy_grad(i, j, t)
        u.held = []
        self.hold.discard(i)
        # a unit whose gradients arrive around other units' reduce-scatters (embedding and head in
        # one unit) keeps autograd's leaf gradients until just before its last ones next time (a
        # hint: memory only; see _unhold)
        if u.grads_started is not None and self.num_reduces > u.grads_started:
            self.lazy.add(i)
        elif u.grads_started is not None:
            self.lazy.discard(i)
        g, r = self._buffers(i, late=False)
        with torch.no_grad():
            for (_, start, stop, replicated), written in zip(u.spans, u.written):
                if not (written or replicated):
                    g[start:stop].zero_()
        blocks = (u.grad_block, u.rgrad_block)
        u.grad = u.rgrad = u.written = u.grad_block = u.rgrad_block = None
        u.reduced = True
        self.num_reduces += 1
        pending, kept = self._reduce_scatter_unit_start(i, g, r, blocks, label)
        if kept is None:  # given back at the start (see _reduce_scatter_unit_start)
            self.grad_live -= self.layouts[i].nbytes
        self.rs_pending.append((i, pending, kept, self.layouts[i].nbytes if kept is not None else 0))
        self._log("reduce_start", i)
        while len(self.rs_pending) > self.max_inflight:
            self.finish_oldest_reduce()

    def _reduce_scatter_unit_start(self, i: int, grad: torch.Tensor, replicated: torch.Tensor, blocks, label: str):
        """Issues unit ``i``'s reduce-scatter of ``grad`` (and all-reduce of ``replicated``) on the
        reduce stream, after every copy into them (see [Note: streams and lifetimes] in
        ``_device.py``). Returns the pending reduce-scatter and the gradient block it still reads
        (``None``: a buffer only read by a cast to the reduce dtype is given back at once, as is
        the replicated part, which is always copied)."""
        plan, streams = self.shards[self.layouts[i].name].plan, self.streams
        rep = replicated if plan.replicated else None
        for b in blocks:
            if b is not None:
                streams.access(COMPUTE, b.key, write=True)
        ready = streams.record(COMPUTE)
        self._issued(label)
        with streams.on(REDUCE):
            streams.wait(REDUCE, ready)
            for b in blocks:
                if b is not None:
                    streams.access(REDUCE, b.key)
            pending = _reduce_scatter_start(plan, grad, self.comm, "mean", self.layouts[i].reduce_dtype, replicated=rep,
                                            agreed=True)
            read = streams.record(REDUCE)  # after the casts: the copies are all the collectives read
            for h in pending.handles:
                streams.issued(REDUCE, h)
        gblock, rblock = blocks
        if rblock is not None:
            self.pool.give(rblock, (read,))
        if pending.source.data_ptr() != grad.data_ptr():  # cast: the collective reads the copy
            self.pool.give(gblock, (read,))
            gblock = None
        return pending, gblock

    def finish_oldest_reduce(self):
        i, pending, block, counted = self.rs_pending.popleft()
        streams = self.streams
        with streams.on(REDUCE):
            reduced = reduce_scatter_wait(pending)
            name = self.layouts[i].name
            for acc, part in ((self.grads, reduced.data), (self.rep_grads, reduced.replicated)):
                if name in acc:
                    acc[name].add_(part)
                else:
                    acc[name] = part
            done = streams.record(REDUCE)
        del pending, reduced
        if block is not None:
            self.pool.give(block, (done,))
        self.grad_live -= counted
        self._log("reduce_done", i)

    def _finish_inflight(self):
        while self.rs_pending:
            self.finish_oldest_reduce()

    def _finish_completed(self):
        """Finishes the oldest reduce-scatters that are already done (see [Note: when a flat
        gradient buffer is freed])."""
        while self.rs_pending and all(completed(h) for h in self.rs_pending[0][1].handles):
            self.finish_oldest_reduce()

    def finish_reduces(self):
        """End of the call's reduce-scatters: compute is then past every side stream."""
        self._finish_inflight()
        self.pool.settle()
        self.streams.end_call()

    def reduce_late(self, units):
        """One more reduce-scatter of the late buffers of ``units`` (every rank, same order)."""
        for i in units:
            u = self.units[i]
            g, r = self._buffers(i, late=True)
            blocks = (u.late_block, u.rlate_block)
            u.late = u.rlate = u.late_block = u.rlate_block = None
            label = f"reduce-scatter {self.layouts[i].name} late gradients"
            self.rs_pending.append((i, *self._reduce_scatter_unit_start(i, g, r, blocks, label), 0))
        self.finish_reduces()

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
