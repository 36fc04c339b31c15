"""The engine on real gloo process groups (2 and 4 ranks, HSDP 2x2), against float64
references computed unsharded in each worker from the same seeds."""


import pytest
import torch

import ragged as rg
from ragged import spec
from tests.distributed._harness import comm, mesh, workers_2_and_4

pytestmark = pytest.mark.distributed

workers2, workers4, workers = workers_2_and_4()


def _probe_under_profiler():
    """Polling a handle while its collective finishes on gloo's thread, under torch's profiler and
    inside saved-tensor hooks (the fsdp step's backward): the poll must not deadlock (see [Note:
    asking a torch work whether it is done] in ragged/collectives/_handles.py; NCCL's shape, whose
handles ask torch's works). Rank 1 arrives late,
    so rank 0 polls while gloo finishes each all-reduce."""
    import time

    from torch.profiler import ProfilerActivity, profile

    c = comm(handshake="deferred")
    x = torch.ones(1 << 14)
    polls = 0
    with profile(activities=[ProfilerActivity.CPU]), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for _ in range(400):
            if c.rank == 1:
                time.sleep(0.0002)
            h = c.all_reduce(x, async_op=True)
            while not h.is_completed():
                polls += 1
            h.wait()
    return polls


def _params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return {
        "emb": r(11, 8),
        "blocks": [{"w": r(9, 8), "b": r(9), "norm": r(8)}, {"w": r(5, 9), "b": r(5), "norm": r(8)}],
        "experts": r(3, 4, 8),
    }


SPECS = {
    "emb": spec.Rows(2),
    "blocks": [{"w": spec.Blocks(3, 4), "b": None, "norm": spec.Replicate()}, {"w": None, "b": None, "norm": spec.Replicate()}],
    "experts": spec.Blocks(4, 8),
}


def _plan(m, dtype=torch.float64):
    return rg.make_plan(_params(dtype=dtype), SPECS, world_size=m)


def _close(a, b, **kw):
    for x, y in zip(rg.pytree.leaves(a), rg.pytree.leaves(b), strict=True):
        torch.testing.assert_close(x, y, **kw)


# ---- bodies (module level: they are pickled to the workers) ------------------------------------
def _gather_shard(handshake):
    c = comm(handshake=handshake)
    params = _params()
    plan = _plan(c.world_size)
    d = rg.shard(plan, params, c)
    pending = rg.gather_start(d, c)
    full = rg.gather_wait(pending)
    _close(full, params, rtol=0, atol=0)
    ptr = pending.buffer.untyped_storage().data_ptr()
    sharded = [rg.pytree.leaves(full)[l.index] for l in plan.leaves]
    assert all(t.untyped_storage().data_ptr() == ptr for t in sharded)
    full2 = rg.gather(d, c)
    _close(full2, params, rtol=0, atol=0)
    return d.data.numel()


def _reduce_scatter(handshake, op, flat):
    c = comm(handshake=handshake)
    m = c.world_size
    plan = _plan(m)
    grads = [_params(seed=100 + r) for r in range(m)]
    ref = rg.pytree.map(lambda *xs: sum(xs) / (m if op == "mean" else 1), *grads)
    want = rg.shard(plan, ref, c)
    if flat:
        mine = rg.shard(plan, grads[c.rank], rank=0)  # build the flat buffer via a 1-rank trick
        buf = torch.zeros(plan.buffer_numel, dtype=plan.dtype)
        for l in plan.leaves:
            buf[l.offset : l.stop] = _leaf(grads[c.rank], l.path).reshape(-1)
        rep = torch.zeros_like(mine.replicated)
        for l in plan.replicated:
            rep[l.offset : l.stop] = _leaf(grads[c.rank], l.path).reshape(-1)
        got = rg.reduce_scatter(plan, buf, c, op=op, replicated=rep)
    else:
        pending = rg.reduce_scatter_start(plan, grads[c.rank], c, op=op)
        got = rg.reduce_scatter_wait(pending)
    torch.testing.assert_close(got.data, want.data)
    torch.testing.assert_close(got.replicated, want.replicated)
    return True


