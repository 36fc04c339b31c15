"""The gradient half of the step's runtime: flat gradient buffers and the one reduce-scatter call site.

:class:`Reducing` is a base of :class:`~ragged.fsdp._runtime.Run` and shares its state (one
call's units, layouts, shards, pool, streams and counters, all made in ``Run.__init__``); it is a
separate module because it is a separate concern: where a unit's gradients are accumulated, when
the buffer is reduce-scattered and when its memory goes back to the pool.

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
gradients are alive (``Reducing._unhold`` in ``_reducing.py``).
"""

from __future__ import annotations

import torch

from ragged.collectives._base import completed
from ragged.fsdp._device import COMPUTE, REDUCE
from ragged.transforms import reduce_scatter_wait
from ragged.transforms._reduce_scatter import _reduce_scatter_start

__all__ = ["Reducing"]


class Reducing:
    """Gradient buffers and reduce-scatters of one call (see the module docstring)."""

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
            block = self.pool.take(lay.grad_nbytes, COMPUTE)
            g = block.tensor(lay.dtype, lay.grad_numel)
            self.streams.access(COMPUTE, block.key, write=True)
            if late:
                u.late, u.late_block = g, block
                g.zero_()
            else:
                u.grad, u.grad_block = g, block
                for lo, hi in lay.grad_gaps:
                    g[lo:hi].zero_()
                u.written = [False] * len(u.spans)
                self.grad_live += lay.grad_nbytes
                self.grad_peak = max(self.grad_peak, self.grad_live)
        r = u.rlate if late else u.rgrad
        if r is None:
            n = lay.grad_replicated_numel
            rblock = self.pool.take(n * g.element_size(), COMPUTE) if n else None
            r = rblock.tensor(lay.dtype, n).zero_() if rblock else g.new_zeros(0)
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
            self.grad_live -= self.layouts[i].grad_nbytes
        self.rs_pending.append((i, pending, kept, self.layouts[i].grad_nbytes if kept is not None else 0))
        self._log("reduce_start", i)
        while len(self.rs_pending) > self.max_inflight:
            self.finish_oldest_reduce()

    def _reduce_scatter_unit_start(self, i: int, grad: torch.Tensor, replicated: torch.Tensor, blocks, label: str):
        """Issues unit ``i``'s reduce-scatter of ``grad`` (and all-reduce of ``replicated``) on the
        reduce stream, after every copy into them (see [Note: streams and lifetimes] in
        ``_device.py``). Returns the pending reduce-scatter and the gradient block it still reads
        (``None``: a buffer only read by a cast to the reduce dtype is given back at once, as is
        the replicated part, which is always copied)."""
        plan, streams = self.layouts[i].grad_plan, self.streams
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
                                            agreed=True, label=label)
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
