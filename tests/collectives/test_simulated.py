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


def test_mismatched_collectives_error_not_hang():
    def fn(c):
        if c.rank == 0:
            c.all_reduce(torch.ones(1))
        else:
            c.all_gather_into(torch.empty(2), torch.ones(1))

    with pytest.raises(RaggedError, match="different collectives"):
        rg.collectives.simulate(2, fn, timeout=5)


def test_missing_collective_times_out():
    def fn(c):
        if c.rank == 0:
            c.all_reduce(torch.ones(1))

    with pytest.raises(RaggedError, match="did not arrive within 0.5s"):
        rg.collectives.simulate(2, fn, timeout=0.5)
