"""Several buffers per unit: which leaves share a buffer, and in what order
(``make_plan(..., max_buffers=K | "auto")``).

[Note: why several buffers]
In one buffer, a leaf longer than about ``2 * S`` crosses two rank boundaries, so ``S`` must be
a multiple of its granule, and of the lcm of the granules of all such leaves (see the module
note of ``_search.py``). Leaves with incompatible granules (row lengths 7168, 18432, 16384 of
one DeepSeek-V3 dense layer) then force ``S`` to a multiple of a huge lcm: 35.9% padding at
rows:1, m=256. In separate buffers each leaf only constrains its own buffer's ``S_b``, every
leaf stays one contiguous view of the gathered unit (zero copy), and all buffers of a unit
still move in one coalesced launch (``transforms.all_gather_flat``). Buffer b holds global
``[offset_b, offset_b + m * S_b)``; see [Note: buffers of a plan] in ``_plan.py``.

[Note: the buffer cost model]
A partition into B buffers with shard sizes ``S_b`` costs

    cost = padding * itemsize + (B - 1) * LAUNCH_COST_BYTES,   padding = m * sum(S_b) - numel

Padding costs bytes: every rank receives the whole ``m * S`` gathered buffer in each all-gather
and sends it in each reduce-scatter, and holds ``S`` elements of parameters, gradients and
optimizer state. An extra buffer costs one more collective inside the unit's coalesced launch;
``LAUNCH_COST_BYTES`` converts that to bytes as (per-op latency) x (bandwidth): on NCCL about
10 us x 100 GB/s = 1 MB (a collective's latency inside a group and an inter-node all-gather's
bus bandwidth, orders of magnitude, not measured here: no GPU); on gloo on the 2-core CI machine
``bench/buffers.py`` measures the extra buffer's cost in the same terms (docs/planning.md). We
take 1 MiB, the larger: an extra buffer must save at least 1 MiB of gathered padding.

The cost model never trades padding for launches *below* the baselines: ``"auto"`` and an
int ``K`` return a partition whose padding is at most that of each baseline within the buffer
budget (one buffer: today's ``dp``; one buffer per distinct granule; one buffer per leaf), and
among those the cheapest. ``"auto"`` allows :data:`AUTO_MAX_BUFFERS` buffers and charges
``LAUNCH_COST_BYTES`` per extra buffer; an int ``K`` charges nothing for launches (least
padding with at most K buffers, fewer buffers on ties). ``max_buffers=1`` is today's
single-buffer planner, bit for bit.

[Note: the partition search]
Leaves of equal (numel, granule) are interchangeable, so the search moves *kinds* (all leaves
of one (numel, granule)), never single leaves: a DeepSeek-V3 MoE layer has 782 leaves but 12
kinds. From the best baseline and from one-buffer-per-granule (merged down to the budget), a
best-improvement local search applies two moves: move one kind to another (or a new) buffer,
merge two buffers. The objective is lexicographic: first padding above the baselines' best,
then cost, then buffer count. A buffer's ``S_b`` is the exact solve of ``_search`` over the
strategy's leaf orders restricted to the buffer; neighbours are first ranked by
:func:`~ragged.spec._search.kinds_lower_bound` (order-free, valid for any order), and solved
exactly only while their bound can still beat the best neighbour found, so most neighbours cost
O(kinds). Buffers are numbered by the tree position of their first leaf.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ragged._errors import check_int
from ragged.spec import _search

__all__ = ["AUTO_MAX_BUFFERS", "LAUNCH_COST_BYTES", "partition", "check_max_buffers"]

#: Most buffers ``max_buffers="auto"`` uses per unit.
AUTO_MAX_BUFFERS = 8
#: What one more buffer in a unit's coalesced collective costs, in gathered bytes of padding it
#: must save (see [Note: the buffer cost model]).
LAUNCH_COST_BYTES = 1 << 20
#: Search bounds: a unit with more kinds searches over granules instead of kinds; the local
#: search stops after this many improvements, or once its exact solves have scanned this many
#: candidate shard sizes (a deterministic budget, so plans never depend on the machine).
_MAX_ATOMS = 32
_MAX_ROUNDS = 64
_SEARCH_WORK = 1 << 14


@functools.lru_cache(maxsize=16384)
def _least_shard_size(sizes: tuple[int, ...], granules: tuple[int, ...], align: int, world_size: int, start: int,
                      limit: int, scalar: int) -> int | None:
    """The least feasible S in ``[start, limit]`` for this order (smaller S known infeasible), or
    ``None`` (``scalar``: candidates to try one by one first, see ``_search.min_shard_size``)."""
    return _search.min_shard_size(sizes, granules, align, world_size, limit=limit, start=start, scalar=scalar)


def check_max_buffers(max_buffers) -> int | str:
    if max_buffers == "auto":
        return max_buffers
    return check_int("max_buffers", max_buffers, fix=(
        f" It may also be 'auto'. 1 (default) plans one buffer per unit; K allows up to K buffers (least "
        f"padding); 'auto' up to {AUTO_MAX_BUFFERS} with the cost model in ragged/spec/_buffers.py."))


class _Groups:
    """Shard sizes of candidate buffers, memoised. A buffer is a frozenset of *atoms* (ids of
    groups of interchangeable leaves, see [Note: the partition search])."""

    def __init__(self, items, atoms, orders, align: int, world_size: int):
        self.items, self.orders = items, orders
        self.align, self.m = align, world_size
        self.atoms = atoms  # atom id -> leaf indices
        self.atom_of = [0] * len(items)
        for a, leaves in enumerate(atoms):
            for i in leaves:
                self.atom_of[i] = a
        self.kinds = []  # atom id -> ((numel, granule, count), ...)
        for leaves in atoms:
            counts: dict[tuple[int, int], int] = {}
            for i in leaves:
                counts[items[i]] = counts.get(items[i], 0) + 1
            self.kinds.append(tuple((e, g, c) for (e, g), c in counts.items()))
        self.exact: dict[frozenset, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        self.lower: dict[frozenset, int] = {}
        self.resume: dict[frozenset, list] = {}  # per buffer: [[order, sizes, granules, next S to try]]
        self.work = 0  # candidate shard sizes scanned by bounded (search) solves

    def leaves(self, group: frozenset) -> frozenset:
        return frozenset(i for a in group for i in self.atoms[a])

    def bound(self, group: frozenset) -> int:
        """The exact S when known, else a lower bound valid for every order."""
        hit = self.exact.get(group)
        if hit is not None:
            return hit[0]
        lb = self.lower.get(group)
        if lb is None:
            counts: dict[tuple[int, int], int] = {}
            for a in group:
                for e, g, c in self.kinds[a]:
                    counts[(e, g)] = counts.get((e, g), 0) + c
            kinds = tuple((e, g, c) for (e, g), c in counts.items())
            lb = self.lower[group] = _search.kinds_lower_bound(kinds, self.align, self.m)
        return lb

    def contains(self, group: frozenset, part: frozenset) -> None:
        """``part`` is a subset of ``group``: its exact S (when known) bounds ``group``'s from
        below, since a placement of ``group`` restricted to ``part`` is one of ``part`` in the
        restricted order (and every order of ``part`` is a restriction)."""
        hit = self.exact.get(part)
        if hit is not None and group not in self.exact:
            self.lower[group] = max(self.bound(group), hit[0])

    def solved(self, group: frozenset, limit: int | None = None):
        """``(S, order, offsets)``: the best of the strategy's orders restricted to ``group``,
        or ``None`` when no order has a feasible ``S <= limit`` (the bound then rises above it).

        Exact: every order is scanned upward in rounds of growing limits (``lb``, then 8, 64,
        512, ... alignment steps above it; each round resumes where the last one stopped, a
        bounded call where it gave up, and later orders only look below the best S found), so
        a poor order is never scanned far past the best one's S. See [Note: the partition
        search].
        """
        hit = self.exact.get(group)
        if hit is not None:
            return hit if limit is None or hit[0] <= limit else None
        lb = self.bound(group)
        if limit is not None and limit < lb:
            return None
        runs = self.resume.get(group)
        if runs is None:
            runs, seen, atom_of = [], set(), self.atom_of
            for order in self.orders:
                sub = tuple(i for i in order if atom_of[i] in group)
                if sub not in seen:
                    seen.add(sub)
                    runs.append([sub, tuple(self.items[i][0] for i in sub), tuple(self.items[i][1] for i in sub), lb])
            self.resume[group] = runs
        for k in range(64):
            # rounds of 1, 8, 64, ... candidates above lb; an order only needs to beat the best so far
            top = lb + (self.align << (3 * k) if k else 0)
            spent = False
            if limit is not None:  # a search solve: within the limit and what is left of the work budget
                top = min(top, limit)
                left = (_SEARCH_WORK - self.work) // len(runs)
                if left <= 0:
                    return None
                reach = min(run[3] for run in runs) + (left - 1) * self.align
                if reach < top:
                    top, spent = reach, True
            best = None
            for run in runs:
                sub, sizes, granules, start = run
                cap = top if best is None else min(top, best[0] - self.align)
                if start <= cap:
                    if limit is not None:
                        self.work += (cap - start) // self.align + 1
                    S = _least_shard_size(sizes, granules, self.align, self.m, start, cap, 8 if start == lb else 0)
                    if S is not None:
                        best = (S, sub, sizes, granules)
                    run[3] = max(start, cap + self.align)
            if best is not None:
                S, sub, sizes, granules = best
                hit = self.exact[group] = (S, sub, tuple(_search.place(sizes, granules, self.align, S)))
                del self.resume[group]
                return hit
            self.lower[group] = top + self.align
            if limit is not None and (top >= limit or spent):
                return None
        raise AssertionError("unreachable: the upper bound is feasible")  # pragma: no cover


class _Objective:
    """The lexicographic objective of [Note: the partition search] for states (tuples of
    buffers), by lower bound (cheap) or exactly, optionally only below a bar."""

    def __init__(self, groups: _Groups, total: int, limit: int, launch: float):
        self.groups, self.total, self.limit, self.launch = groups, total, limit, launch

    def of_total(self, shard_total: int, num_buffers: int):
        pad = self.groups.m * shard_total - self.total
        return (max(0, pad - self.limit), pad + self.launch * (num_buffers - 1), num_buffers)

    def estimate(self, state):
        return self.of_total(sum(self.groups.bound(g) for g in state), len(state))

    def exact(self, state, bar=None):
        """The exact objective, or ``None`` when it is not below ``bar`` (then each buffer is
        solved only as far as could still get below it)."""
        groups, align = self.groups, self.groups.align
        sizes = {g: groups.bound(g) for g in state}
        for g in sorted((g for g in state if g not in groups.exact), key=lambda g: -sizes[g]):
            limit = None
            if bar is not None:
                others = sum(sizes.values()) - sizes[g]
                limit = self._max_total(bar, len(state), others + sizes[g]) - others
                limit -= limit % align
            hit = groups.solved(g, limit)
            if hit is None:
                return None
            sizes[g] = hit[0]
        obj = self.of_total(sum(sizes.values()), len(state))
        return obj if bar is None or obj < bar else None

    def _max_total(self, bar, num_buffers: int, low: int) -> int:
        """The largest shard total whose objective is below ``bar`` (``low - 1`` if none)."""
        if not self.of_total(low, num_buffers) < bar:
            return low - 1
        hi = max(low, 1)
        while self.of_total(hi, num_buffers) < bar:
            hi *= 2
        lo = low  # of_total(lo) < bar <= of_total(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.of_total(mid, num_buffers) < bar:
                lo = mid
            else:
                hi = mid
        return lo


def partition(
    items: Sequence[tuple[int, int]],
    *,
    world_size: int,
    align: int,
    max_buffers: int | str,
    itemsize: int,
    orders: Sequence[tuple[int, ...]],
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The buffers of one unit: ``[(S_b, leaf indices in buffer order, offsets in the buffer)]``.

    See [Note: the buffer cost model] and [Note: the partition search].

    Args:
        items: ``(numel, granule)`` of each sharded leaf, in tree order.
        world_size, align: as in ``make_plan``.
        max_buffers: an int K >= 1 or ``"auto"``.
        itemsize: bytes per element of the buffer dtype (the cost model counts bytes).
        orders: candidate leaf orders (sequences of all item indices); each buffer takes the
            best of them restricted to its leaves (each buffer's ``S`` the exact solve of
            ``_search``, its offsets ``_search.place``).
    """
    items = [(int(e), int(g)) for e, g in items]
    n, m = len(items), world_size
    K = AUTO_MAX_BUFFERS if max_buffers == "auto" else int(max_buffers)
    atoms = _atoms(items, K)
    groups = _Groups(items, atoms, orders, align, m)
    total = sum(e for e, _ in items)

    # ---- baselines: the padding the result may not exceed ---------------------------------
    everything = frozenset(range(len(atoms)))
    by_granule: dict[int, set[int]] = {}
    for a, leaves in enumerate(atoms):
        by_granule.setdefault(items[leaves[0]][1], set()).add(a)
    baselines = [(everything,)]
    if 1 < len(by_granule) <= K:
        baselines.append(tuple(frozenset(v) for v in by_granule.values()))
    if 1 < n <= K:  # atoms are single leaves
        baselines.append(tuple(frozenset((a,)) for a in range(n)))
    limit = min(m * sum(groups.solved(g)[0] for g in b) - total for b in baselines)
    objective = _Objective(groups, total, limit, LAUNCH_COST_BYTES / itemsize if max_buffers == "auto" else 0.0)

    best_state = min(baselines, key=objective.exact)
    best = objective.exact(best_state)
    if K > 1 and len(atoms) > 1:
        for start in (_granule_start(by_granule, K, objective), (everything,)):
            if start is None:
                continue
            state = _local_search(start, K, objective)
            obj = objective.exact(state)
            if obj < best:
                best_state, best = state, obj
    return [groups.solved(g) for g in sorted(best_state, key=lambda g: min(groups.leaves(g)))]