def _leaf(tree, path):
    leaves = rg.pytree.leaves(tree)
    paths = rg.pytree.paths(tree)
    for p, leaf in zip(paths, leaves):
        if "".join(f"[{k!r}]" for k in p) == path:
            return leaf
    raise KeyError(path)


def _autograd():
    c = comm()
    m = c.world_size
    params = _params()
    plan = _plan(m)
    targets = [_params(seed=200 + r) for r in range(m)]

    def loss(full, t):
        return sum(((a * a - b) ** 2).sum() for a, b in zip(rg.pytree.leaves(full), rg.pytree.leaves(t)))

    d = rg.shard(plan, params, c)
    data = d.data.clone().requires_grad_()
    rep = d.replicated.clone().requires_grad_()
    loss(rg.gather(d.replace(data=data, replicated=rep), c), targets[c.rank]).backward()
    g_func = torch.func.grad(lambda x: loss(rg.gather(d.replace(data=x), c), targets[c.rank]))(d.data)
    ref = rg.pytree.map(lambda p, *ts: sum(4 * p * (p * p - t) for t in ts), params, *targets)
    want = rg.shard(plan, ref, c)
    torch.testing.assert_close(data.grad, want.data)
    torch.testing.assert_close(rep.grad, want.replicated)
    torch.testing.assert_close(g_func, want.data)
    return True


def _mixed_precision():
    c = comm()
    params = _params(dtype=torch.float32)
    plan = _plan(c.world_size, torch.float32)
    d = rg.shard(plan, params, c)
    full = rg.gather(d, c, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in rg.pytree.leaves(full))
    _close(full, rg.pytree.map(lambda t: t.to(torch.bfloat16), params), rtol=0, atol=0)
    grads = rg.pytree.map(lambda t: t.to(torch.bfloat16), _params(seed=300 + c.rank, dtype=torch.float32))
    got = rg.reduce_scatter(plan, grads, c, op="mean", dtype=torch.float32)
    assert got.data.dtype == torch.float32
    allg = [rg.pytree.map(lambda t: t.to(torch.bfloat16).double(), _params(seed=300 + r, dtype=torch.float32)) for r in range(c.world_size)]
    ref = rg.pytree.map(lambda *xs: sum(xs) / len(xs), *allg)
    torch.testing.assert_close(got.data, rg.shard(plan, ref, c).data, rtol=1e-6, atol=1e-6)
    return True


def _redistribute():
    c = comm()
    m = c.world_size
    params = _params()
    base = _plan(m)
    targets = [
        rg.make_plan(params, SPECS, world_size=m, strategy="naive"),
        rg.make_plan(params, dict(SPECS, emb=spec.Elements(1)), world_size=m),
        rg.make_plan(params, SPECS, world_size=max(1, m - 1)),
        rg.owned_plan(base),
    ]
    d = rg.shard(base, params, c)
    for t in targets:
        e = rg.redistribute(d, t, c)
        if c.rank < t.world_size:
            assert torch.equal(e.data, rg.shard(t, params, rank=c.rank).data), t
        else:
            assert e.data.numel() == 0
        back = rg.redistribute(e, base, c)
        assert torch.equal(back.data, d.data) and torch.equal(back.replicated, d.replicated)
    owned = rg.redistribute(d, targets[-1], c)
    for l in targets[-1].leaves:
        v = _leaf(owned.views(), l.path)
        assert v.numel() in (0, l.numel) and (v.numel() == 0) == (c.rank not in targets[-1].owners(l))
    return True


def _plan_mismatch():
    c = rg.collectives.from_torch()  # a fresh comm: the plan check is cached per comm
    params = _params()
    if c.rank == c.world_size - 1:
        params["emb"] = torch.randn(13, 8, dtype=torch.float64)
    plan = rg.make_plan(params, SPECS, world_size=c.world_size)
    try:
        rg.gather(rg.shard(plan, params, rank=c.rank).replace(), c)
    except rg.PlanMismatchError as e:
        return str(e)
    return None


