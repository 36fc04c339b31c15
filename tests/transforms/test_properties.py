"""Property tests of the transforms on the simulated backend (hypothesis, "ci" profile)."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import ragged as rg
from ragged.testing import strategies as rst

_trees = rst.param_trees(dtype=torch.float64, device="cpu", max_leaves=5)
_inputs = rst.plan_inputs(params=_trees, world_sizes=rst.world_sizes(min_value=1, max_value=4), replicate=True)


def _padding_zero(d):
    mask = torch.ones(d.plan.shard_size, dtype=torch.bool)
    for p in d.plan.local_pieces(d.rank):
        mask[p.local_offset : p.local_offset + p.numel] = False
    return bool((d.data[mask] == 0).all())


@settings(max_examples=30)
@given(_inputs, st.sampled_from(["dp", "naive"]))
def test_gather_of_shard_is_identity_and_padding_zero(inputs, strategy):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m, strategy=strategy)

    def fn(c):
        d = rg.shard(plan, params, c)
        return _padding_zero(d), rg.gather(d, c)

    for zero, full in rg.collectives.simulate(m, fn):
        assert zero
        rg.testing.assert_trees_all_close(full, params, rtol=0, atol=0)


@settings(max_examples=30)
@given(_inputs, st.sampled_from(["sum", "mean"]), st.integers(0, 2**20))
def test_reduce_scatter_is_shard_of_reduction(inputs, op, seed):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m)
    g = torch.Generator().manual_seed(seed)
    grads = [rg.pytree.map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), params) for _ in range(m)]
    ref = rg.pytree.map(lambda *xs: sum(xs) / (m if op == "mean" else 1), *grads)

    def fn(c):
        got = rg.reduce_scatter(plan, grads[c.rank], c, op=op)
        return got, rg.shard(plan, ref, c)

    for got, want in rg.collectives.simulate(m, fn):
        torch.testing.assert_close(got.data, want.data)
        torch.testing.assert_close(got.replicated, want.replicated)
        assert _padding_zero(got)


@settings(max_examples=30)
@given(_trees, st.data())
def test_redistribute_round_trips(params, data):
    m = data.draw(rst.world_sizes(min_value=1, max_value=4), label="m")
    specs_a = data.draw(rst.spec_trees(params), label="specs_a")
    specs_b = data.draw(rst.spec_trees(params), label="specs_b")
    m_b = data.draw(st.integers(1, m), label="m_b")
    a = rg.make_plan(params, specs_a, world_size=m)
    b = rg.make_plan(params, specs_b, world_size=m_b)
    targets = [b, rg.owned_plan(a)]

    def fn(c):
        d = rg.shard(a, params, c)
        ok = []
        for t in targets:
            e = rg.redistribute(d, t, c)
            if c.rank < t.world_size:
                ok.append(torch.equal(e.data, rg.shard(t, params, rank=c.rank).data))
            ok.append(torch.equal(rg.redistribute(e, a, c).data, d.data))
        return ok

    for ok in rg.collectives.simulate(m, fn):
        assert all(ok), ok
