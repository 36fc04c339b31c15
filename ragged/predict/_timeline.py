"""A lowered step walked in the runtime's order (see [Note: lowering a step] in ``ragged/predict/_lower.py``):
:func:`walk` yields the program's actions, once for every consumer; :func:`timeline` turns them into
the transient memory, point by point (``_time.py`` into a step time)."""

from __future__ import annotations

import collections

from ragged.collectives._scratch import SCRATCH
from ragged.transforms._flat import tree_scratch_buffers
from ragged.transforms._quantized import unit_scratch_buffers

__all__ = ["walk", "timeline"]


def walk(lowered):
    """The program's actions in the runtime's order, per micro-batch ``mb``: ``("gather", i)``,
    ``("free", i)``, ``("reduce", i, where)``, ``("grad_buffer", i)`` (unit ``i``'s first gradient
    takes its flat buffer), ``("forward", c, mb)`` (entry ``c`` computes), ``("backward", s, mb)``
    (segment ``s`` computes; what follows it up to the next event happens once the segment has
    started: the first gradients take their buffers, the loss's segment issues the start prefetch),
    ``("event", e)`` (backward event ``e`` is processed next) and ``("end",)``."""
    step, prog, sched = lowered.step, lowered.program, lowered.schedule
    n = len(sched.forward)
    lazy = {u for u in range(len(lowered.layouts)) if sched.forward.count(u) > 1}
    first_grad = {}
    for s in range(n - 1, -1, -1):
        for i in sorted({sched.forward[s]} | set(sched.needs[s])):
            first_grad.setdefault(i, s)
    trains = {lay.index for lay in lowered.layouts if lay.grad_plan is not None}
    for mb in range(step.micro_batches):
        tag = f" (micro-batch {mb})" if step.micro_batches > 1 else ""
        for c, (frees, gathers) in enumerate(prog.forward):
            yield from (("free", i) for i in frees)
            yield from (("gather", i) for i in gathers)
            yield ("forward", c, mb)
        for e in range(n, -1, -1):
            yield ("event", e)
            reduces, frees, gathers = prog.backward[e]
            yield from (("reduce", i, f"backward event {e}{tag}") for i in reduces)
            yield from (("free", i) for i in frees)
            yield from (("grad_buffer", i) for i in sorted(lazy & trains) if sched.reduce_at[i] + 1 == e)
            yield from (("gather", i) for i in gathers)
            if e >= 1:
                yield ("backward", e - 1, mb)
                yield from (("gather", i) for i in (prog.start_prefetch if e == n else ()))  # once backward reaches the model
                yield from (("grad_buffer", i) for i, s in first_grad.items() if s == e - 1 and i not in lazy and i in trains)
        yield from (("reduce", i, f"after backward{tag}") for i in prog.end)
        yield from (("free", i) for i in range(len(lowered.layouts)))
    yield ("end",)


class _ScratchPool:
    """The free buffers the scratch pool keeps, by key, as the runtime takes and gives them back
    (see [Note: one scratch pool] in ``ragged/collectives/_scratch.py``): up to ``SCRATCH.keep`` per
    size (and, on CUDA, stream), kept for the next call and the next step."""

    def __init__(self):
        self.free = collections.Counter()

    def take(self, keys):
        for key in keys:
            if self.free[key]:
                self.free[key] -= 1

    def give(self, keys):
        for key in keys:
            if self.free[key] < SCRATCH.keep:
                self.free[key] += 1

    def nbytes(self) -> int:
        return sum(key[0] * n for key, n in self.free.items())