def _plan_switch():
    """Every rank gathers plan p (agreed); then the last rank alone switches to another plan on
    the same comm: caught by the every-call check on every rank, not a hang."""
    c = comm(plan_check="every_call")
    params = _params()
    d = rg.shard(_plan(c.world_size), params, c)
    rg.gather(d, c)
    if c.rank == c.world_size - 1:
        params = dict(params, emb=torch.randn(13, 8, dtype=torch.float64))
        d = rg.shard(rg.make_plan(params, SPECS, world_size=c.world_size), params, rank=c.rank)
    try:
        rg.gather(d, c)
    except rg.PlanMismatchError as e:
        rg.gather(rg.shard(_plan(c.world_size), _params(), c), c)  # the group is still usable
        return str(e)
    return None


def _plan_check_defaults():
    import os

    old = os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    try:
        plain = rg.collectives.from_torch().plan_check
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        debug = rg.collectives.from_torch().plan_check
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        if old is not None:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = old
    return plain, debug


def _bad_grads():
    import torch.distributed as dist

    c = rg.collectives.from_torch(dist.new_group(list(range(dist.get_world_size()))))  # the error poisons it
    plan = _plan(c.world_size)
    grads = _params()
    grads["blocks"][1]["w"] = grads["blocks"][1]["w"].float()[:, :4]
    try:
        rg.reduce_scatter(plan, grads, c)
    except rg.LayoutError as e:
        return str(e)
    return None


def _coalesced(handshake):
    """Several buffers in one call (a unit with several buffers): each equals its own collective."""
    c = comm(handshake=handshake)
    m, r = c.world_size, c.rank
    g = torch.Generator().manual_seed(5)
    xs = [[torch.randn(n, generator=g, dtype=torch.float64) for n in (3, 0, 7)] for _ in range(m)]
    outs = [torch.empty(m * x.numel(), dtype=torch.float64) for x in xs[r]]
    c.all_gather_into_coalesced(outs, xs[r], async_op=True).wait()
    for b, o in enumerate(outs):
        torch.testing.assert_close(o, torch.cat([xs[j][b] for j in range(m)]), rtol=0, atol=0)
    full = [[torch.randn(m * n, generator=g, dtype=torch.float64) for n in (2, 0, 5)] for _ in range(m)]
    rs = [torch.empty(n, dtype=torch.float64) for n in (2, 0, 5)]
    c.reduce_scatter_into_coalesced(rs, full[r], op="mean")
    for b, o in enumerate(rs):
        want = sum(full[j][b] for j in range(m)) / m
        n = o.numel()
        torch.testing.assert_close(o, want[r * n : (r + 1) * n])
    return c.handshake


def _handshakes():
    return comm().handshake, comm().timeout


def _global_norm():
    c = comm()
    params = _params()
    d = rg.shard(_plan(c.world_size), params, c)
    ref = torch.sqrt(sum((t * t).sum() for t in rg.pytree.leaves(params)))
    torch.testing.assert_close(d.global_norm(c), ref)
    ref_inf = max(t.abs().max() for t in rg.pytree.leaves(params))
    torch.testing.assert_close(d.global_norm(c, ord=float("inf")), ref_inf)
    return True


def _hsdp():
    from tests.distributed._harness import rank as grank

    dm = mesh((2, 2))
    c = rg.collectives.from_torch(dm)
    assert (c.world_size, c.num_replicas) == (2, 2)
    params = _params()
    plan = _plan(2)
    d = rg.shard(plan, params, c)
    _close(rg.gather(d, c), params, rtol=0, atol=0)
    grads = [_params(seed=400 + r) for r in range(4)]
    ref = rg.pytree.map(lambda *xs: sum(xs) / 4, *grads)
    got = rg.reduce_scatter(plan, grads[grank()], c, op="mean")
    want = rg.shard(plan, ref, c)
    torch.testing.assert_close(got.data, want.data)
    torch.testing.assert_close(got.replicated, want.replicated)
    return (c.rank, c.replica_rank)


