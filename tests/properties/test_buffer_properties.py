"""Properties of multi-buffer plans (``make_plan(max_buffers=...)``), hypothesis "ci" profile.

Invariants per buffer on random trees, specs, world sizes and buffer counts; the padding
guarantee against the three baselines; per-buffer exactness and the partition against brute
force on tiny instances; soundness of the search's order-free filters.
"""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged as rg
from ragged import spec
from ragged.spec import _search
from ragged.testing import strategies as rst
from tests.properties._cases import brute_feasible, brute_min_shard_size, check_invariants

BUFFER_COUNTS = st.sampled_from([1, 2, 3, "auto"])


def baselines(params, specs, m, max_buffers, **options):
    """Padding of one buffer (dp), one buffer per granule, one per leaf (when within the budget),
    for a flat dict of params (sub-dicts then keep the tree order)."""
    one = rg.make_plan(params, specs, world_size=m, **options)
    K = 8 if max_buffers == "auto" else max_buffers
    out = {"one": one.padding}
    key = {f"[{k!r}]": k for k in params}
    spec_of = {key[l.path]: l.granularity for l in one.leaves}
    groups: dict[int, list[str]] = {}
    for leaf in one.leaves:
        groups.setdefault(leaf.granule, []).append(key[leaf.path])

    def padding(keys):
        return rg.make_plan({k: params[k] for k in keys}, {k: spec_of[k] for k in keys}, world_size=m, **options).padding

    if 1 < len(groups) <= K:
        out["granule"] = sum(padding(ks) for ks in groups.values())
    if 1 < len(one.leaves) <= K:
        out["leaf"] = sum(padding([k]) for k in spec_of)
    return out


_flat_trees = rst.param_trees(max_leaves=7, nested=False)


@settings(max_examples=40)
@given(st.one_of(rst.plan_inputs(params=rst.param_trees(max_leaves=7), replicate=True), rst.multi_buffer_inputs(device="meta")),
       BUFFER_COUNTS,
       st.sampled_from(["dp", "exact"]), st.sampled_from([None, 1, 3]))
def test_every_multi_buffer_plan_keeps_the_invariants(inputs, max_buffers, strategy, align):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m, strategy=strategy, align=align, max_buffers=max_buffers)
    check_invariants(plan, params, single=False)
    assert plan.num_buffers <= (8 if max_buffers == "auto" else max_buffers)
    if max_buffers == 1:
        assert plan == rg.make_plan(params, specs, world_size=m, strategy=strategy, align=align)


@settings(max_examples=40)
@given(st.one_of(rst.plan_inputs(params=_flat_trees), rst.multi_buffer_inputs(device="meta", max_leaves=7)),
       BUFFER_COUNTS, st.sampled_from(["dp", "exact"]), st.sampled_from([None, 1, 3]))
def test_padding_never_above_the_baselines(inputs, max_buffers, strategy, align):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m, strategy=strategy, align=align, max_buffers=max_buffers)
    for name, pad in baselines(params, specs, m, max_buffers, strategy=strategy, align=align).items():
        assert plan.padding <= pad, (name, plan.padding, pad, plan.buffers)


@given(rst.plan_inputs(), BUFFER_COUNTS)
def test_multi_buffer_plans_are_deterministic_and_dict_order_free(inputs, max_buffers):
    params, specs, m = inputs
    rev = lambda t: {k: rev(t[k]) for k in reversed(list(t))} if isinstance(t, dict) else t  # noqa: E731
    a = rg.make_plan(params, specs, world_size=m, max_buffers=max_buffers)
    b = rg.make_plan(rev(params), rev(specs), world_size=m, max_buffers=max_buffers)
    assert a == b and hash(a) == hash(b) and a.fingerprint() == b.fingerprint()


tiny = st.integers(2, 4).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(1, 12), min_size=n, max_size=n),
        st.lists(st.integers(1, 6), min_size=n, max_size=n),
        st.sampled_from([1, 2]),
        st.integers(2, 4),
        st.integers(2, 3),
    )
)


