"""The step's collective schedule, as pure values: :class:`CollectiveSchedule` (what every rank
agreed on; a *learning-rate* schedule is ``optim.Schedule``), :class:`Observation` (what one rank
saw in one call), and :class:`Program`, the exact sequence of gathers, frees and reduce-scatters
a collective schedule implies (:class:`Context`: what one call executes, with its indexes).

[Note: a collective order that does not depend on data]
Ranks pair their collectives by issue order (gloo tags, NCCL streams), and gloo aborts the
process when a message is larger than the posted receive (and silently accepts a smaller
one), so every rank must issue the same collectives in the same order whatever its data does.
Gathering when a unit is first read and reduce-scattering when its last gradient arrives (the
first design) breaks that as soon as routing differs: an expert with tokens on one rank and
none on the other. So the runtime never decides *what* to communicate, only *when* to move on:

* forward: the schedule lists the units in use order, as **entries** (a unit may appear more
  than once: the embedding at the start, the tied head at the end). Entering entry ``c`` frees
  the units no longer needed and gathers ``forward[c]`` and (prefetch) ``forward[c + 1]``. A read
  of unit ``X`` enters entries up to the next one of ``X``; entries in between (an expert this
  rank's tokens skip) are gathered and freed all the same, so peers are never left waiting.
  After the loss, the remaining entries are entered.
* backward: entering entry ``c`` also makes an autograd node (a marker on the leaf read, see
  [Note: markers and tags] in ``_runtime.py``). The engine runs a node only after every node
  created later in forward, so when backward is past marker ``c`` (**event** ``c``), all of
  forward's work from entry ``c`` on is done. Segment ``s`` (the nodes made while entry ``s`` was
  current) runs between events ``s + 1`` and ``s``. Event ``e`` reduce-scatters every unit whose
  ``reduce_at`` is ``e`` (default: its first entry: then all of its gradient is in), frees the units
  not needed in the next segments and gathers those of segment ``e - 1`` (``needs[e - 1]``: at
  first ``forward[e - 1]``, then what backward was seen reading there) and, as prefetch, of
  segment ``e - 2``. Events are processed in
  order, the actions of each are fixed by the schedule, so every rank issues the same sequence.

What is still learnt, and how: a rank that needs a unit the schedule does not have alive (the
first step does not know the tied head reuses the embedding unit) is served zeros without
communicating (*deviation*), and a gradient that arrives after its unit's reduce-scatter (a
reentrant checkpoint recomputes in backward) goes to a *late* buffer that one more reduce-scatter
sends after backward. Ranks agree on both at the end of the call (see ``_grad.py``); then every
rank gathers every rank's :class:`Observation` and computes the same new schedule with
:meth:`CollectiveSchedule.observe`. Late gradients are exact as they are; a call that deviated is rerun
with the new schedule from the unchanged state, and a rerun that deviates again raises
:class:`~ragged.PlanMismatchError`. The first schedule lists the units' order twice (so a unit
reused after the others, the usual head, needs no rerun); the first call keeps the entries some
rank used.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib

__all__ = ["CollectiveSchedule", "Observation", "Program", "program", "Context"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """What one rank saw during one call (every micro-batch), for :meth:`CollectiveSchedule.observe`.

    Attributes:
        used: forward entries this rank read.
        inserts: ``(entry, unit)``: the rank needed ``unit`` before entry ``entry`` (forward deviation).
        needs: ``(segment, unit)``: the rank read ``unit`` in backward segment ``segment``.
        missing: the reads of ``needs`` the schedule had freed (backward deviations).
        late: ``(unit, segment)``: a gradient of ``unit`` arrived in segment ``segment`` (-1: after
            the last event) after the unit's reduce-scatter.
    """

    used: frozenset[int] = frozenset()
    inserts: tuple[tuple[int, int], ...] = ()
    needs: frozenset[tuple[int, int]] = frozenset()
    missing: tuple[tuple[int, int], ...] = ()
    late: tuple[tuple[int, int], ...] = ()

    @property
    def deviated(self) -> bool:
        return bool(self.inserts or self.missing)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveSchedule:
    """The collective schedule every rank follows (see [Note: a collective order that does not
    depend on data]).

    Attributes:
        forward: unit index of every forward entry.
        needs: per backward segment, the units it reads (gathered at the event before it).
        reduce_at: per unit, the event after which it is reduce-scattered (-1: after backward).
        learning: whether the next call should keep only the entries some rank used.

    Examples:
        >>> s = CollectiveSchedule.initial(2)
        >>> s.forward, s.reduce_at
        ((0, 1, 0, 1), (0, 1))
        >>> s = s.observe([Observation(used=frozenset({0, 1, 2}))])   # unit 0 is read again at the end
        >>> s.forward, s.learning
        ((0, 1, 0), False)
        >>> s.observe([Observation(inserts=((2, 1),))]).forward       # a rank needed unit 1 before entry 2
        (0, 1, 1, 0)
    """

    forward: tuple[int, ...]
    needs: tuple[frozenset[int], ...]
    reduce_at: tuple[int, ...]
    learning: bool = True

    @staticmethod
    def initial(num_units: int) -> CollectiveSchedule:
        order = tuple(range(num_units))
        return CollectiveSchedule(forward=order + order, needs=tuple(frozenset({u}) for u in order + order),
                                  reduce_at=order)

    def fingerprint(self) -> str:
        text = repr((self.forward, tuple(tuple(sorted(n)) for n in self.needs), self.reduce_at, self.learning))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def observe(self, observations) -> CollectiveSchedule:
        """The schedule for the next call, from every rank's :class:`Observation` (pure: every
        rank computes the same value from the same list)."""
        n_units, old = len(self.reduce_at), self.forward
        used = frozenset().union(*(o.used for o in observations))
        keep = set(range(len(old)))
        if self.learning:
            keep = set(used) | {old.index(u) for u in range(n_units) if not any(old[c] == u for c in used)}
        keys = [(float(c), old[c]) for c in sorted(keep)]
        inserts = sorted({(p - 0.5, u) for o in observations for p, u in o.inserts})
        entries = sorted(keys + inserts)
        forward = tuple(u for _, u in entries)
        where = [k for k, _ in entries]

        def segment(old_s: int) -> int:  # the new entry whose span holds old entry old_s's nodes
            if old_s < 0:
                return -1
            i = 0
            for j, k in enumerate(where):
                if k <= old_s:
                    i = j
            return i

        # backward: an inserted entry needs its unit; while learning, an entry some rank read in
        # forward needs what backward was seen reading in its segment (the embedding's backward
        # reads no weight) and one no rank read keeps its unit (it may get tokens later); after
        # learning, needs only grow (by the reads the schedule missed)
        def start(k: float, u: int) -> set:
            if not k.is_integer():
                return {u}
            if self.learning:
                return set() if int(k) in used else {u}
            return set(self.needs[int(k)])

        needs = [start(k, u) for k, u in entries]
        for s, x in enumerate(self.needs):  # needs of dropped entries go to the entry now holding their nodes
            if s not in keep and not self.learning:
                needs[segment(s)] |= x
        for o in observations:
            for s, u in (o.needs if self.learning else o.missing):
                needs[segment(s)].add(u)
        needs = tuple(frozenset(x) for x in needs)
        reduce_at = [min(segment(p) if p >= 0 else -1, forward.index(u)) if p >= 0 else -1
                     for u, p in enumerate(self.reduce_at)]
        for o in observations:
            for u, s in o.late:
                reduce_at[u] = -1 if s < 0 or reduce_at[u] < 0 else min(reduce_at[u], segment(s))
        return CollectiveSchedule(forward=forward, needs=needs, reduce_at=tuple(reduce_at), learning=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    """The actions a :class:`CollectiveSchedule` implies (see :func:`program`).

    Attributes:
        forward: per entry ``c``, ``(frees, gathers)`` on entering it.
        backward: per event ``e`` in ``0 .. len(forward)`` (run from the last down to 0; event
            ``len(forward)`` is the start of backward), ``(reduces, frees, gathers)``.
        end: units reduce-scattered after the last event, then every unit is freed.
        segment_units: per segment, the units it needs.
        start_prefetch: the prefetch of the start event, issued (in this order, before anything
            of event ``len(forward) - 1``) when backward first reaches the model.
    """

    forward: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    backward: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    end: tuple[int, ...]
    segment_units: tuple[frozenset[int], ...]
    start_prefetch: tuple[int, ...] = ()


@functools.lru_cache(maxsize=64)
def program(schedule: CollectiveSchedule, *, reshard: bool, prefetch: bool,
            frozen: frozenset[int] = frozenset()) -> Program:
    """The per-entry and per-event actions of ``schedule`` (pure, cached).

    The alive set is simulated here, so what is gathered and freed depends on the schedule
    only, never on what this rank's data touched. ``frozen`` units (nothing in them trains)
    are gathered and freed like the others and never reduce-scattered.

    Examples:
        >>> s = CollectiveSchedule(forward=(0, 1, 0), needs=tuple(frozenset({u}) for u in (0, 1, 0)), reduce_at=(0, 1))
        >>> p = program(s, reshard=True, prefetch=True)
        >>> p.forward                  # entry 1 keeps unit 0 alive: it is prefetched for entry 2
        (((), (0, 1)), ((), ()), ((1,), ()))
        >>> p.backward[1]              # event 1: unit 1's reduce-scatter, keep unit 0 for segment 0
        ((1,), (1,), ())
    """
    fwd, n = schedule.forward, len(schedule.forward)
    alive: set[int] = set()
    forward = []
    for c in range(n):
        want = [fwd[c]] + ([fwd[c + 1]] if prefetch and c + 1 < n and fwd[c + 1] != fwd[c] else [])
        frees = tuple(sorted(u for u in alive if u not in want)) if reshard else ()
        alive -= set(frees)
        gathers = tuple(u for u in want if u not in alive)
        alive |= set(gathers)
        forward.append((frees, gathers))
    seg = schedule.needs
    later_need = [frozenset().union(*seg[:s]) if s else frozenset() for s in range(n + 1)]  # needed in segments < s
    backward: list = [None] * (n + 1)
    for e in range(n, -1, -1):
        reduces = tuple(u for u, p in enumerate(schedule.reduce_at) if p == e and u not in frozen) if e < n else ()
        soon = [seg[s] for s in (e - 1, e - 2 if prefetch else -1) if s >= 0]
        keep = frozenset().union(*soon) if soon else frozenset()
        if not reshard:
            keep |= later_need[e]
        frees = tuple(sorted(u for u in alive if u not in keep))
        alive -= set(frees)
        now = [u for u in _ordered(seg[e - 1], fwd[e - 1]) if u not in alive] if e >= 1 else []
        ahead = [u for u in _ordered(seg[e - 2], fwd[e - 2]) if u not in alive and u not in now] if prefetch and e >= 2 else []
        alive |= set(now) | set(ahead)
        if e == n:  # the loss's own backward runs first: prefetch once backward reaches the model
            start_prefetch, ahead = tuple(ahead), []
        backward[e] = (reduces, frees, tuple(now + ahead))
    end = tuple(u for u, p in enumerate(schedule.reduce_at) if p < 0 and u not in frozen)
    return Program(forward=tuple(forward), backward=tuple(backward), end=end, segment_units=seg,
                   start_prefetch=start_prefetch if n else ())


def _ordered(units: frozenset, first: int) -> list[int]:
    return ([first] if first in units else []) + sorted(u for u in units if u != first)


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """What one call executes, fixed for the call: the units' layouts, the schedule every rank
    agreed on, its program, and two indexes of the schedule."""

    layouts: tuple
    schedule: CollectiveSchedule
    program: Program
    entries_of: dict  # unit -> its forward entries
    completing: dict  # event e -> units whose last gradients arrive in segment e - 1

    @staticmethod
    def of(layouts, schedule: CollectiveSchedule, program: Program) -> Context:
        entries_of = collections.defaultdict(list)
        for c, i in enumerate(schedule.forward):
            entries_of[i].append(c)
        completing = collections.defaultdict(list)  # their reduce-scatter is at event e - 1
        for i, e in enumerate(schedule.reduce_at):
            if e >= 0:
                completing[e + 1].append(i)
        return Context(tuple(layouts), schedule, program, entries_of, completing)
