"""The simulated backend implements the protocol (references computed directly)."""

import pytest
import torch

import ragged as rg
from ragged import RaggedError


def _inputs(m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(m)]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_all_gather_into(m):
    xs = _inputs(m, 5)

    def fn(c):
        out = torch.empty(5 * m, dtype=torch.float64)
        assert c.all_gather_into(out, xs[c.rank], async_op=True).wait() is None
        return out

    for out in rg.collectives.simulate(m, fn):
        torch.testing.assert_close(out, torch.cat(xs))


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reduce_scatter_and_all_reduce(op):
    m = 3
    xs = _inputs(m, 12)
    ref = {"sum": sum(xs), "mean": sum(xs) / m, "max": torch.stack(xs).amax(0)}[op]

    def fn(c):
        out = torch.empty(4, dtype=torch.float64)
        c.reduce_scatter_into(out, xs[c.rank], op=op)
        t = xs[c.rank].clone()
        c.all_reduce(t, op=op)
        return out, t

    for r, (out, t) in enumerate(rg.collectives.simulate(m, fn)):
        torch.testing.assert_close(out, ref[4 * r : 4 * r + 4])
        torch.testing.assert_close(t, ref)


def test_all_to_all_uneven():
    m = 3
    # rank i sends (i + j) elements to rank j, valued 100*i + j
    def fn(c):
        i = c.rank
        splits_in = [i + j for j in range(m)]
        inp = torch.cat([torch.full((i + j,), 100.0 * i + j) for j in range(m)])
        splits_out = [j + i for j in range(m)]
        out = torch.empty(sum(splits_out))
        c.all_to_all(out, inp, splits_out, splits_in)
        return out

    for r, out in enumerate(rg.collectives.simulate(m, fn)):
        want = torch.cat([torch.full((j + r,), 100.0 * j + r) for j in range(m)])
        torch.testing.assert_close(out, want)


def test_hsdp_mesh_groups():
    xs = _inputs(4, 4)

    def fn(c):
        t = xs[c.replica_rank * c.world_size + c.rank].clone()
        c.all_reduce_replicas(t, op="sum")
        out = torch.empty(4 * c.world_size, dtype=torch.float64)
        c.all_gather_into(out, xs[c.replica_rank * c.world_size + c.rank])
        return (c.replica_rank, c.rank, c.world_size, c.num_replicas), t, out, c.all_gather_object(c.rank)

    res = rg.collectives.simulate(4, fn, mesh_shape=(2, 2))
    assert [r[0] for r in res] == [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]
    for g, (_, t, out, objs) in enumerate(res):
        torch.testing.assert_close(t, xs[g % 2] + xs[2 + g % 2])
        torch.testing.assert_close(out, torch.cat(xs[2 * (g // 2) : 2 * (g // 2) + 2]))
        assert objs == [0, 1, 0, 1]


def test_error_on_one_rank_is_reraised_with_rank():
    def fn(c):
        if c.rank == 1:
            raise KeyError("boom")
        c.all_reduce(torch.ones(1))

    with pytest.raises(KeyError, match="boom") as info:
        rg.collectives.simulate(3, fn, timeout=10)
    assert any("rank 1" in n for n in info.value.__notes__)


def test_mismatched_collectives_name_both_sides_on_every_rank():
    def fn(c):
        try:
            if c.rank == 0:
                c.all_reduce(torch.ones(1))
            else:
                c.all_gather_into(torch.empty(2), torch.ones(1))
        except rg.PlanMismatchError as e:
            return str(e)

    msgs = rg.collectives.simulate(2, fn, timeout=5)
    assert all("rank 0 called all_reduce[sum] of 1 x float32" in m and "called all_gather of 1 x float32" in m
               for m in msgs), msgs


@pytest.mark.parametrize("kind", ["dtype", "label", "scope", "count"])
def test_calls_differing_only_in_dtype_label_scope_or_size_raise(kind):
    from ragged.collectives import CallScope

    def fn(c):
        x = torch.ones(2 if kind != "count" or c.rank == 0 else 3,
                       dtype=torch.bfloat16 if kind == "dtype" and c.rank == 1 else torch.float32)
        if kind == "scope":
            c.scope = CallScope(c.rank, f"reduce_scatter:{['sum', 'mean'][c.rank]}")
        try:
            c.all_reduce(x, label=f"unit {c.rank}" if kind == "label" else None)
        except rg.PlanMismatchError as e:
            return str(e)

    msgs = rg.collectives.simulate(2, fn, timeout=5)
    assert all(m is not None for m in msgs), msgs
    if kind == "label":
        assert "'unit 0'" in msgs[0] and "'unit 1'" in msgs[0]
    if kind == "scope":
        assert "reduce_scatter:sum" in msgs[1] and "reduce_scatter:mean" in msgs[1]


def test_rank_that_returns_early_fails_its_waiting_peer_at_once():
    import time

    def fn(c):
        if c.rank == 0:
            t0 = time.monotonic()
            try:
                c.all_reduce(torch.ones(1))
            except rg.CollectiveError as e:
                return str(e), time.monotonic() - t0

    msg, waited = rg.collectives.simulate(2, fn, timeout=30)[0]
    assert "rank 1 returned (stopped early)" in msg and waited < 5


def test_missing_collective_times_out():
    def fn(c):
        if c.rank == 0:
            c.all_reduce(torch.ones(1))
        else:
            time.sleep(2)

    import time

    with pytest.raises(RaggedError, match="did not arrive within 0.5s"):
        rg.collectives.simulate(2, fn, timeout=0.5)


def test_poison_makes_peers_raise_naming_the_reason():
    def fn(c):
        if c.rank == 2:
            c.poison("bad batch")
            return None
        try:
            c.barrier()
        except rg.CollectiveError as e:
            return str(e)

    msgs = rg.collectives.simulate(3, fn, timeout=30)
    assert all(m.startswith("rank 2 failed: bad batch") for m in msgs[:2]), msgs


def test_error_inside_poison_on_error_fails_peers_and_is_reraised():
    def fn(c):
        with rg.collectives.poison_on_error(c):
            if c.rank == 1:
                raise RuntimeError("bad batch")
        c.barrier()

    with pytest.raises(RuntimeError, match="bad batch"):
        rg.collectives.simulate(2, fn, timeout=30)


def test_coalesced_buffers():
    m = 2
    xs, ys = _inputs(m, 3), _inputs(m, 4, seed=1)

    def fn(c):
        outs = [torch.empty(3 * m, dtype=torch.float64), torch.empty(4 * m, dtype=torch.float64)]
        c.all_gather_into_coalesced(outs, [xs[c.rank], ys[c.rank]])
        rs = [torch.empty(3, dtype=torch.float64), torch.empty(4, dtype=torch.float64)]
        c.reduce_scatter_into_coalesced(rs, [torch.cat(xs), torch.cat(ys)])
        return outs, rs

    for r, (outs, rs) in enumerate(rg.collectives.simulate(m, fn)):
        torch.testing.assert_close(outs[0], torch.cat(xs))
        torch.testing.assert_close(outs[1], torch.cat(ys))
        torch.testing.assert_close(rs[0], m * torch.cat(xs)[3 * r : 3 * r + 3])
        torch.testing.assert_close(rs[1], m * torch.cat(ys)[4 * r : 4 * r + 4])
