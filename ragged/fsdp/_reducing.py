"""The gradient half of the step's runtime: flat gradient buffers and the one reduce-scatter call site.

:class:`Gradients` is one part of :class:`~ragged.fsdp._runtime.Run`: it owns where a unit's
gradients are accumulated, when the buffer is reduce-scattered and when its memory goes back to
the pool. It gets the call's unit records, pool, streams, comm, counters and observer when the
run is made, and is driven by the run: :meth:`Gradients.arrived` (a leaf's gradient is in),
:meth:`Gradients.reduce` (the program's reduce-scatter of a unit), :meth:`Gradients.unhold`,
:meth:`Gradients.finish`, :meth:`Gradients.reduce_late` and :meth:`Gradients.close`.

[Note: when a flat gradient buffer is freed]
A unit's flat gradient buffer (from the pool, see [Note: reusing unit buffers] in ``_pool.py``)
is taken when its first gradient arrives and given back once its reduce-scatter, which reads
it, has run. A reduce-scatter is *finished* (waited, its shard accumulated and, on an HSDP mesh,
its all-reduce over the replicas issued) at points of the program only: when
``max_inflight_reduce`` are in flight and another starts (the bound: the host waits, on CUDA
the compute stream), before a unit that held autograd's gradients copies them, and at the end
of backward; so every rank issues the replica all-reduces at the same places among the shard
group's collectives, as NCCL needs (see [Note: NCCL's rules on gloo] in
``ragged/collectives/_gloo_device.py``). Before that, as soon as the device has run it (the
streams' :meth:`~ragged.fsdp._device.HostStreams.finished`, asked before a unit takes a new
buffer and at every backward event), its buffer goes back to the pool: with a fast network one
buffer fills while none is held. That answer differs between ranks; it decides memory only, never
a collective. Results do not depend on when (each unit's parts are accumulated in issue order);
the memory does, within that bound. A unit whose gradients arrive at both ends of backward (the
head and the embedding in one unit) holds autograd's leaf gradients instead of a buffer in
between (the learnt ``lazy`` hint: a held head gradient is smaller than the unit), and copies
them into its buffer at the event before the segment that makes its last ones, after waiting
for the reduce-scatters in flight: at the end of backward only its buffer and the last
gradients are alive (:meth:`Gradients.unhold`).
"""

from __future__ import annotations

import collections

import torch

from ragged._divide import divisor
from ragged.collectives._tree import TreeSum
from ragged.fsdp._device import COMPUTE, REDUCE
from ragged.fsdp._records import GradRecord
from ragged.transforms import reduce_scatter_wait
from ragged.transforms._reduce_scatter import _reduce_scatter_start, reduced

