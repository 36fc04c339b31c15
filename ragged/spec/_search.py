"""The shard-size search behind the ``"exact"`` and ``"dp"`` strategies.

[Note: earliest placement is optimal for a fixed order and S]
Tensors t are placed in a fixed order at offsets ``l_t`` (multiples of ``align``) into a
buffer of ``m * S`` elements; rank k owns ``[kS, (k+1)S)``. A placement is valid when every
rank boundary ``kS`` strictly inside ``[l_t, l_t + e_t)`` satisfies ``(kS - l_t) % g_t == 0``.
Whether ``l_t`` is valid depends on ``l_t`` alone, and the set of valid positions for the
next tensor only shrinks as the previous end grows. So placing every tensor at its earliest
valid offset minimises every end, and S is feasible for the order iff that greedy ends
within ``m * S``. The earliest valid offset at or after ``p`` has a closed form
(``L = lcm(g, align)``, ``B`` = first boundary after ``p``):

* the tensor fits before ``B``: ``l = p``;
* ``S % g == 0`` (all boundaries congruent mod g): ``l = ceil(p / L) * L``;
* otherwise it may cross one boundary only: ``l = B - floor((B - p) / L) * L`` if the
  tensor then ends by ``B + S``; else the next band's ``l = B + S - floor(S / L) * L`` if it
  ends by ``B + 2S``; else S is infeasible.

The search evaluates that greedy for candidate S ascending from the lower bound
``ceil(total / m)`` (plain Python for the first few candidates of an interval, then numpy
over many candidates at once), so the first feasible S is the optimum for the order. Candidates are first filtered by a necessary condition: a tensor
too long to cross only one boundary forces ``S % g == 0``, so S only takes multiples of
the lcm of the forced granules (which change at a few thresholds). An upper bound that is always
feasible (``S >= max e`` and ``m*S >= sum(e + L + align)``) makes the search finite.
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import math

import numpy as np

from ragged._errors import RaggedValueError

_INFEASIBLE = np.int64(1) << np.int64(62)


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def earliest_offset(p, e, g, S, align: int):
    """Earliest valid offset at or after ``p`` (vectorised; ``_INFEASIBLE`` where none).

    ``p`` must be a multiple of ``align``; all array arguments broadcast together.
    """
    p, e, g, S = (np.asarray(x, dtype=np.int64) for x in (p, e, g, S))
    L = np.lcm(g, np.int64(align))
    off = p % S
    B = p - off + S
    l_div = -(-p // L) * L
    l_one = B - ((B - p) // L) * L
    l_next = B + S - (S // L) * L
    l_cross = np.where(
        S % g == 0,
        l_div,
        np.where(l_one + e <= B + S, l_one, np.where(l_next + e <= B + 2 * S, l_next, _INFEASIBLE)),
    )
    l = np.where((off + e <= S) | (e == 0), p, l_cross)
    return np.where(p >= _INFEASIBLE, _INFEASIBLE, l)


def earliest_offset_scalar(p: int, e: int, g: int, S: int, align: int) -> int | None:
    """:func:`earliest_offset` for one candidate, in plain Python ints (``None``: infeasible)."""
    off = p % S
    if e == 0 or off + e <= S:
        return p
    L = g * align // math.gcd(g, align)
    if S % g == 0:
        return -(-p // L) * L
    B = p - off + S
    l_one = B - ((B - p) // L) * L
    if l_one + e <= B + S:
        return l_one
    l_next = B + S - (S // L) * L
    if l_next + e <= B + 2 * S:
        return l_next
    return None


def greedy_end_scalar(sizes, granules, align: int, S: int, world_size: int | None, prefix, suffix) -> int | None:
    """:func:`greedy_ends` for one candidate S in plain Python (faster than numpy for a
    handful of candidates). ``prefix``/``suffix``: aligned prefix sums and raw suffix sums."""
    n = len(sizes)
    p = i = 0
    cap = None if world_size is None else S * world_size
    while True:
        B = (p // S + 1) * S
        j = bisect.bisect_right(prefix, B - p + prefix[i]) - 1
        if j >= n:
            return p + prefix[n] - prefix[i]
        p += prefix[j] - prefix[i]
        e = sizes[j]
        l = earliest_offset_scalar(p, e, granules[j], S, align)
        if l is None:
            return None
        p = -(-(l + e) // align) * align
        i = j + 1
        if cap is not None and p + suffix[i] > cap:
            return None


def greedy_ends(sizes, granules, align: int, shard_sizes, *, world_size: int | None = None) -> np.ndarray:
    """End of the earliest-placement greedy for every candidate shard size at once.

    Event driven: between rank boundaries the greedy only adds aligned sizes, so each step
    jumps (``searchsorted`` on the aligned prefix sums) straight to the next tensor that does
    not fit before its boundary and places that one with :func:`earliest_offset`. A run
    therefore costs about one step per boundary crossing, not one per tensor.

    Args:
        sizes: element count of each tensor, in buffer order.
        granules: granule (elements) of each tensor.
        align: offset alignment in elements; every candidate must be a multiple of it.
        shard_sizes: candidate S values.
        world_size: when given, a candidate whose end plus the sizes still to place exceeds
            ``world_size * S`` is dropped at once and reported infeasible.

    Returns:
        int64 array of ends (aligned), ``_INFEASIBLE`` where no placement exists.
    """
    S_all = np.asarray(shard_sizes, dtype=np.int64)
    sizes, granules, prefix, suffix = _arrays(sizes, granules, align)
    n = sizes.size
    ends = np.full(S_all.shape, _INFEASIBLE, dtype=np.int64)
    S, idx = S_all, np.arange(S_all.size)
    p = np.zeros_like(S)
    i = np.zeros_like(S)
    while S.size:
        B = (p // S + 1) * S
        # first tensor j >= i whose aligned end passes B when everything before it fits
        j = np.searchsorted(prefix, B - p + prefix[i], side="right") - 1
        done = j >= n
        if done.any():
            ends[idx[done]] = p[done] + prefix[n] - prefix[i[done]]
        live = ~done
        S, idx, p, i, j = S[live], idx[live], p[live], i[live], j[live]
        if not S.size:
            break
        p = p + prefix[j] - prefix[i]
        l = earliest_offset(p, sizes[j], granules[j], S, align)
        p = np.where(l >= _INFEASIBLE, _INFEASIBLE, -(-(l + sizes[j]) // align) * align)
        i = j + 1
        keep = p < _INFEASIBLE
        if world_size is not None:
            keep &= p + suffix[i] <= S * world_size
        S, idx, p, i = S[keep], idx[keep], p[keep], i[keep]
    return ends


def _arrays(sizes, granules, align: int):
    """int64 arrays of sizes, granules, aligned prefix sums and raw suffix sums (cached for
    tuples: the multi-buffer search solves one order of one buffer many times)."""
    if isinstance(sizes, tuple) and isinstance(granules, tuple):
        return _arrays_cached(sizes, granules, align)
    return _arrays_of(sizes, granules, align)


def _arrays_of(sizes, granules, align: int):
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    granules = np.asarray(granules, dtype=np.int64).reshape(-1)
    aligned = -(-sizes // align) * align
    prefix = np.concatenate([[0], np.cumsum(aligned)])
    suffix = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0]])
    return sizes, granules, prefix, suffix


_arrays_cached = functools.lru_cache(maxsize=64)(_arrays_of)


@functools.lru_cache(maxsize=64)
def _prepared(sizes: tuple, granules: tuple, align: int, world_size: int):
    """What :func:`min_shard_size` derives from one order before scanning (cached)."""
    sizes_l = [int(e) for e in sizes]
    granules_l = [int(g) for g in granules]
    total = sum(sizes_l)
    atomic = max((e for e, g in zip(sizes_l, granules_l) if e <= g), default=0)
    prefix = list(itertools.accumulate((-(-e // align) * align for e in sizes_l), initial=0))
    suffix = list(itertools.accumulate(reversed(sizes_l), initial=0))[::-1]  # suffix[k] = sum(sizes_l[k:])
    kinds = tuple((e, g, c) for (e, g), c in collections.Counter(zip(sizes_l, granules_l)).items())
    return sizes_l, granules_l, total, atomic, prefix, suffix, kinds, upper_bound(sizes_l, granules_l, align, world_size)


@functools.lru_cache(maxsize=65536)
def _release_threshold(e: int, g: int, align: int) -> int:
    """Smallest S at which a tensor of ``e`` elements and granule ``g`` may cross only one
    boundary (``e <= S + floor(S / L) * L``); below it, S must be a multiple of ``g``."""
    L = _lcm(g, align)
    lo, hi = 0, max(e, 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if e <= mid + (mid // L) * L:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _candidate_intervals(sizes, granules, align: int, lo: int, hi: int):
    """Yields ``(start, stop, step)``: ascending intervals of S in ``[lo, hi]`` where the set
    of tensors forced to ``S % g == 0`` (see the module note) is constant, and ``step``, the
    lcm of ``align`` and their granules, so only multiples of ``step`` can be feasible."""
    thresholds = {}
    for e, g in set(zip((int(x) for x in sizes), (int(x) for x in granules))):
        if e <= g:
            continue  # never split at all, so never forces anything
        t = _release_threshold(e, g, align)
        if t > lo:
            thresholds.setdefault(t, []).append(g)
    cuts = sorted(t for t in thresholds if t <= hi)
    edges = [lo, *cuts, hi + 1]
    for k in range(len(edges) - 1):
        a, b = edges[k], edges[k + 1]
        if a >= b:
            continue
        step = align
        for t, gs in thresholds.items():
            if t > a:
                for g in gs:
                    step = _lcm(step, g)
        yield a, b, step


def upper_bound(sizes, granules, align: int, world_size: int) -> int:
    """A shard size that is always feasible for any order (see the module note)."""
    slack = sum(int(e) + _lcm(int(g), align) + align for e, g in zip(sizes, granules))
    bound = max(max((int(e) for e in sizes), default=0), -(-slack // world_size), align)
    return -(-bound // align) * align


def order_free_lower_bound(sizes, granules, align: int, world_size: int) -> int:
    """A lower bound on S valid for *every* order: the smallest multiple of ``align`` that is
    at least ``ceil(total / m)`` and the largest uncuttable tensor, and a multiple of every
    granule its forced tensors require (see the module note). When a plan reaches it, no
    order and no planner can do better.
    """
    counts = collections.Counter((int(e), int(g)) for e, g in zip(sizes, granules))
    return kinds_lower_bound(tuple((e, g, c) for (e, g), c in counts.items()), align, world_size)


def kinds_lower_bound(kinds: tuple[tuple[int, int, int], ...], align: int, world_size: int) -> int:
    """:func:`order_free_lower_bound` of tensors given as ``(numel, granule, count)`` kinds
    (what the multi-buffer search evaluates: O(kinds), not O(tensors)): the first candidate
    of :func:`_candidate_intervals` that :class:`OrderFree` accepts."""
    total = sum(e * c for e, _, c in kinds)
    atomic = max((e for e, g, _ in kinds if e <= g), default=0)
    lo = max(-(-total // world_size), atomic, 1)
    lo = -(-lo // align) * align
    slack = sum((e + _lcm(g, align) + align) * c for e, g, c in kinds)
    hi = max(max((e for e, _, _ in kinds), default=0), -(-slack // world_size), align)
    hi = -(-hi // align) * align
    check = OrderFree(kinds, align, world_size, lo)
    for a, b, step in _candidate_intervals([e for e, _, _ in kinds], [g for _, g, _ in kinds], align, lo, hi):
        for S in check.candidates(a, b, step):
            if S.size:
                return int(S[0])
    return hi  # the upper bound is feasible, hence accepted


class OrderFree:
    """Necessary conditions on S that hold for every order (they never reject a feasible S;
    they spare the greedy of :func:`min_shard_size` and tighten :func:`kinds_lower_bound`).

    [Note: pieces are multiples of G]
    Every piece a rank holds of tensor t is the whole tensor (``e``), a head cut at a granule
    boundary (a multiple of ``g``), a whole shard (``S``, only when ``S % g == 0``) or the tail
    after the last cut (``e - k*g``): all multiples of ``G_t = gcd(e, g)``. Pick any G: a rank
    that holds pieces only of tensors whose ``G_t`` is a multiple of G holds at most
    ``f = floor(S / G) * G`` elements, and the other tensors (``e`` elements each) touch at most
    ``k = sum(ceil(e / S) + 1)`` ranks, so ``(m - k) * f + k * S >= total``. E.g. 514 DeepSeek-V3
    expert matrices of 16 granules over 256 ranks need 33 granules per rank, not 32.2.

    [Note: tensors that cross one boundary]
    At a candidate S with ``S % g != 0``, a tensor with ``e > S`` crosses exactly one boundary
    B (two would need ``S % g == 0``), starting at ``B - j*L`` (``L = lcm(g, align)``) with
    ``max(L, e - S) <= j*L <= S``. So such tensors sit on distinct boundaries (at most
    ``m - 1`` of them), and two of them on *adjacent* boundaries B, B + S (t1 ends before t2
    starts) need ``floor(S/L1)*L1 - ceil(max(L2, e2 - S)/L2)*L2 >= e1 - S``. When no pair of
    their kinds can be adjacent, n of them need n pairwise non-adjacent boundaries out of
    ``m - 1``: ``n <= m // 2``. E.g. 514 expert matrices of 16 granules over 1024 ranks at S
    between 8 and 9 granules: each needs two ranks of its own, 1028 > 1024.
    """

    _MAX_G = 8

    def __init__(self, kinds, align: int, world_size: int, lo: int):
        """``kinds``: ``(numel, granule, count)`` of every tensor; ``lo``: the smallest S that
        will be asked about."""
        self.align, self.m = align, world_size
        self.total = sum(e * c for e, _, c in kinds)
        self.crossing = tuple((e, g, c) for e, g, c in kinds if e > lo and e > g)
        by_G: dict[int, int] = {}
        for e, g, c in kinds:
            if e:
                G = math.gcd(e, g)
                by_G[G] = by_G.get(G, 0) + e * c
        # the G values that carry the most elements (a G dividing align constrains nothing)
        top = sorted(by_G, key=lambda G: -by_G[G])[: self._MAX_G]
        Gs = list(dict.fromkeys([*top, *(math.gcd(a, b) for i, a in enumerate(top) for b in top[i + 1 :])]))
        Gs = [G for G in Gs if G > 1 and align % G][: 2 * self._MAX_G]
        self.pieces = [(G, tuple((e, c) for e, g, c in kinds if e and math.gcd(e, g) % G)) for G in Gs]

    def __bool__(self) -> bool:
        return bool(self.crossing or self.pieces)

    def candidates(self, a: int, b: int, step: int):
        """Yields arrays of the accepted multiples of ``step`` in ``[a, b)``, ascending, in
        growing chunks."""
        start = -(-a // step) * step
        chunk = 16
        while start < b:
            S = np.arange(start, min(start + chunk * step, b), step, dtype=np.int64)
            start += chunk * step
            chunk = min(chunk * 4, 1 << 16)
            yield S[self.accepts(S)] if self else S

    def accepts(self, S: np.ndarray) -> np.ndarray:
        S = np.asarray(S, dtype=np.int64)
        ok = np.ones(S.shape, dtype=bool)
        m = self.m
        for G, others in self.pieces:
            k = np.zeros(S.shape, dtype=np.int64)
            for e, c in others:
                k += c * (-(-e // S) + 1)
            k = np.minimum(k, m)
            ok &= (m - k) * ((S // G) * G) + k * S >= self.total
        if self.crossing:
            ok &= self._crossings(S)
        return ok

    def _crossings(self, S: np.ndarray) -> np.ndarray:
        kinds, align, m = self.crossing, self.align, self.m
        cross, n = [], np.zeros(S.shape, dtype=np.int64)
        for e, g, c in kinds:
            one = (e > S) & (S % g != 0)
            cross.append(one)
            n = n + c * one
        ok = n <= m - 1
        busy = n > m // 2
        if not busy.any():
            return ok
        adjacent = np.zeros(S.shape, dtype=bool)
        for a, (e1, g1, c1) in enumerate(kinds):
            L1 = _lcm(g1, align)
            room = (S // L1) * L1 - (e1 - S)  # the most t1 can leave before B + S
            for b, (e2, g2, _) in enumerate(kinds):
                if a == b and c1 < 2:
                    continue
                L2 = _lcm(g2, align)
                need = -(-np.maximum(L2, e2 - S) // L2) * L2
                adjacent |= cross[a] & cross[b] & (room >= need)
        return ok & ~(busy & ~adjacent)


def min_shard_size(sizes, granules, align: int, world_size: int, *, limit: int | None = None,
                   start: int | None = None, scalar: int = 8) -> int | None:
    """The smallest S (multiple of ``align``) for which the order has a valid placement.

    Candidates ascend from the lower bound ``max(ceil(total / m), largest uncuttable
    tensor)``; within each interval of :func:`_candidate_intervals` only multiples of its
    step are tried, a few at a time at first (usually the first one or two are feasible),
    then in growing chunks.

    Args:
        limit: when given, look only at ``S <= limit`` and return ``None`` if none is
            feasible (used to try further orders against the best S so far).
        start: when given, look only at ``S >= start`` (the caller knows smaller S are
            infeasible for this order, e.g. from an earlier call with ``limit=start - align``).
        scalar: how many candidates to try one by one in plain Python before vectorising
            (fast when one of the first is feasible; a resumed scan, whose first candidates
            are unlikely to be, passes 0).
    """
    sizes, granules = tuple(int(e) for e in sizes), tuple(int(g) for g in granules)
    sizes_l, granules_l, total, atomic, prefix, suffix, kinds, hi = _prepared(sizes, granules, align, world_size)
    # A tensor no longer than its granule can never be cut, so it must fit in one shard.
    lo = max(-(-total // world_size), atomic, 1, start or 1)
    lo = -(-lo // align) * align
    if limit is not None:
        hi = min(hi, limit)
        if hi < lo:
            return None
    check = OrderFree(kinds, align, world_size, lo)
    scalar_left = scalar
    for a, b, step in _candidate_intervals(sizes, granules, align, lo, hi):
        for S in check.candidates(a, b, step):
            # The first few candidates one by one in plain Python (usually one of them is feasible).
            i = 0
            while scalar_left and i < S.size:
                candidate = int(S[i])
                end = greedy_end_scalar(sizes_l, granules_l, align, candidate, world_size, prefix, suffix)
                if end is not None and end <= candidate * world_size:
                    return candidate
                i += 1
                scalar_left -= 1
            for j in range(i, S.size, 4096):
                part = S[j : j + 4096]
                ends = greedy_ends(sizes, granules, align, part, world_size=world_size)
                feasible = np.nonzero(ends <= part * world_size)[0]
                if feasible.size:
                    return int(part[feasible[0]])
    if limit is not None:
        return None
    raise AssertionError("unreachable: the upper bound is always feasible")  # pragma: no cover


def place(sizes, granules, align: int, shard_size: int) -> list[int]:
    """Offsets of the earliest-placement greedy for one shard size (one tensor at a time,
    with :func:`earliest_offset_scalar`, the scalar twin of what the search uses)."""
    offsets, p = [], 0
    for e, g in zip(sizes, granules):
        e, g = int(e), int(g)
        l = earliest_offset_scalar(p, e, g, shard_size, align)
        if l is None:
            raise RaggedValueError(f"shard size {shard_size} is infeasible for this order")
        offsets.append(l)
        p = -(-(l + int(e)) // align) * align
    return offsets