class _Live:
    """The transient bytes alive by kind while :func:`timeline` walks the program, and the points
    noted so far (see [Note: the wire scratch in the timeline])."""

    def __init__(self, lowered, early: bool, pool: _ScratchPool):
        self.lays, self.early, self.pool = lowered.layouts, early, pool
        self.inflight = lowered.step.value_and_grad.max_inflight_reduce
        self.live = {"gathered": 0, "grad_buffers": 0, "reduce_copies": 0, "grad_shards": 0, "wire_scratch": 0,
                     "scratch_pool": pool.nbytes(), "activations": 0}
        self.alive, self.grads, self.pending = set(), set(), []
        self.released = set()  # pending reduce-scatters whose gradient buffer went back early
        self.points, self.peaks = [], {"gathered": 0, "grad_buffers": 0, "wire_scratch": 0, "grad_shards": 0}
        cuda = getattr(getattr(lowered.step.comm, "device", None), "type", None) == "cuda"
        self.chunks = lowered.step.value_and_grad.chunks
        self.scratch = [tuple(tuple((n, stream if cuda else None) for n in bufs)  # the pool's keys
                              for stream, bufs in zip(("gather", "reduce"), self._buffers(lowered, lay)))
                        for lay in self.lays]
        self.in_flight = {}  # unit -> its all-gather's scratch, until the runtime waits it
        self.reduced = [0] * len(self.lays)  # per unit: reduce-scatters finished, and the bytes of its sums held
        self.held = [0] * len(self.lays)
        self.joined = [0] * len(self.lays)  # per unit: pending outputs already counted as joined (early)

    def _buffers(self, lowered, lay):
        """A unit's scratch buffers (bytes each) per stream: its quantized collectives', and a chunked
        step's rows (see ``ragged/transforms/_flat.py``) on the reduce stream."""
        gather, reduce = unit_scratch_buffers(lowered.units[lay.name].plan, lay)
        if self.chunks and lay.grad_plan is not None:
            reduce += tree_scratch_buffers(lay.grad_plan, lay.reduce_dtype or lay.grad_plan.dtype,
                                           quantized=lay.reduce_formats is not None)
        return gather, reduce

    def _scratch(self, keys, take: bool):
        (self.pool.take if take else self.pool.give)(keys)
        self.live["wire_scratch"] += (1 if take else -1) * sum(n for n, _ in keys)
        self.live["scratch_pool"] = self.pool.nbytes()

    def note(self, unit, phase, model=None):
        if model is not None:
            self.live["activations"] = model
        self.points.append((self.lays[unit].name if unit is not None else "-", phase, dict(self.live)))
        for key in self.peaks:
            self.peaks[key] = max(self.peaks[key], self.live[key])

    def waited(self, units):
        """The runtime waits these units' all-gathers: their scratch goes back to the pool."""
        for i in units:
            if i in self.in_flight:
                self._scratch(self.in_flight.pop(i), take=False)

    def gather(self, i):
        self.waited((i,))  # a unit gathered again: its previous all-gather is waited first
        if self.scratch[i][0]:
            self.in_flight[i] = self.scratch[i][0]
            self._scratch(self.scratch[i][0], take=True)
        if i not in self.alive:
            self.alive.add(i)
            self.live["gathered"] += self.lays[i].nbytes

    def free(self, i):
        self.waited((i,))
        if i in self.alive:
            self.alive.discard(i)
            self.live["gathered"] -= self.lays[i].nbytes

    def rcopy(self, i):
        """The flat gradient (compute dtype) copied into the reduce dtype (the policy's, else the master's)."""
        lay = self.lays[i]
        dt = lay.reduce_dtype or lay.grad_plan.dtype
        return lay.grad_plan.buffer_numel * dt.itemsize if dt != lay.dtype else 0

    def take(self, i):
        if i not in self.grads:
            self.grads.add(i)
            self.live["grad_buffers"] += self.lays[i].grad_nbytes

    def reduce(self, i, where):
        live = self.live
        self.take(i)  # a unit whose gradients never reached a buffer: the runtime takes one now
        self.grads.discard(i)
        if self.rcopy(i):
            live["grad_buffers"] -= self.lays[i].grad_nbytes
            live["reduce_copies"] += self.rcopy(i)
        self.pending.append(i)
        self._scratch(self.scratch[i][1], take=True)
        live["grad_shards"] += self.shard_bytes(i)  # the reduce-scatter's output, from its start
        self.note(i, where)
        while len(self.pending) > self.inflight:
            self.finish_oldest()

    def shard_bytes(self, i, dtype=None):
        """One reduced gradient shard of unit ``i`` (and its replicated part), in the reduce dtype
        (``dtype``: another)."""
        lay = self.lays[i]
        gp = lay.grad_plan
        size = (dtype or lay.reduce_dtype or gp.dtype).itemsize
        return (gp.shard_size + (gp.replicated_numel if gp.replicated else 0)) * size

    def finish_oldest(self):
        """The oldest reduce-scatter is waited: its output joins the unit's sums of micro-batches (a
        chunked step's fixed tree holds one sum per set bit of the micro-batches so far, in the
        reduce dtype; otherwise one sum, in the plan's dtype; see ``ragged/fsdp/_reducing.py``)."""
        i = self.pending.pop(0)
        self._scratch(self.scratch[i][1], take=False)
        if self.joined[i]:
            self.joined[i] -= 1
        else:
            self.join(i)
        if self.rcopy(i):
            self.live["reduce_copies"] -= self.rcopy(i)
        elif i in self.released:
            self.released.discard(i)
        else:
            self.live["grad_buffers"] -= self.lays[i].grad_nbytes

    def join(self, i):
        """Unit ``i``'s reduce-scatter output joins its sums of micro-batches."""
        self.reduced[i] += 1
        held = (bin(self.reduced[i]).count("1") * self.shard_bytes(i) if self.chunks
                else self.shard_bytes(i, self.lays[i].grad_plan.dtype))
        self.live["grad_shards"] += held - self.held[i] - self.shard_bytes(i)
        self.held[i] = held

    def settle(self):
        """``early``: the device has run every pending reduce-scatter by the next point, so their
        gradient buffers are back (their copies and scratch go where the program finishes them: see
        [Note: when a flat gradient buffer is freed] in ``ragged/fsdp/_reducing.py``); for the least
        the shards can reach, their outputs count as joined too (the program may finish one there,
        e.g. where a unit that held its leaf gradients takes its buffer)."""
        if self.early:
            for i in self.pending:
                if not self.rcopy(i) and i not in self.released:
                    self.released.add(i)
                    self.live["grad_buffers"] -= self.lays[i].grad_nbytes
            for i, count in collections.Counter(self.pending).items():
                while self.joined[i] < count:
                    self.joined[i] += 1
                    self.join(i)

    def finish_all(self):
        while self.pending:
            self.finish_oldest()

    def end(self):
        """Every reduce-scatter waited; a chunked step's sums then become one shard in the plan's dtype."""
        self.finish_all()
        if self.chunks:
            for i, held in enumerate(self.held):
                if held:
                    self.held[i] = self.shard_bytes(i, self.lays[i].grad_plan.dtype)
                    self.live["grad_shards"] += self.held[i] - held