__all__ = ["Gradients"]


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _divided(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t / n`` in place (see [Note: a division every device rounds alike] in ``ragged/_divide.py``)."""
    return t.div_(divisor(t, n))


class Gradients:
    """Gradient buffers and reduce-scatters of one call (see the module docstring).

    Attributes:
        units: one :class:`~ragged.fsdp._records.GradRecord` per unit.
        reduced, reduced_rep: ``{unit name: tensor}``, this rank's reduced gradient shard and
            replicated part, once the unit's reduce-scatters are waited.
        lazy: units that keep autograd's leaf gradients (the learnt hint, see :meth:`unhold`);
            ``hold``: those still holding them in this micro-batch.
        pending: reduce-scatters in flight, oldest first: ``[unit, pending, block, counted bytes,
            tokens]`` (``block`` is ``None`` once given back).
    """

    __slots__ = ("layouts", "units", "pool", "streams", "comm", "counts", "seen", "log", "max_inflight", "lazy",
                 "hold", "pending", "reduced", "reduced_rep", "chunks", "sums")

    def __init__(self, layouts, spans, *, pool, streams, comm, counts, seen, log, max_inflight: int, lazy, chunks=None):
        self.layouts, self.pool, self.streams, self.comm = layouts, pool, streams, comm
        self.chunks = chunks  # see [Note: the chunked step] in _chunks.py
        self.sums: dict = {}  # chunked: {unit name: (TreeSum of shards, TreeSum of replicated parts)}
        self.units = [GradRecord(s) for s in spans]
        self.counts, self.seen, self.log, self.max_inflight = counts, seen, log, max_inflight
        self.lazy, self.hold = set(lazy), set()
        self.pending: collections.deque = collections.deque()
        self.reduced: dict = {}
        self.reduced_rep: dict = {}

    def new_micro_batch(self):
        self.hold = set(self.lazy)
        for u in self.units:
            u.new_micro_batch()

    def arrived(self, i: int, j: int, t: torch.Tensor, segment: int):
        """Trainable leaf ``j`` of unit ``i`` has its gradient ``t.grad`` (in backward segment
        ``segment``, -1 outside backward)."""
        u = self.units[i]
        u.used[j] = True
        if u.reduced:  # after the unit's reduce-scatter: exact through the late buffer
            self.seen.late.append((i, segment))
            self._copy(i, j, t, late=True)
            return
        if u.grads_started is None:
            u.grads_started = self.counts.reduces
        if i in self.hold:
            u.held.append((j, t))  # keep autograd's tensor for now (see reduce)
        else:
            self._copy(i, j, t)

    def _buffers(self, i: int, late: bool):
        """The unit's flat gradient buffer (laid out like the trainable prefix of the gathered one)
        and its replicated part.

        The normal buffer is uninitialised memory with zeroed padding (each leaf's first gradient
        is copied in, a second one added; leaves without one are zeroed at the reduce-scatter);
        the late buffer is zeros. Both are written on compute."""
        u, lay = self.units[i], self.layouts[i]
        g = u.late if late else u.grad
        if g is None:
            self.finish_completed()  # their buffers first
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
                self.counts.grad_taken(lay.grad_nbytes)
                self.log("grad_buffer", i)
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

    def _copy(self, i: int, j: int, t: torch.Tensor, late: bool = False):
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

    def unhold(self, i: int):
        """Unit ``i`` held autograd's leaf gradients (e.g. the head's, next to the embedding in one
        unit) and its last ones arrive in the next segment: its buffer now, after the reduce-scatters
        in flight (their buffers go first), so that the held gradients are gone before the last ones
        are made."""
        self.hold.discard(i)
        u = self.units[i]
        if u.held:
            self.finish_inflight()
            self.pool.settle()
            for j, t in u.held:
                self._copy(i, j, t)
            u.held = []

    def reduce(self, i: int, label: str):
        """The program's reduce-scatter of unit ``i`` (every rank at the same point)."""
        u = self.units[i]
        for j, t in u.held:
            self._copy(i, j, t)
        u.held = []
        self.hold.discard(i)
        # a unit whose gradients arrive around other units' reduce-scatters (embedding and head in
        # one unit) keeps autograd's leaf gradients until just before its last ones next time (a
        # hint: memory only; see unhold)
        if u.grads_started is not None and self.counts.reduces > u.grads_started:
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
        self.counts.reduces += 1
        pending, kept, tokens = self._start(i, g, r, blocks, label)
        if kept is None:  # given back at the start (see _start)
            self.counts.grad_live -= self.layouts[i].grad_nbytes
        self.pending.append([i, pending, kept, self.layouts[i].grad_nbytes if kept is not None else 0, tokens])
        self.log("reduce_start", i)
        while len(self.pending) > self.max_inflight:
            self.finish_oldest()

    def _start(self, i: int, grad: torch.Tensor, replicated: torch.Tensor, blocks, label: str):
        """Issues unit ``i``'s reduce-scatter of ``grad`` (and all-reduce of ``replicated``) on the
        reduce stream, after every copy into them (see [Note: streams and lifetimes] in
        ``_device.py``). Returns the pending reduce-scatter, the gradient block it still reads
        (``None``: a buffer only read by a cast to the reduce dtype is given back at once, as is
        the replicated part, which is always copied) and the streams' tokens of its collectives."""
        plan, streams = self.layouts[i].grad_plan, self.streams
        rep = replicated if plan.replicated else None
        for b in blocks:
            if b is not None:
                streams.access(COMPUTE, b.key, write=True)
        ready = streams.record(COMPUTE)
        with streams.on(REDUCE):
            streams.wait(REDUCE, ready)
            for b in blocks:
                if b is not None:
                    streams.access(REDUCE, b.key)
            chunked = self.chunks is not None
            pending = _reduce_scatter_start(plan, grad, self.comm, "sum" if chunked else "mean",
                                            self.layouts[i].reduce_dtype, replicated=rep, agreed=True, label=label,
                                            formats=self.layouts[i].reduce_formats, tree=chunked)
            self.counts.shards(_nbytes(pending.output, pending.replicated))  # its output, from its start
            read = streams.record(REDUCE)  # after the casts: the copies are all the collectives read
            tokens = tuple(streams.issued(REDUCE, h) for h in pending.handles)
        gblock, rblock = blocks
        if rblock is not None:
            self.pool.give(rblock, (read,))
        if pending.source.data_ptr() != grad.data_ptr():  # cast: the collective reads the copy
            self.pool.give(gblock, (read,))
            gblock = None
        return pending, gblock, tokens

    def finish_oldest(self):
        i, pending, block, counted, _ = self.pending.popleft()
        streams = self.streams
        with streams.on(REDUCE):
            name = self.layouts[i].name
            held = self._held(name)
            if self.chunks is not None:  # in the reduce dtype, over the fixed tree (see [Note: the chunked step])
                parts = reduced(pending)
                for acc, part in zip(self.sums.setdefault(name, (TreeSum(), TreeSum())), parts):
                    acc.push(part)
            else:
                parts = reduce_scatter_wait(pending)
                for acc, part in ((self.reduced, parts.data), (self.reduced_rep, parts.replicated)):
                    if name in acc:
                        acc[name].add_(part)
                    else:
                        acc[name] = part
            self.counts.shards(self._held(name) - held - _nbytes(pending.output, pending.replicated))
            done = streams.record(REDUCE)
        del pending, parts
        if block is not None:
            self.pool.give(block, (done,))
        self.counts.grad_live -= counted
        self.log("reduce_done", i)

    def _held(self, name: str) -> int:
        """Bytes of unit ``name``'s reduced gradient held now: its sums of micro-batches."""
        if name in self.sums:
            return sum(acc.nbytes() for acc in self.sums[name])
        return _nbytes(*(acc[name] for acc in (self.reduced, self.reduced_rep) if name in acc))

    def finish_inflight(self):
        while self.pending:
            self.finish_oldest()

    def finish_completed(self):
        """Gives back the gradient buffers of the reduce-scatters the device has run (see
        [Note: when a flat gradient buffer is freed]): memory only, no collective."""
        for entry in self.pending:
            _, _, block, counted, tokens = entry
            if block is not None and all(self.streams.finished(t) for t in tokens):
                self.pool.give(block, tokens)
                self.counts.grad_live -= counted
                entry[2], entry[3] = None, 0

    def finish(self):
        """End of the call's reduce-scatters: compute is then past every side stream. A chunked
        step's sums are completed here: divided once by ``C``, cast to the plan's dtype."""
        self.finish_inflight()
        if self.sums:
            with self.streams.on(REDUCE):
                for name, (data, rep) in list(self.sums.items()):
                    held = self._held(name)
                    dtype = next(lay.grad_plan.dtype for lay in self.layouts if lay.name == name)
                    self.reduced[name], self.reduced_rep[name] = (
                        _divided(acc.result(), self.chunks).to(dtype) for acc in (data, rep))
                    del self.sums[name]
                    self.counts.shards(self._held(name) - held)
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
            pending, kept, tokens = self._start(i, g, r, blocks, label)
            self.pending.append([i, pending, kept, 0, tokens])
        self.finish()

    def close(self):
        """Drops every gradient buffer of the call; reduce-scatters still in flight (only after a
        failure) are not waited on the host (peers may never issue theirs)."""
        streams = self.streams
        while self.pending:
            _, pending, block, _, tokens = self.pending.popleft()
            if block is not None:
                self.pool.give(block, tokens)
        for u in self.units:
            for blk in (u.grad_block, u.rgrad_block, u.late_block, u.rlate_block):
                if blk is not None:
                    self.pool.give(blk, (streams.record(COMPUTE),))
            u.grad = u.rgrad = u.late = u.rlate = None
            u.grad_block = u.rgrad_block = u.late_block = u.rlate_block = None
            u.held = []
