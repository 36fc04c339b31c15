"""Shared helpers of the property tests: the contract's invariants and an exhaustive solver.

The brute force is independent of the planner: it enumerates every aligned offset of every
tensor (memoised on (tensor, previous end)), with no greedy argument.
"""

import functools
import math

import ragged as rg


def check_invariants(plan, params):
    """Every invariant of the public contract for a single-buffer plan; returns nothing, asserts."""
    assert plan.buffers == ((0, plan.shard_size),)
    m, S = plan.world_size, plan.shard_size
    assert S >= 1 and S % plan.align == 0
    assert plan.buffer_numel == m * S
    leaves = sorted(plan.leaves, key=lambda l: (l.offset, l.stop))
    # each leaf contiguous, inside the buffer, disjoint from the next (padding only between leaves / at the end)
    for a, b in zip(leaves, leaves[1:]):
        assert a.stop <= b.offset, (a.path, b.path)
    for leaf in leaves:
        assert 0 <= leaf.offset and leaf.stop <= m * S
        assert leaf.offset % plan.align == 0
        assert leaf.numel == math.prod(leaf.shape)
        if plan.strategy != "naive":  # blocks never cross a rank boundary
            for k in range(1, m):
                if leaf.offset < k * S < leaf.stop:
                    assert (k * S - leaf.offset) % leaf.granule == 0, (leaf.path, k)
    # all ranks hold S elements; local pieces tile every leaf exactly once, in order
    covered = {leaf.path: 0 for leaf in plan.leaves}
    for r in range(m):
        pieces = plan.local_pieces(r)
        assert sum(p.numel for p in pieces) <= S
        for p in pieces:
            assert 0 <= p.local_offset and p.local_offset + p.numel <= S
            assert p.start == covered[p.leaf.path]
            covered[p.leaf.path] = p.stop
            assert math.prod(p.shape) == p.numel
    assert covered == {leaf.path: leaf.numel for leaf in plan.leaves}
    assert sum(plan.occupancy()) == plan.numel
    assert plan.padding == m * S - plan.numel >= 0
    # every params leaf appears exactly once (sharded or replicated)
    paths = [leaf.path for leaf in plan.leaves + plan.replicated]
    assert len(paths) == len(set(paths)) == len(rg.pytree.leaves(params))


def brute_min_shard_size(sizes, granules, align, m):
    """Smallest S (multiple of align) with any valid placement in this order: exhaustive."""
    S = max(align, -(-(-(-sum(sizes) // m)) // align) * align)
    while not brute_feasible(sizes, granules, align, m, S):
        S += align
    return S


def brute_feasible(sizes, granules, align, m, S):
    """Whether tensors in this order have any valid placement in m shards of S (exhaustive)."""
    n = len(sizes)

    def valid(l, e, g, S):
        return all((k * S - l) % g == 0 for k in range(1, m) if l < k * S < l + e)

    def feasible(S):
        cap = m * S

        @functools.lru_cache(maxsize=None)
        def dfs(i, p):
            if i == n:
                return True
            e, g = sizes[i], granules[i]
            start = -(-p // align) * align
            return any(valid(l, e, g, S) and dfs(i + 1, l + e) for l in range(start, cap - e + 1, align))

        return dfs(0, 0)

    return feasible(S)


