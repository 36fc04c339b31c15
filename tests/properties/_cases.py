"""Shared helpers of the property tests: the contract's invariants and an exhaustive solver.

The brute force is independent of the planner: it enumerates every aligned offset of every
tensor (memoised on (tensor, previous end)), with no greedy argument.
"""

import functools
import math

import ragged as rg


def check_invariants(plan, params, *, single: bool = True):
    """Every invariant of the public contract, per buffer; returns nothing, asserts.

    ``single``: also assert the plan has one buffer (``buffers == ((0, S),)``)."""
    import torch

    m, S = plan.world_size, plan.shard_size
    if single:
        assert plan.buffers == ((0, S),)
    assert S >= 1 and S % plan.align == 0 and S == sum(s for _, s in plan.buffers)
    assert plan.buffer_numel == m * S
    pos = 0
    for offset, size in plan.buffers:  # buffers tile the global buffer in order
        assert offset == pos and size >= 1 and size % plan.align == 0
        pos += m * size
    leaves = list(plan.leaves)
    assert [l.offset for l in leaves] == sorted(l.offset for l in leaves)
    # each leaf contiguous, inside one buffer, disjoint from the next (padding only between leaves / at the end)
    for a, b in zip(leaves, leaves[1:]):
        assert a.stop <= b.offset, (a.path, b.path)
    for leaf in leaves:
        offset, size = plan.buffers[plan.buffer_index(leaf.offset)]
        assert offset <= leaf.offset and leaf.stop <= offset + m * size, "a leaf lies inside one buffer"
        assert leaf.offset % plan.align == 0
        assert leaf.numel == math.prod(leaf.shape)
        if plan.strategy != "naive":  # granules never cross a rank boundary of their buffer
            for k in range(1, m):
                cut = offset + k * size
                if leaf.offset < cut < leaf.stop:
                    assert (cut - leaf.offset) % leaf.granule == 0, (leaf.path, k)
    # all ranks hold S elements; local pieces tile every leaf exactly once, in order
    covered = {leaf.path: 0 for leaf in leaves}
    for r in range(m):
        ranges = plan.shard_ranges(r)
        assert [x.local_offset for x in ranges] == [sum(s for _, s in plan.buffers[:b]) for b in range(len(ranges))]
        pieces = plan.local_pieces(r)
        assert sum(p.numel for p in pieces) <= S
        for p in pieces:
            assert 0 <= p.local_offset and p.local_offset + p.numel <= S
            assert p.start == covered[p.leaf.path]
            covered[p.leaf.path] = p.stop
            assert math.prod(p.shape) == p.numel
            assert plan.locate(p.leaf.offset + p.start) == (r, p.local_offset)
            assert plan.global_position(r, p.local_offset) == p.leaf.offset + p.start
    assert covered == {leaf.path: leaf.numel for leaf in leaves}
    assert plan.occupancy() == tuple(sum(p.numel for p in plan.local_pieces(r)) for r in range(m))
    assert plan.padding == m * S - plan.numel >= 0
    positions = torch.arange(plan.buffer_numel)
    ranks, local = plan.locate(positions)
    assert torch.equal(plan.global_position(0, local[ranks == 0]), positions[ranks == 0])
    assert torch.equal(torch.bincount(ranks, minlength=m), torch.full((m,), S))
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