def _overlap():
    """Two units in flight at once (prefetch), gathered into reused out= buffers, and two
    reduce-scatters in flight; results equal the synchronous ones."""
    c = comm()
    m = c.world_size
    p1, p2 = _params(seed=1), _params(seed=2)
    plan = _plan(m)
    d1, d2 = rg.shard(plan, p1, c), rg.shard(plan, p2, c)
    bufs = [torch.empty(plan.buffer_numel, dtype=plan.dtype) for _ in range(2)]
    for _ in range(2):  # reuse the buffers across "steps"
        a, b = rg.gather_start(d1, c, out=bufs[0]), rg.gather_start(d2, c, out=bufs[1])
        f2, f1 = rg.gather_wait(b), rg.gather_wait(a)
        _close(f1, p1, rtol=0, atol=0)
        _close(f2, p2, rtol=0, atol=0)
    g1, g2 = _params(seed=10 + c.rank), _params(seed=20 + c.rank)
    r1, r2 = rg.reduce_scatter_start(plan, g1, c), rg.reduce_scatter_start(plan, g2, c)
    s2, s1 = rg.reduce_scatter_wait(r2), rg.reduce_scatter_wait(r1)
    torch.testing.assert_close(s1.data, rg.reduce_scatter(plan, g1, c).data)
    torch.testing.assert_close(s2.data, rg.reduce_scatter(plan, g2, c).data)
    ref = rg.pytree.map(lambda *xs: sum(xs) / m, *[_params(seed=20 + r) for r in range(m)])
    torch.testing.assert_close(s2.data, rg.shard(plan, ref, c).data)
    return True


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("handshake", ["header", "deferred"])
def test_gather_of_shard_is_identity(workers, handshake):
    sizes = workers.run(_gather_shard, handshake)
    assert len(set(sizes)) == 1


@pytest.mark.parametrize("handshake", ["header", "deferred"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter_pytree(workers, handshake, op):
    assert all(workers.run(_reduce_scatter, handshake, op, False))


def test_reduce_scatter_flat(workers):
    assert all(workers.run(_reduce_scatter, "header", "mean", True))


def test_overlapped_gathers_and_reduce_scatters(workers):
    assert all(workers.run(_overlap))


def test_autograd_through_gather(workers):
    assert all(workers.run(_autograd))


def test_mixed_precision(workers):
    assert all(workers.run(_mixed_precision))


def test_redistribute(workers):
    assert all(workers.run(_redistribute))


def test_global_norm(workers):
    assert all(workers.run(_global_norm))


def test_plan_mismatch_raises_on_every_rank(workers):
    msgs = workers.run(_plan_mismatch)
    assert all(m is not None and "['emb']" in m and "(11, 8) vs (13, 8)" in m for m in msgs), msgs


def test_rank_switching_plans_on_a_checked_comm_raises_on_every_rank(workers):
    msgs = workers.run(_plan_switch)
    assert all(m is not None and "leaf ['emb']: shape (11, 8) vs (13, 8)" in m for m in msgs), msgs


def test_plan_check_default_follows_torch_distributed_debug(workers2):
    assert workers2.run(_plan_check_defaults) == [("first_use", "every_call")] * 2


def test_bad_grads_named_before_communication(workers):
    msgs = workers.run(_bad_grads)
    assert all(m is not None and "grads['blocks'][1]['w'] has shape (5, 4)" in m for m in msgs), msgs


@pytest.mark.parametrize("handshake", ["header", "deferred"])
def test_coalesced_buffers_equal_their_own_collectives(workers, handshake):
    assert set(workers.run(_coalesced, handshake)) == {handshake}


def test_default_handshake_and_timeout(workers2):
    assert workers2.run(_handshakes) == [("header", rg.collectives.DEFAULT_TIMEOUT)] * 2


def test_hsdp_2x2(workers4):
    assert sorted(workers4.run(_hsdp)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_polling_a_handle_under_the_profiler_does_not_deadlock(workers2):
    polls = workers2.run(_probe_under_profiler, timeout=90)
    assert polls[0] > 0  # rank 0 did poll while the collectives were in flight