def _partitions(items, k):
    """Every partition of ``items`` into at most ``k`` non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest, k):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1 :]
        if len(part) < k:
            yield [[first]] + part


@settings(max_examples=25)
@given(tiny)
def test_exact_buffers_equal_brute_force_and_partition_bounds(instance):
    """strategy="exact": each buffer's S_b is the brute-force optimum of its leaves in tree order
    (a fixed partition and order); the whole plan pads no less than the brute-force optimum over
    every partition into at most K buffers and every order."""
    sizes, granules, align, m, K = instance
    params = {f"t{i}": torch.empty(e, device="meta") for i, e in enumerate(sizes)}
    specs = {f"t{i}": spec.Elements(g) for i, g in enumerate(granules)}
    plan = rg.make_plan(params, specs, world_size=m, align=align, strategy="exact", max_buffers=K)
    index = {f"['t{i}']": i for i in range(len(sizes))}
    for b, (offset, size) in enumerate(plan.buffers):
        members = [index[l.path] for l in plan.leaves if plan.buffer_index(l.offset) == b]
        assert members == sorted(members), "exact keeps tree order inside a buffer"
        assert size == brute_min_shard_size([sizes[i] for i in members], [granules[i] for i in members], align, m)
    best = min(
        sum(min(brute_min_shard_size([sizes[i] for i in perm], [granules[i] for i in perm], align, m)
                for perm in itertools.permutations(block)) for block in part)
        for part in _partitions(list(range(len(sizes))), K)
    )
    assert plan.shard_size >= best
    check_invariants(plan, params, single=False)


experts = st.tuples(
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from([1, 3, 8, 16, 48])), min_size=1, max_size=3),
    st.lists(st.integers(1, 12), min_size=1, max_size=3),
    st.sampled_from([1, 2, 8]),
    st.integers(1, 24),
)


@settings(max_examples=60)
@given(experts, st.randoms(use_true_random=False))
def test_order_free_filters_never_reject_a_feasible_shard_size(instance, rnd):
    """Repeated kinds (expert stacks) make both filters bite; every S at which the greedy finds a
    placement, in any order, must be accepted."""
    kinds, counts, align, m = instance
    sizes, granules = [], []
    for (rows, g), c in zip(kinds, counts):
        sizes += [rows * g] * c
        granules += [g] * c
    order = list(range(len(sizes)))
    rnd.shuffle(order)
    sizes, granules = [sizes[i] for i in order], [granules[i] for i in order]
    S = np.arange(align, (sum(sizes) // m + max(sizes) + 2 * max(granules) + align) * 2, align, dtype=np.int64)
    feasible = _search.greedy_ends(sizes, granules, align, S) <= S * m
    counted = {}
    for e, g in zip(sizes, granules):
        counted[(e, g)] = counted.get((e, g), 0) + 1
    check = _search.OrderFree(tuple((e, g, c) for (e, g), c in counted.items()), align, m, 0)
    assert not (feasible & ~check.accepts(S)).any()
    lb = _search.order_free_lower_bound(sizes, granules, align, m)
    assert not feasible[S < lb].any()


@settings(max_examples=20)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=3), st.integers(1, 4), st.sampled_from([1, 2]),
       st.integers(2, 3))
def test_order_free_filters_agree_with_brute_force(rows, g, align, m):
    sizes, granules = [r * g for r in rows], [g] * len(rows)
    counted = {}
    for e in sizes:
        counted[(e, g)] = counted.get((e, g), 0) + 1
    check = _search.OrderFree(tuple((e, gg, c) for (e, gg), c in counted.items()), align, m, 0)
    for S in range(align, sum(sizes) + 2 * align, align):
        if any(brute_feasible([sizes[i] for i in p], granules, align, m, S) for p in itertools.permutations(range(len(sizes)))):
            assert check.accepts(np.array([S]))[0], S


@pytest.mark.parametrize("max_buffers", [1, 2, "auto"])
def test_max_buffers_one_is_todays_plan(max_buffers):
    params = {"a": torch.empty(8, 3, device="meta"), "b": torch.empty(4, 5, device="meta")}
    plan = rg.make_plan(params, world_size=2, align=1, max_buffers=max_buffers)
    if max_buffers == 1:
        assert plan.buffers == ((0, 23),) and plan.padding == 2
    else:
        assert plan.buffers == ((0, 12), (24, 10)) and plan.padding == 0
