"""Properties of every plan (hypothesis, "ci" profile from tests/conftest.py).

The brute force here is independent of the planner: it enumerates every aligned offset of
every tensor (memoised on (tensor, previous end)), with no greedy argument.
"""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ragged as rg
from ragged import spec
from ragged.spec import _search
from ragged.testing import strategies as rst


from tests.properties._cases import brute_min_shard_size, check_invariants

tiny_instances = st.integers(1, 4).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 12), min_size=n, max_size=n),
        st.lists(st.integers(1, 6), min_size=n, max_size=n),
        st.sampled_from([1, 2, 4]),
        st.integers(1, 4),
    )
)


def tiny_params(sizes, granules):
    # keys sort in index order (t0 < t1 < ...), so tree order is the given order
    params = {f"t{i}": torch.empty(e, device="meta") for i, e in enumerate(sizes)}
    specs = {f"t{i}": spec.Elements(g) for i, g in enumerate(granules)}
    return params, specs


def reverse_insertion(tree):
    if isinstance(tree, dict):
        return {k: reverse_insertion(tree[k]) for k in reversed(list(tree))}
    if isinstance(tree, list):
        return [reverse_insertion(v) for v in tree]
    return tree


# ---- invariants --------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["dp", "exact", "naive"])
@given(inputs=rst.plan_inputs(replicate=True), align=st.sampled_from([None, 1, 3, 8]))
def test_every_plan_keeps_the_invariants(strategy, inputs, align):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m, strategy=strategy, align=align)
    check_invariants(plan, params)


@given(inputs=rst.plan_inputs())
def test_plans_are_deterministic_hashable_and_dict_order_free(inputs):
    params, specs, m = inputs
    a = rg.make_plan(params, specs, world_size=m)
    b = rg.make_plan(reverse_insertion(params), reverse_insertion(specs), world_size=m)
    c = rg.make_plan(params, specs, world_size=m)
    assert a == b == c and hash(a) == hash(b) and a.fingerprint() == b.fingerprint()


# ---- optimality --------------------------------------------------------------------------
@given(tiny_instances)
def test_exact_equals_brute_force(instance):
    sizes, granules, align, m = instance
    expected = brute_min_shard_size(sizes, granules, align, m)
    assert _search.min_shard_size(sizes, granules, align, m) == expected
    params, specs = tiny_params(sizes, granules)
    plan = rg.make_plan(params, specs, world_size=m, align=align, strategy="exact")
    assert plan.shard_size == expected
    assert [leaf.path for leaf in plan.leaves] == [f"['t{i}']" for i in range(len(sizes))]
    check_invariants(plan, params)


@given(tiny_instances)
def test_dp_between_free_order_optimum_and_exact(instance):
    sizes, granules, align, m = instance
    params, specs = tiny_params(sizes, granules)
    dp = rg.make_plan(params, specs, world_size=m, align=align, strategy="dp")
    exact = rg.make_plan(params, specs, world_size=m, align=align, strategy="exact")
    free = min(
        brute_min_shard_size([sizes[i] for i in perm], [granules[i] for i in perm], align, m)
        for perm in itertools.permutations(range(len(sizes)))
    )
    lower = max(-(-sum(sizes) // m), max((e for e, g in zip(sizes, granules) if e <= g), default=0), 1)
    assert lower <= free <= dp.shard_size <= exact.shard_size


@given(inputs=rst.plan_inputs())
def test_dp_never_worse_than_exact_tree_order(inputs):
    params, specs, m = inputs
    dp = rg.make_plan(params, specs, world_size=m, strategy="dp")
    exact = rg.make_plan(params, specs, world_size=m, strategy="exact")
    naive = rg.make_plan(params, specs, world_size=m, strategy="naive")
    assert dp.shard_size <= exact.shard_size
    lower = -(-dp.numel // m)
    assert dp.shard_size >= lower
    if naive.split_blocks == 0:  # a naive layout that happens to be valid bounds the exact one
        assert exact.shard_size <= naive.shard_size


@given(tiny_instances)
def test_scalar_and_vectorised_greedy_agree(instance):
    sizes, granules, align, m = instance
    prefix = [0]
    for e in sizes:
        prefix.append(prefix[-1] + -(-e // align) * align)
    suffix = [sum(sizes[k:]) for k in range(len(sizes) + 1)]
    candidates = list(range(align, 40 * align, align))
    vec = _search.greedy_ends(sizes, granules, align, candidates)
    for S, v in zip(candidates, vec):
        s = _search.greedy_end_scalar(sizes, granules, align, S, None, prefix, suffix)
        assert (s is None and v >= _search._INFEASIBLE) or s == v


# ---- naive -------------------------------------------------------------------------------
@given(inputs=rst.plan_inputs(), align=st.sampled_from([1, 4]))
def test_naive_is_concatenation_and_counts_split_blocks(inputs, align):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m, strategy="naive", align=align)
    p = 0
    for leaf in plan.leaves:  # tree order, each start aligned, no other gaps
        assert leaf.offset == -(-p // align) * align
        p = leaf.stop
    S = plan.shard_size
    assert m * S >= p and (S == align or m * (S - align) < max(p, -(-plan.numel // m) * m))
    split = sum(
        1
        for leaf in plan.leaves
        for k in range(1, m)
        if leaf.offset < k * S < leaf.stop and (k * S - leaf.offset) % leaf.granule
    )
    assert plan.split_blocks == split


def test_naive_splits_what_dp_keeps_whole():
    params = {"a": torch.empty(3, 4, device="meta"), "b": torch.empty(5, 4, device="meta")}
    naive = rg.make_plan(params, spec.Rows(2), world_size=3, align=1, strategy="naive")
    dp = rg.make_plan(params, spec.Rows(2), world_size=3, align=1)
    assert naive.split_blocks > 0 and dp.split_blocks == 0
    check_invariants(dp, params)


medium_instances = st.integers(1, 6).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 3000), min_size=n, max_size=n),
        st.lists(st.sampled_from([1, 2, 3, 7, 16, 64, 100, 384, 1000]), min_size=n, max_size=n),
        st.sampled_from([1, 2, 8]),
        st.integers(1, 32),
    )
)


@given(medium_instances)
def test_candidate_filter_never_skips_a_feasible_shard_size(instance):
    """min_shard_size only tries multiples of the forced lcm per interval; a plain scan of
    every aligned S with the greedy must find the same first feasible S."""
    import numpy as np

    sizes, granules, align, m = instance
    got = _search.min_shard_size(sizes, granules, align, m)
    lo = max(-(-sum(sizes) // m), max((e for e, g in zip(sizes, granules) if e <= g), default=0), 1)
    lo = -(-lo // align) * align
    S = np.arange(lo, got + align, align, dtype=np.int64)
    ends = _search.greedy_ends(sizes, granules, align, S)
    feasible = S[ends <= S * m]
    assert feasible.size and int(feasible[0]) == got


@given(inputs=rst.plan_inputs())
def test_occupancy_matches_local_pieces(inputs):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m)
    assert plan.occupancy() == tuple(sum(p.numel for p in plan.local_pieces(r)) for r in range(m))


@given(tiny_instances)
def test_order_free_lower_bound_is_below_every_order(instance):
    sizes, granules, align, m = instance
    lb = _search.order_free_lower_bound(sizes, granules, align, m)
    free = min(
        brute_min_shard_size([sizes[i] for i in perm], [granules[i] for i in perm], align, m)
        for perm in itertools.permutations(range(len(sizes)))
    )
    assert lb <= free
