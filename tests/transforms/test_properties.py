"""Property tests of the transforms on the simulated backend (hypothesis, "ci" profile)."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import ragged as rg
from ragged.testing import strategies as rst

_trees = rst.param_trees(dtype=torch.float64, device="cpu", max_leaves=5)
_inputs = rst.plan_inputs(params=_trees, world_sizes=rst.world_sizes(min_value=1, max_value=4), replicate=True)
_buffers = st.sampled_from([1, 2, 3, "auto"])
# half of the draws have several row lengths, so that multi-buffer plans use several buffers
_mixed = st.one_of(_inputs, rst.multi_buffer_inputs())


def _padding_zero(d):
    mask = torch.ones(d.plan.shard_size, dtype=torch.bool)
    for p in d.plan.local_pieces(d.rank):
        mask[p.local_offset : p.local_offset + p.numel] = False
    return bool((d.data[mask] == 0).all())


@settings(max_examples=30)
@given(_mixed, st.sampled_from([("dp", 1), ("naive", 1), ("dp", 2), ("dp", "auto"), ("exact", 3)]))
def test_gather_of_shard_is_identity_and_padding_zero(inputs, options):
    params, specs, m = inputs
    strategy, max_buffers = options
    plan = rg.make_plan(params, specs, world_size=m, strategy=strategy, max_buffers=max_buffers,
                        align=1 if max_buffers != 1 else None)

    def fn(c):
        d = rg.shard(plan, params, c)
        return _padding_zero(d), rg.gather(d, c)

    for zero, full in rg.collectives.simulate(m, fn):
        assert zero
        rg.testing.assert_trees_all_close(full, params, rtol=0, atol=0)


@settings(max_examples=30)
@given(_mixed, st.sampled_from(["sum", "mean"]), st.integers(0, 2**20), _buffers, st.sampled_from([None, 1]))
def test_reduce_scatter_is_shard_of_reduction(inputs, op, seed, max_buffers, align):
    params, specs, m = inputs
    plan = rg.make_plan(params, specs, world_size=m, max_buffers=max_buffers, align=align)
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
@given(st.one_of(_trees, rst.multi_buffer_inputs().map(lambda x: x[0])), st.data())
def test_redistribute_round_trips(params, data):
    m = data.draw(rst.world_sizes(min_value=1, max_value=5), label="m")
    specs_a = data.draw(rst.spec_trees(params), label="specs_a")
    specs_b = data.draw(rst.spec_trees(params), label="specs_b")
    m_b = data.draw(st.integers(1, m), label="m_b")
    a = rg.make_plan(params, specs_a, world_size=m, align=1, max_buffers=data.draw(_buffers, label="buffers_a"))
    b = rg.make_plan(params, specs_b, world_size=m_b, align=1, max_buffers=data.draw(_buffers, label="buffers_b"))
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


@settings(max_examples=30)
@given(_mixed, _buffers, st.integers(0, 2**20))
def test_multi_buffer_collectives_equal_single_buffer(inputs, max_buffers, seed):
    """Any multi-buffer plan's gather, flat-gradient reduce_scatter, gather's backward and norm
    equal the single-buffer plan's, element for element (exact in float64)."""
    params, specs, m = inputs
    one = rg.make_plan(params, specs, world_size=m)
    many = rg.make_plan(params, specs, world_size=m, max_buffers=max_buffers, align=1)
    g = torch.Generator().manual_seed(seed)
    grads = [rg.pytree.map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), params) for _ in range(m)]

    def fn(c):
        out = []
        for plan in (one, many):
            d = rg.shard(plan, params, c)
            full = rg.gather(d, c)
            # flat reduce-scatter: the gradient of gather's buffer, laid out by the plan
            flat = torch.zeros(plan.buffer_numel, dtype=torch.float64)
            for leaf in plan.leaves:
                flat[leaf.offset : leaf.stop] = rg.pytree.leaves(grads[c.rank])[leaf.index].reshape(-1)
            rep = torch.zeros(d.replicated.numel(), dtype=torch.float64)
            for leaf in plan.replicated:
                rep[leaf.offset : leaf.stop] = rg.pytree.leaves(grads[c.rank])[leaf.index].reshape(-1)
            reduced = rg.reduce_scatter(plan, flat, c, op="sum", replicated=rep if plan.replicated else None)
            # backward of gather: sum of leaf gradients, reduce-scattered
            x = d.data.clone().requires_grad_()
            leaves = rg.pytree.leaves(rg.gather(d.replace(data=x), c))
            loss = sum(((l * w).sum() for l, w in zip(leaves, rg.pytree.leaves(grads[c.rank])) if l.requires_grad),
                       x.sum() * 0)
            back = torch.autograd.grad(loss, x)[0]
            back_tree = rg.gather(d.replace(data=back), c)
            out.append((full, rg.gather(reduced, c), back_tree, float(d.global_norm(c))))
        return out

    for (f1, r1, b1, n1), (f2, r2, b2, n2) in rg.collectives.simulate(m, fn):
        rg.testing.assert_trees_all_close(f1, f2, rtol=0, atol=0)
        rg.testing.assert_trees_all_close(r1, r2, rtol=0, atol=0)
        rg.testing.assert_trees_all_close(b1, b2, rtol=0, atol=0)
        assert n1 == pytest.approx(n2, rel=1e-12)


def test_hsdp_reduce_scatter_on_a_multi_buffer_plan():
    """2 replicas x 2 shards: the reduce-scatter of every buffer, then the all-reduce across
    replicas, gives each rank its ranges of the mean over all 4 ranks."""
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(8, 3, generator=g, dtype=torch.float64), "b": torch.randn(4, 5, generator=g, dtype=torch.float64)}
    plan = rg.make_plan(params, world_size=2, align=1, max_buffers=2)
    assert plan.num_buffers == 2
    grads = [rg.pytree.map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), params) for _ in range(4)]
    mean = rg.pytree.map(lambda *xs: sum(xs) / 4, *grads)

    def fn(c):
        index = c.replica_rank * c.world_size + c.rank
        got = rg.reduce_scatter(plan, grads[index], c, op="mean")
        return torch.allclose(got.data, rg.shard(plan, mean, rank=c.rank).data, rtol=1e-12, atol=1e-14)

    assert rg.collectives.simulate(4, fn, mesh_shape=(2, 2)) == [True] * 4