def timeline(lowered, *, early: bool = False):
    """The step's transient memory, point by point: ``(points, peaks)``, ``points`` a list of
    ``(unit, phase, parts)`` where ``parts`` are the bytes alive by kind at that point (see
    [Note: lowering a step]): after a forward entry's gathers, while it computes; in a backward
    segment before and after the runtime first acts inside it; at a reduce-scatter
    (``activations``: the model's own bytes there, from ``lowered.activations``). ``early``: every
    reduce-scatter has run by the next point, its gradient buffer given back (the least memory the
    runtime can reach); default: only when ``max_inflight_reduce`` forces it (the most). A step
    after the first: the scratch pool starts with what the step before kept (``scratch_pool``), and
    ``peaks["retained_scratch"]`` is what it keeps after the step.

    [Note: the wire scratch in the timeline]
    A quantized collective holds scratch from its start until the runtime waits it
    (``ragged/transforms/_quantized.py``: ``gather_scratch``, ``reduce_scatter_scratch``), counted
    as ``wire_scratch``. A unit's all-gather is waited when the unit is first read: forward entry
    ``c`` reads ``forward[c]`` right after issuing its own gathers (the next unit's prefetch), so
    both are in flight at that entry's point and the read unit's is released after it; a backward
    segment's units are waited at its start (released after its first point), except the loss's
    segment, where the start prefetch is issued first (released after its second point); a free
    or a new gather of the unit waits it too. A reduce-scatter's scratch lives as its reduce
    copy does, until it is waited (``max_inflight_reduce`` later at the latest, the next point
    with ``early``). Each point thus holds the scratch of a moment in its interval: the peak of
    ``wire_scratch`` is the most the runtime holds at once (between the two bounds for
    reduce-scatters). That is the host's order, which the CPU runs; on CUDA the runtime gives
    the scratch back as soon as the collective and its decode are queued on the side stream
    (see [Note: scratch across streams] in ``ragged/collectives/_scratch.py``), and the next
    collective on that stream reuses it, so the count is an upper bound there. Not counted: the
    encode's and decode's float32 temporaries (kernel workspace). The free buffers the scratch
    pool keeps between calls (up to two per size, and on CUDA per stream, see [Note: one scratch
    pool]) are counted apart, as ``scratch_pool``: the pool is walked through the step's takes and
    gives, once from empty and again from what it kept, as every step after the first starts; what
    it keeps at the end is ``retained_scratch``. Not walked: gloo's header transport's own staging
    buffers (the same pool, CPU only)."""
    pool = _ScratchPool()
    _walk_memory(lowered, early, pool)  # the first step, from an empty pool
    return _walk_memory(lowered, early, pool)


def _walk_memory(lowered, early: bool, pool: _ScratchPool):
    sched, act, k = lowered.schedule, lowered.activations, lowered.step.micro_batches
    mem, post, loss_reads = _Live(lowered, early, pool), None, ()
    for action, *args in walk(lowered):
        if post is not None and action not in ("grad_buffer", "gather"):  # the segment once those are in
            mem.note(*post)
            mem.waited(loss_reads)
            post, loss_reads = None, ()
        if action == "gather":
            mem.gather(args[0])
        elif action == "free":
            mem.free(args[0])
        elif action == "event":
            mem.settle()
            if act:
                mem.live["activations"] = act.events[args[0]]
        elif action == "reduce":
            mem.reduce(*args)
        elif action == "grad_buffer":
            mem.settle()
            mem.take(args[0])
        elif action in ("forward", "backward"):
            c, mb = args
            where = f"{action} {'entry' if action == 'forward' else 'segment'} {c}" + (f" (micro-batch {mb})" if k > 1 else "")
            model = (None, None) if act is None else (act.forward[c], None) if action == "forward" else act.backward[c]
            mem.note(sched.forward[c], where, model[0])
            reads = {sched.forward[c]} | (set(sched.needs[c]) if action == "backward" else set())
            if action == "backward":
                post = (sched.forward[c], where + ", gradients in", model[1])
            if action == "backward" and c == len(sched.forward) - 1:  # the loss's: the start prefetch comes first
                loss_reads = reads
            else:
                mem.waited(reads)
    mem.end()
    mem.waited(list(mem.in_flight))
    mem.note(None, "end of backward")
    return mem.points, {**mem.peaks, "retained_scratch": pool.nbytes()}
