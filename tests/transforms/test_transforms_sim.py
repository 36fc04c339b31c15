"""Transforms on the simulated backend against unsharded float64 references."""

import re

import pytest
import torch

import ragged as rg
from ragged import spec
from tests._cuda_division import cuda_division


def _params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(7, 6, generator=g, dtype=dtype),
        "layers": [
            {"w": torch.randn(5, 6, generator=g, dtype=dtype), "b": torch.randn(5, generator=g, dtype=dtype)},
            {"w": torch.randn(3, 5, generator=g, dtype=dtype), "b": torch.randn(3, generator=g, dtype=dtype)},
        ],
        "scale": torch.randn((), generator=g, dtype=dtype),
    }


def _same(a, b, **kw):
    la, lb = rg.pytree.leaves(a), rg.pytree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **kw)


@pytest.mark.parametrize("m", [1, 2, 3, 4], ids=lambda m: f"m{m}")
def test_gather_of_shard_is_identity(m):
    params = _params()
    plan = rg.make_plan(params, world_size=m)
    out = rg.collectives.simulate(m, lambda c: rg.gather(rg.shard(plan, params, c), c))
    for full in out:
        _same(full, params, rtol=0, atol=0)


@pytest.mark.parametrize("m", [2, 3], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter_is_shard_of_sum(m, op):
    """The rank-order sum, divided by m for the mean, exactly: correctly rounded also under CUDA's
    division by a host scalar (emulated; see [Note: a division every device rounds alike] in
    ragged/_divide.py)."""
    params = _params()
    plan = rg.make_plan(params, world_size=m)
    grads = [_params(seed=10 + r) for r in range(m)]
    ref = rg.pytree.map(lambda *xs: sum(xs) / (m if op == "mean" else 1), *grads)

    def fn(c):
        with cuda_division():
            got = rg.reduce_scatter(plan, grads[c.rank], c, op=op)
        return got, rg.shard(plan, ref, c)

    for got, want in rg.collectives.simulate(m, fn):
        assert torch.equal(got.data, want.data) and torch.equal(got.replicated, want.replicated)


def test_leaves_are_views_of_one_buffer():
    params = _params()
    plan = rg.make_plan(params, world_size=2)

    def fn(c):
        d = rg.shard(plan, params, c)
        local_ok = all(
            v.untyped_storage().data_ptr() == d.data.untyped_storage().data_ptr() for v in rg.pytree.leaves(d.views())
        )
        pending = rg.gather_start(d, c)
        full = rg.gather_wait(pending)
        ptr = pending.buffer.untyped_storage().data_ptr()
        return local_ok and all(t.untyped_storage().data_ptr() == ptr for t in rg.pytree.leaves(full))

    assert rg.collectives.simulate(2, fn) == [True, True]


def test_gather_backward_is_reduce_scatter():
    params = _params()
    plan = rg.make_plan(params, world_size=2)
    targets = [_params(seed=20 + r) for r in range(2)]

    def loss(full, t):
        return sum(((a - b) ** 2).sum() for a, b in zip(rg.pytree.leaves(full), rg.pytree.leaves(t)))

    def fn(c):
        d = rg.shard(plan, params, c)
        data = d.data.clone().requires_grad_()
        loss(rg.gather(d.replace(data=data), c), targets[c.rank]).backward()
        g1 = data.grad
        g2 = torch.func.grad(lambda x: loss(rg.gather(d.replace(data=x), c), targets[c.rank]))(d.data)
        return g1, g2

    ref = rg.pytree.map(lambda p, a, b: 2 * (p - a) + 2 * (p - b), params, *targets)
    out = rg.collectives.simulate(2, fn)
    for r, (g1, g2) in enumerate(out):
        want = rg.shard(plan, ref, rank=r).data
        torch.testing.assert_close(g1, want)
        torch.testing.assert_close(g2, want)


def test_plan_mismatch_raises_on_every_rank():
    p0 = rg.make_plan(_params(), world_size=2)
    other = _params()
    other["emb"] = torch.randn(9, 6, dtype=torch.float64)
    p1 = rg.make_plan(other, world_size=2)

    def fn(c):
        plan, params = (p0, _params()) if c.rank == 0 else (p1, other)
        with pytest.raises(rg.PlanMismatchError, match=re.escape("['emb']")):
            rg.shard(plan, params, c)
        return True

    assert rg.collectives.simulate(2, fn) == [True, True]


def test_rank_switching_to_a_new_plan_after_a_checked_one_is_caught():
    """Both ranks use plan p0 (agreed), then rank 1 alone moves to p1: caught at that call, on
    every rank, before the gather (the every-call check; see [Note: plan check before collectives])."""
    p0 = rg.make_plan(_params(), world_size=2)
    other = _params()
    other["emb"] = torch.randn(9, 6, dtype=torch.float64)
    p1 = rg.make_plan(other, world_size=2)

    def fn(c):
        d0 = rg.shard(p0, _params(), c)
        rg.gather(d0, c)
        d = d0 if c.rank == 0 else rg.shard(p1, other, rank=1)
        with pytest.raises(rg.PlanMismatchError, match=re.escape("leaf ['emb']: shape (7, 6) vs (9, 6)")) as e:
            rg.gather(d, c)
        return str(e.value)

    msgs = rg.collectives.simulate(2, fn)
    assert msgs[0] == msgs[1] and "ranks [0] vs ranks [1]" in msgs[0]


@pytest.mark.parametrize("case", ["operation", "dtype"])
def test_ranks_calling_different_transforms_are_caught(case):
    plan = rg.make_plan(_params(), world_size=2)

    def fn(c):
        d = rg.shard(plan, _params(), c)
        with pytest.raises(rg.PlanMismatchError) as e:
            if case == "operation" and c.rank == 1:
                rg.reduce_scatter(plan, _params(), c, op="sum")
            else:
                rg.gather(d, c, dtype=torch.float32 if case == "dtype" and c.rank == 1 else None)
        return str(e.value)

    msgs = rg.collectives.simulate(2, fn)
    want = {"operation": "the operation: gather:torch.float64 vs reduce_scatter:sum:torch.float64",
            "dtype": "the operation: gather:torch.float64 vs gather:torch.float32"}[case]
    assert all(want in m for m in msgs), msgs


def test_plan_check_every_call_vs_first_use_collective_count():
    """every_call: one small all-reduce per transform call; first_use: one per plan."""
    plan = rg.make_plan(_params(), world_size=2)

    def fn(c, mode):
        c.plan_check = mode
        calls = []
        inner = c.all_reduce
        c.all_reduce = lambda t, **kw: (calls.append(t.dtype), inner(t, **kw))[1]
        d = rg.shard(plan, _params(), c)
        for _ in range(3):
            rg.gather(d, c)
        return calls.count(torch.int64)

    assert rg.collectives.simulate(2, fn, "every_call") == [4, 4]
    assert rg.collectives.simulate(2, fn, "first_use") == [1, 1]


def test_grads_shape_error_names_key_path():
    params = _params()
    plan = rg.make_plan(params, world_size=2)
    bad = _params()
    bad["layers"][1]["w"] = torch.randn(3, 4, dtype=torch.float64)

    def fn(c):
        rg.reduce_scatter(plan, bad, c)

    with pytest.raises(rg.LayoutError, match=re.escape("grads['layers'][1]['w'] has shape (3, 4)")):
        rg.collectives.simulate(2, fn, timeout=5)


@pytest.mark.parametrize("m", [2, 4])
def test_redistribute_round_trip(m):
    params = _params()
    rows = rg.make_plan(params, world_size=m)
    elems = rg.make_plan(params, spec.Elements(1), world_size=m)
    small = rg.make_plan(params, world_size=m - 1)
    owned = rg.owned_plan(rows)

    def fn(c):
        d = rg.shard(plan := rows, params, c)
        outs = []
        for target in (elems, small, owned):
            e = rg.redistribute(d, target, c)
            if c.rank < target.world_size:
                outs.append(torch.equal(e.data, rg.shard(target, params, rank=c.rank).data))
            back = rg.redistribute(e, plan, c)
            outs.append(torch.equal(back.data, d.data))
        return outs

    for res in rg.collectives.simulate(m, fn):
        assert all(res), res


def test_out_buffers_are_used_and_checked():
    params = _params()
    plan = rg.make_plan(params, world_size=2)
    grads = [_params(seed=30 + r) for r in range(2)]

    def fn(c):
        d = rg.shard(plan, params, c)
        buf = torch.full((plan.buffer_numel,), float("nan"), dtype=torch.float64)
        full = rg.gather(d, c, out=buf)
        same = all(t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for t in rg.pytree.leaves(full))
        out = torch.empty(plan.shard_size, dtype=torch.float64)
        g = rg.reduce_scatter(plan, grads[c.rank], c, op="sum", out=out)
        want = rg.shard(plan, rg.pytree.map(torch.add, *grads), c)
        with pytest.raises(ValueError, match="out= must be a contiguous 1-D tensor"):
            rg.gather(d, c, out=buf[:-1])  # last: a refused call poisons the comm
        return same, full, g.data.data_ptr() == out.data_ptr(), g, want

    for same, full, used, g, want in rg.collectives.simulate(2, fn):
        assert same and used
        _same(full, params, rtol=0, atol=0)
        torch.testing.assert_close(g.data, want.data)


def test_flat_gradient_padding_is_zeroed():
    params = {"a": torch.randn(3, dtype=torch.float64), "b": torch.randn(5, 2, dtype=torch.float64)}
    plan = rg.make_plan(params, world_size=3, align=4)
    assert plan.padding > 0

    def fn(c):
        g = torch.randn(plan.buffer_numel, dtype=torch.float64, generator=torch.Generator().manual_seed(c.rank))
        return rg.reduce_scatter(plan, g, c, op="sum")

    for d in rg.collectives.simulate(3, fn):
        views = torch.cat([v.reshape(-1) for v in rg.pytree.leaves(d.views())])
        assert torch.count_nonzero(d.data) == torch.count_nonzero(views) == views.numel()


def test_dbuffer_group_ops_match_per_leaf_reference():
    params = _params()
    other = _params(seed=5)
    plan = rg.make_plan(params, world_size=3)

    def fn(c):
        a, b = rg.shard(plan, params, c), rg.shard(plan, other, c)
        z = a.zeros_like()
        s = a.scale(0.5).add(b, alpha=-2.0)
        return bool((z.data == 0).all()), rg.gather(s, c), float(a.global_norm(c)), a.cast(torch.float32).data.dtype

    ref = rg.pytree.map(lambda x, y: 0.5 * x - 2.0 * y, params, other)
    norm = float(torch.sqrt(sum((t * t).sum() for t in rg.pytree.leaves(params))))
    for zero, full, n, dt in rg.collectives.simulate(3, fn):
        assert zero and dt == torch.float32
        _same(full, ref)
        assert abs(n - norm) < 1e-9 * norm


def test_leaf_positions_are_made_on_the_buffer_s_device():
    """all_reduce_leaves, freeze_unused and the weighted norm index a buffer with positions made
    on its device (``meta`` here: one ``arange`` per run), not copied there from the host (on a
    GPU a copy from pageable memory waits for the stream)."""
    from ragged._dbuffer import leaf_positions

    params = _params()
    plan = rg.make_plan(params, {"emb": spec.Rows(1), "layers": None, "scale": spec.Replicate()}, world_size=3)
    picked = frozenset(leaf.index for leaf in plan.leaves[::2] + plan.replicated)
    for rank in range(3):
        data, rep = leaf_positions(plan, rank, picked, "meta")
        assert data.device.type == rep.device.type == "meta" and data.dtype == torch.int64
        host = leaf_positions(plan, rank, picked)
        assert host[0].tolist() == [i for p in plan.local_pieces(rank) if p.leaf.index in picked
                                    for i in range(p.local_offset, p.local_offset + p.numel)]
        assert host[1].tolist() == [i for leaf in plan.replicated for i in range(leaf.offset, leaf.stop)] == [0]


def test_hsdp_reduce_scatter_means_over_all_ranks_and_gathers_within_shard_group():
    params = _params()
    plan = rg.make_plan(params, world_size=2)
    grads = [_params(seed=40 + g) for g in range(4)]
    ref = rg.pytree.map(lambda *xs: sum(xs) / 4, *grads)

    def fn(c):
        g = c.replica_rank * c.world_size + c.rank
        d = rg.shard(plan, params, c)
        return rg.gather(d, c), rg.reduce_scatter(plan, grads[g], c, op="mean"), rg.shard(plan, ref, c)

    for full, got, want in rg.collectives.simulate(4, fn, mesh_shape=(2, 2)):
        _same(full, params, rtol=0, atol=0)
        torch.testing.assert_close(got.data, want.data)
        torch.testing.assert_close(got.replicated, want.replicated)


def test_bad_inputs_raise_clear_errors_before_communication():
    params = _params()
    plan = rg.make_plan(params, world_size=2)
    plan3 = rg.make_plan(params, world_size=3)
    meta = rg.pytree.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), params)
    other = {"x": torch.randn(4, dtype=torch.float64)}

    def fn(c):
        d = rg.shard(plan, params, c)
        with pytest.raises(ValueError, match=re.escape("world_size=3 but the comm's shard group has 2")):
            rg.gather(rg.shard(plan3, params, rank=c.rank), c)
        with pytest.raises(ValueError, match=re.escape("shard: the plan shards over world_size=3 ranks")):
            rg.shard(plan3, params, c)
        with pytest.raises(rg.LayoutError, match=re.escape("params['emb'] is a meta tensor")):
            rg.shard(plan, meta, c)
        with pytest.raises(ValueError, match=re.escape(f"plan.buffer_numel = {plan.buffer_numel}")):
            rg.reduce_scatter(plan, torch.zeros(plan.buffer_numel + 1, dtype=torch.float64), c)
        with pytest.raises(ValueError, match="op must be one of"):
            rg.reduce_scatter(plan, params, c, op="max")
        with pytest.raises(rg.LayoutError, match="missing"):
            rg.reduce_scatter(plan, other, c)
        with pytest.raises(rg.LayoutError, match="sharded leaves differ"):
            rg.redistribute(d, rg.make_plan(other, world_size=2), c)
        with pytest.raises(KeyError, match="not a sharded leaf"):
            rg.owned_plan(plan, {"['nope']": 0})
        with pytest.raises(rg.CollectiveError):  # a refused call poisons the comm (peers raise, none waits)
            rg.gather(d, c)
        return True

    assert rg.collectives.simulate(2, fn, timeout=10) == [True, True]


@pytest.mark.parametrize("verb", ["all_gather_flat", "reduce_scatter_flat"])
def test_flat_collectives_carry_their_label(verb):
    """Two ranks moving two different units of the same plan at the same call (same sizes, same
    plan identity) must not pair: the label they carry tells them apart (the fsdp step passes
    its unit and program position, e.g. 'gather layers.3 forward entry 4')."""
    from ragged.transforms import all_gather_flat, reduce_scatter_flat

    plan = rg.make_plan({"w": torch.empty(4, 3)}, world_size=2)

    def fn(c):
        label = f"gather layers.{c.rank} forward entry 0"
        try:
            if verb == "all_gather_flat":
                all_gather_flat(plan, torch.empty(plan.buffer_numel), torch.zeros(plan.shard_size), c, label=label)
            else:
                reduce_scatter_flat(plan, torch.empty(plan.shard_size), torch.zeros(plan.buffer_numel), c, label=label)
        except rg.PlanMismatchError as e:
            return str(e)

    msgs = rg.collectives.simulate(2, fn, timeout=5)
    assert all(m is not None for m in msgs), msgs
    assert "layers.0" in msgs[0] and "layers.1" in msgs[0], msgs
