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
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    granules = np.asarray(granules, dtype=np.int64).reshape(-1)
    n = sizes.size
    aligned = -(-sizes // align) * align
    prefix = np.concatenate([[0], np.cumsum(aligned)])
    suffix = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0]])
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
    total = sum(int(e) for e in sizes)
    atomic = max((int(e) for e, g in zip(sizes, granules) if int(e) <= int(g)), default=0)
    lo = max(-(-total // world_size), atomic, 1)
    lo = -(-lo // align) * align
    hi = upper_bound(sizes, granules, align, world_size)
    for a, b, step in _candidate_intervals(sizes, granules, align, lo, hi):
        start = -(-a // step) * step
        if start < b:
            return start
    return hi  # pragma: no cover (the last interval always holds hi)


def min_shard_size(sizes, granules, align: int, world_size: int, *, limit: int | None = None) -> int | None:
    """The smallest S (multiple of ``align``) for which the order has a valid placement.

    Candidates ascend from the lower bound ``max(ceil(total / m), largest uncuttable
    tensor)``; within each interval of :func:`_candidate_intervals` only multiples of its
    step are tried, a few at a time at first (usually the first one or two are feasible),
    then in growing chunks.

    Args:
        limit: when given, look only at ``S <= limit`` and return ``None`` if none is
            feasible (used to try further orders against the best S so far).
    """
    total = sum(int(e) for e in sizes)
    # A tensor no longer than its granule can never be cut, so it must fit in one shard.
    atomic = max((int(e) for e, g in zip(sizes, granules) if int(e) <= int(g)), default=0)
    lo = max(-(-total // world_size), atomic, 1)
    lo = -(-lo // align) * align
    hi = upper_bound(sizes, granules, align, world_size)
    if limit is not None:
        hi = min(hi, limit)
    sizes_l = [int(e) for e in sizes]
    granules_l = [int(g) for g in granules]
    prefix = [0]
    for e in sizes_l:
        prefix.append(prefix[-1] + -(-e // align) * align)
    suffix = [0] * (len(sizes_l) + 1)
    for k in range(len(sizes_l) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + sizes_l[k]
    for a, b, step in _candidate_intervals(sizes, granules, align, lo, hi):
        start = -(-a // step) * step
        # The first few candidates one by one in plain Python (usually one of them is feasible).
        for _ in range(8):
            if start >= b:
                break
            end = greedy_end_scalar(sizes_l, granules_l, align, start, world_size, prefix, suffix)
            if end is not None and end <= start * world_size:
                return start
            start += step
        chunk = 16
        while start < b:
            S = np.arange(start, min(start + chunk * step, b), step, dtype=np.int64)
            ends = greedy_ends(sizes, granules, align, S, world_size=world_size)
            feasible = np.nonzero(ends <= S * world_size)[0]
            if feasible.size:
                return int(S[feasible[0]])
            start += chunk * step
            chunk = min(chunk * 4, 4096)
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