def _atoms(items, K: int) -> list[tuple[int, ...]]:
    """Leaf indices grouped into the search's atoms: single leaves when there are at most K
    (one buffer per leaf is then a baseline), else one atom per (numel, granule) kind, or per
    granule when there are more than ``_MAX_ATOMS`` kinds."""
    if len(items) <= K:
        return [(i,) for i in range(len(items))]
    def indices_by(keys) -> list[tuple[int, ...]]:
        groups: dict = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        return [tuple(ix) for ix in groups.values()]

    kinds = indices_by(items)
    return kinds if len(kinds) <= _MAX_ATOMS else indices_by(g for _, g in items)


def _best(candidates, state, objective: _Objective, bar):
    """``(objective, candidate)`` of the candidate state with the smallest exact objective
    below ``bar`` (``None``: any), or ``(bar, None)``: ranked by lower bound (raised by the
    exact S of ``state``'s buffers they contain), solved exactly only while the bound can win."""
    groups = objective.groups
    for c in candidates:
        for g in c:
            for old in state:
                if old <= g:
                    groups.contains(g, old)
    ranked = sorted(((objective.estimate(c), i, c) for i, c in enumerate(candidates)), key=lambda r: r[:2])
    best = (bar, None)
    for est, _, c in ranked:
        if best[0] is not None and est >= best[0]:
            break
        if bar is not None and groups.work > _SEARCH_WORK:
            break
        obj = objective.exact(c, best[0])
        if obj is not None:
            best = (obj, c)
    return best


