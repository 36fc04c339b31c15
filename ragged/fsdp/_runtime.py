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

[Note: the runtime's own torch calls]
Backward runs with the function mode active (see [Note: backward under the mode] in
``_intercept.py``), so the runtime's own copies and collectives would be seen as reads;
``busy`` is raised around them.
"""

from __future__ import annotations

import collections
import hashlib

import torch

from ragged.fsdp._records import UnitRecord, UnitState, storage_key
from ragged.fsdp._schedule import Observation
from ragged.transforms import all_gather_flat, reduce_scatter_wait
from ragged.transforms._reduce_scatter import _reduce_scatter_start

__all__ = ["Run"]


class Run:
    """State of one call: see the module docstring."""

    def __init__(self, layouts, units, shards, comm, *, schedule, program, lazy, max_inflight_reduce, trace):
        self.layouts, self.comm, self.shards = layouts, comm, shards
        self.schedule, self.program, self.lazy = schedule, program, set(lazy)
        self.max_inflight, self.trace = max_inflight_reduce, ([] if trace else None)
        self.units = [UnitRecord(lay, shards[lay.name], comm.device) for lay in layouts]
        self.key_to_unit = {storage_key(u.flat): i for i, u in enumerate(self.units)}
        self.leaf_of = {id(t): (i, j) for i, u in enumerate(self.units) for j, (t, *_) in enumerate(u.spans)}
        self.params_tree = units.merge({lay.name: u.leaves for lay, u in zip(layouts, self.units)})
        self.hooks = [t.register_post_accumulate_grad_hook(self._hook(i, j))
                      for i, u in enumerate(self.units) for j, (t, *_) in enumerate(u.spans)]
        self.entries_of = collections.defaultdict(list)
        for c, i in enumerate(schedule.forward):
            self.entries_of[i].append(c)
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
        self.reset()

    def reset(self):
        """Start of a micro-batch."""
        self.phase, self.cursor, self.event, self.active = "forward", -1, len(self.schedule.forward) + 1, None
        self.marker_entry, self.pending_prefetch = None, []
        self.saved_peak, self.saved_bytes = max(self.saved_peak, self.saved_bytes), 0
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

    def foreign_read(self, p: torch.Tensor):
        if id(p) not in self.foreign:
            self.foreign[id(p)] = (p, p.grad)

    def foreign_grads(self) -> list:
        """Shapes of the parameters read in forward that are not the step's and got a gradient."""
        return [tuple(p.shape) for p, before in self.foreign.values() if p.grad is not None and p.grad is not before]

    def observation(self) -> Observation:
        return Observation(used=frozenset(self.used_entries), inserts=tuple(self.inserts), needs=frozenset(self.needs),
                           missing=tuple(self.missing), late=tuple(self.late_seen))

    # ---- parameters: the one all-gather call site ----------------------------------------------
    def _gather_unit_start(self, i: int, label: str):
        """Issues unit ``i``'s all-gather (every rank issues it at the same point of the program)."""
        u = self.units[i]
        if u.state is UnitState.PENDING:
            self._wait(i)
        if u.state is UnitState.FREE:
            u.flat.untyped_storage().resize_(self.layouts[i].nbytes)
            self.live_bytes += self.layouts[i].nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        data = self.shards[self.layouts[i].name].data
        u.source = data if data.dtype == u.flat.dtype else data.to(u.flat.dtype)
        self._issued(label)
        u.handle = all_gather_flat(self.shards[self.layouts[i].name].plan, u.flat, u.source, self.comm, async_op=True)
        u.state, u.scheduled, u.served = UnitState.PENDING, True, False
        self.num_gathers += 1
        self._log("gather_start", i)

    def _wait(self, i: int):
        u = self.units[i]
        if u.state is UnitState.PENDING:
            u.handle.wait()
            u.handle = u.source = None
            u.state = UnitState.READY
            self._log("gather_done", i)

    def _release(self, i: int):
        u = self.units[i]
        if u.state is UnitState.FREE:
            return
        self._wait(i)
        u.flat.untyped_storage().resize_(0)
        u.state, u.served = UnitState.FREE, False
        self.live_bytes -= self.layouts[i].nbytes
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
        u = self.units[i]
        self._wait(i)
        if u.state is UnitState.FREE:
            u.flat.untyped_storage().resize_(self.layouts[i].nbytes)
            self.live_bytes += self.layouts[i].nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        with torch.no_grad():
            u.flat.zero_()
        u.state, u.served = UnitState.READY, True

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
                    elif u.state is UnitState.FREE:
                        self.inserts.append((self.cursor + 1, i))
                        self._serve_zeros(i, f"unit {self.layouts[i].name!r} read in forward after entry "
                                             f"{self.cursor}, where the schedule has no entry of it")
                if self.cursor >= 0 and fwd[self.cursor] == i:
                    self.used_entries.add(self.cursor)
            else:
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
        self.armed[leaf_id] = min(entry, self.armed.get(leaf_id, entry))

    def reached(self, e: int):
        """Processes events down to ``e`` (each proven: see [Note: markers and tags])."""
        self._prefetch_pending()
        while self.event > max(e, 0):
            self.event -= 1
            reduces, frees, gathers = self.program.backward[self.event]
            for i in reduces:
                self._reduce(i, f"reduce-scatter {self.layouts[i].name} backward event {self.event}")
            for i in frees:
                self._plan_free(i)
            for i in gathers:
                self._gather_unit_start(i, f"gather {self.layouts[i].name} backward event {self.event}")

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
        finally:
            self.busy -= 1

    # ---- gradients: the one reduce-scatter call site ---------------------------------------------
    def _hook(self, i: int, j: int):
        def hook(t: torch.Tensor):
            self.grad_ready(i, j, t)
        return hook

    def grad_ready(self, i: int, j: int, t: torch.Tensor):
        """Leaf ``j`` of unit ``i`` has its gradient for this micro-batch."""
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
                    if i in self.lazy:
                        u.held.append((j, t))  # keep autograd's tensor until the reduce-scatter
                    else:
                        self._copy_grad(i, j, t)
            entry = self.armed.pop(id(t), None)
            if entry is not None:
                self.reached(entry)
        finally:
            self.busy -= 1

    def _buffers(self, i: int, late: bool):
        """The unit's flat gradient buffer (laid out like the gathered one) and its replicated part.

        The normal buffer is ``empty`` with zeroed padding (each leaf's first gradient is copied
        in, a second one added; leaves without one are zeroed at the reduce-scatter); the late
        buffer is zeros."""
        u, lay = self.units[i], self.layouts[i]
        g = u.late if late else u.grad
        if g is None:
            if late:
                g = u.late = torch.zeros(lay.numel, dtype=lay.dtype, device=self.comm.device)
            else:
                g = u.grad = torch.empty(lay.numel, dtype=lay.dtype, device=self.comm.device)
                for lo, hi in lay.gaps:
                    g[lo:hi].zero_()
                u.written = [False] * len(u.spans)
                self.grad_live += g.numel() * g.element_size()
                self.grad_peak = max(self.grad_peak, self.grad_live)
        r = u.rlate if late else u.rgrad
        if r is None:
            r = torch.zeros(lay.replicated_numel, dtype=lay.dtype, device=self.comm.device)
            if late:
                u.rlate = r
            else:
                u.rgrad = r
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

    def _reduce(self, i: int, label: str):
        u = self.units[i]
        for j, t in u.held:
            self._copy_grad(i, j, t)
        u.held = []
        # a unit whose gradients arrive around other units' reduce-scatters (embedding and head in
        # one unit) keeps autograd's leaf gradients until its turn next time (a hint: memory only)
        if u.grads_started is not None and self.num_reduces > u.grads_started:
            self.lazy.add(i)
        elif u.grads_started is not None:
            self.lazy.discard(i)
        g, r = self._buffers(i, late=False)
        with torch.no_grad():
            for (_, start, stop, replicated), written in zip(u.spans, u.written):
                if not (written or replicated):
                    g[start:stop].zero_()
        u.grad = u.rgrad = u.written = None
        u.reduced = True
        self.num_reduces += 1
        pending = self._reduce_scatter_unit_start(i, g, r, label)
        self.rs_pending.append((i, pending, g.numel() * g.element_size()))
        self._log("reduce_start", i)
        while len(self.rs_pending) > self.max_inflight:
            self.finish_oldest_reduce()

    def _reduce_scatter_unit_start(self, i: int, grad: torch.Tensor, replicated: torch.Tensor, label: str):
        """Issues unit ``i``'s reduce-scatter of ``grad`` (and all-reduce of ``replicated``)."""
        plan = self.shards[self.layouts[i].name].plan
        rep = replicated if plan.replicated else None
        self._issued(label)
        return _reduce_scatter_start(plan, grad, self.comm, "mean", self.layouts[i].reduce_dtype, replicated=rep,
                                     agreed=True)

    def finish_oldest_reduce(self):
        i, pending, nbytes = self.rs_pending.popleft()
        reduced = reduce_scatter_wait(pending)
        name = self.layouts[i].name
        for acc, part in ((self.grads, reduced.data), (self.rep_grads, reduced.replicated)):
            if name in acc:
                acc[name].add_(part)
            else:
                acc[name] = part
        if nbytes:
            self.grad_live -= nbytes
        self._log("reduce_done", i)

    def finish_reduces(self):
        while self.rs_pending:
            self.finish_oldest_reduce()

    def reduce_late(self, units):
        """One more reduce-scatter of the late buffers of ``units`` (every rank, same order)."""
        for i in units:
            u = self.units[i]
            g, r = self._buffers(i, late=True)
            u.late = u.rlate = None
            label = f"reduce-scatter {self.layouts[i].name} late gradients"
            self.rs_pending.append((i, self._reduce_scatter_unit_start(i, g, r, label), 0))
        self.finish_reduces()

    def close(self):
        """Breaks the leaf -> hook -> run cycle (through C++ hook storage the garbage collector
        cannot see) and drops every buffer of this call."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for i, u in enumerate(self.units):
            if u.state is UnitState.PENDING:
                self._wait(i)
            u.flat.untyped_storage().resize_(0)
            u.state = UnitState.FREE
            # a leaf that outlives the call (kept by the loss or a traceback) must not point into
            # released storage: printing it would read freed memory
            for t, *_ in u.spans:
                t.data = t.data.new_empty((0,))
            u.grad = u.rgrad = u.late = u.rlate = u.source = u.handle = None
            u.held = []
        self.units = []
        self.params_tree, self.foreign = None, {}
        self.key_to_unit, self.leaf_of = {}, {}