def _granule_start(by_granule, K: int, objective: _Objective):
    """One buffer per granule, merged greedily (best exact merge first) down to K buffers."""
    state = tuple(frozenset(v) for v in by_granule.values())
    if len(state) < 2:
        return None
    while len(state) > K:
        merges = [tuple(g for k, g in enumerate(state) if k not in (i, j)) + (state[i] | state[j],)
                  for i in range(len(state)) for j in range(i + 1, len(state))]
        state = _best(merges, state, objective, None)[1]
    return state


def _local_search(start, K: int, objective: _Objective):
    """Best-improvement over "move one atom to another (or a new) buffer" and "merge two
    buffers", from ``start``, within ``_MAX_ROUNDS`` improvements and ``_SEARCH_WORK``."""
    state = tuple(start)
    current = objective.exact(state)
    for _ in range(_MAX_ROUNDS):
        candidates = []
        B = len(state)
        for i, group in enumerate(state):
            others = state[:i] + state[i + 1 :]
            for atom in group:
                rest = group - {atom}
                for k in range(len(others)):
                    moved = others[:k] + (others[k] | {atom},) + others[k + 1 :]
                    candidates.append(moved + (rest,) if rest else moved)
                if rest and B < K:
                    candidates.append(others + (rest, frozenset((atom,))))
        for i in range(B):
            for j in range(i + 1, B):
                candidates.append(tuple(g for k, g in enumerate(state) if k not in (i, j)) + (state[i] | state[j],))
        obj, better = _best(candidates, state, objective, current)
        if better is None:
            break
        state, current = better, obj
    return state
