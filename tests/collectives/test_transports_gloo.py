"""The transports under the collectives, on 2 and 4 real gloo ranks (3 for the header's reduce-scatter): the header channel's
point-to-point paths (``_channel.py`` + ``_p2p.py``) and NCCL's shape: native collectives with
the deferred ledger (``_ledger.py``).

Every path's result is compared with what the collective means, computed locally from every
rank's inputs (each rank's input is a function of its rank); sums in float64 so the order of
the additions cannot hide a wrong chunk.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import ragged as rg
from ragged._errors import CollectiveError, PlanMismatchError
from ragged.collectives import _ledger
from ragged.collectives._header import INLINE_BYTES
from ragged.collectives._p2p import _DIRECT_BYTES
from tests.distributed._harness import workers_2_and_4, workers_fixture

pytestmark = pytest.mark.distributed

workers2, workers4, workers = workers_2_and_4()
workers3 = workers_fixture(3)

# the two transports: gloo's default and NCCL's shape (see [Note: two transports] in _torch.py)
PATHS = {"header": {}, "native": {"handshake": "deferred"}}
# one element, an inline message (<= INLINE_BYTES per peer), a large one, all-reduce above _DIRECT_BYTES
SIZES = (1, 5, INLINE_BYTES // 8 + 3, _DIRECT_BYTES // 8 + 7)


def _input(rank: int, n: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _new_comm(**kw):
    return rg.collectives.from_torch(dist.new_group(list(range(dist.get_world_size()))), **kw)


def _every_collective(path_options, n):
    comm = _new_comm(**dict(path_options))
    r, m = comm.rank, comm.world_size
    mine = [_input(j, m * n) for j in range(m)]  # every rank's reduce-scatter / all-reduce input
    bad = []

    def check(what, got, want):
        if not torch.equal(got, want):
            bad.append(f"{what}: max |diff| {(got - want).abs().max().item():.3g}")

    out = torch.empty(m * n, dtype=torch.float64)
    comm.all_gather_into(out, mine[r][:n])
    check("all_gather", out, torch.cat([x[:n] for x in mine]))

    outs = [torch.empty(m * k, dtype=torch.float64) for k in (n, 2)]
    h = comm.all_gather_into_coalesced(outs, [mine[r][:n], mine[r][n:n + 2] if n >= 2 else mine[r][:2]],
                                       async_op=True)
    h.wait()
    check("all_gather coalesced", outs[0], torch.cat([x[:n] for x in mine]))

    stacked = torch.stack([x.view(m, n) for x in mine])  # (rank, chunk, n)
    for op in ("sum", "mean", "max"):
        got = torch.empty(n, dtype=torch.float64)
        comm.reduce_scatter_into(got, mine[r].clone(), op=op)
        chunks = stacked[:, r]
        want = chunks.amax(0) if op == "max" else chunks.sum(0) / (m if op == "mean" else 1)
        if m <= 3 and op != "max" and path_options == ():  # the header's chain of adds in rank order, to the bit
            want = sum(chunks[1:], chunks[0].clone()) / (m if op == "mean" else 1)
            check(f"reduce_scatter {op}", got, want)
        # the reduction's rounding may differ from torch's sum by an ulp: compare within float64's
        elif not torch.allclose(got, want, rtol=1e-13, atol=1e-13):
            bad.append(f"reduce_scatter {op}: max |diff| {(got - want).abs().max().item():.3g}")

    t = mine[r].clone()
    comm.all_reduce(t, op="sum")
    want = stacked.reshape(m, -1).sum(0)
    if not torch.allclose(t, want, rtol=1e-13, atol=1e-13):
        bad.append(f"all_reduce: max |diff| {(t - want).abs().max().item():.3g}")

    splits = [(j + r) % 3 + 1 for j in range(m)]  # rank r sends splits[j] elements to rank j
    send = torch.cat([torch.full((splits[j],), float(100 * r + j), dtype=torch.float64) for j in range(m)])
    recv_splits = [(r + j) % 3 + 1 for j in range(m)]  # what rank j sends to this rank
    recv = torch.empty(sum(recv_splits), dtype=torch.float64)
    comm.all_to_all(recv, send, recv_splits, splits)
    check("all_to_all", recv, torch.cat([torch.full((recv_splits[j],), float(100 * j + r), dtype=torch.float64)
                                         for j in range(m)]))

    objs = comm.all_gather_object({"rank": r, "blob": "x" * (r * 7000)})
    if objs != [{"rank": j, "blob": "x" * (j * 7000)} for j in range(m)]:
        bad.append("all_gather_object")
    comm.barrier()
    comm.verify()  # the ledger (forced paths) agrees; the header channel has nothing left to check
    return bad


@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_computes_what_the_collective_means(workers, path, n):
    for r, bad in enumerate(workers.run(_every_collective, tuple(PATHS[path].items()), n)):
        assert bad == [], (r, bad)


def test_three_ranks_reduce_the_own_chunk_in_place(workers3):
    # the header's reduce-scatter has three paths (see reduce_rows in _p2p.py): 2 ranks receive into
    # the output, 3 into a two-row scratch beside the input's own chunk, 4 into an (m, n) one
    for r, bad in enumerate(workers3.run(_every_collective, (), 5)):
        assert bad == [], (r, bad)


# ---- the header channel: what a mismatch leaves behind -----------------------------------------
def _after_a_mismatch(kind):
    comm = _new_comm()
    r, m = comm.rank, comm.world_size
    x = torch.arange(4.0)
    out = torch.empty(4 * m)
    try:
        if kind == "label":  # same sizes: every message matched, the comm stays usable
            comm.all_gather_into(out, x, label=f"unit {r == m - 1}")
        else:  # sizes differ: the unmatched messages stay posted, so the comm fails
            n = 3 if r == m - 1 else 4
            comm.all_gather_into(torch.empty(n * m), x[:n])
        first = "no error"
    except PlanMismatchError as e:
        first = type(e).__name__
    try:
        comm.all_gather_into(out, x)
        after = "ok" if torch.equal(out, x.repeat(m)) else "wrong"
    except CollectiveError as e:
        after = f"CollectiveError: {str(e)[:60]}"
    return first, after


@pytest.mark.parametrize("kind", ["label", "sizes"])
def test_a_header_mismatch_keeps_the_channel_only_when_every_message_matched(workers2, kind):
    for first, after in workers2.run(_after_a_mismatch, kind):
        assert first == "PlanMismatchError"
        if kind == "label":
            assert after == "ok"
        else:
            assert after.startswith("CollectiveError: this comm no longer runs collectives"), after


# ---- the deferred ledger ------------------------------------------------------------------------
def _ledger_of(**kw):
    g = dist.new_group(list(range(dist.get_world_size())))
    return _ledger.Ledger(g, None, torch.device("cpu"), every=0, timeout=5.0, **kw)


def _ledger_agreement(differ: bool):
    led = _ledger_of(watch=False)
    r, m = led.rank, led.size
    for i in range(5):
        numel = 7 + (1 if differ and i == 3 and r == m - 1 else 0)
        led.record(0, "all_gather", None, torch.float32, numel, 11, f"gather unit {i}")
    try:
        led.verify()
        return "agreed", led.since, led.digest
    except PlanMismatchError as e:
        return "mismatch", str(e), led.since


def test_the_ledger_agrees_on_equal_calls_and_names_the_first_difference(workers):
    for r, (what, since, digest) in enumerate(workers.run(_ledger_agreement, False)):
        assert (what, since, digest) == ("agreed", 5, 0)
    res = workers.run(_ledger_agreement, True)
    m = len(res)
    for r, (what, msg, since) in enumerate(res):
        assert what == "mismatch" and since == 5, (what, msg)
        assert "collective #3 differs between ranks" in msg, msg
        assert f"rank {r} called gather unit 3" in msg and f"rank {0 if r == m - 1 else m - 1} called" in msg, msg


def _ledger_poison():
    led = _ledger_of()
    r, m = led.rank, led.size
    led.record(0, "all_reduce", "sum", torch.float32, 4, 0, "warm up")  # starts the watcher
    dist.barrier()
    if r == m - 1:
        led.poison("rank %d: bad batch" % r)
        seen = led.read_poison()
    else:
        deadline = time.monotonic() + 10
        while led.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = led.failure
    try:
        led.record(0, "all_reduce", "sum", torch.float32, 4, 0, "after")
        refused = False
    except CollectiveError:
        refused = True
    dist.barrier()
    return str(seen), refused


def test_a_poisoned_ledger_refuses_calls_and_its_peers_watchers_see_the_reason(workers):
    res = workers.run(_ledger_poison)
    m = len(res)
    for r, (seen, refused) in enumerate(res):
        assert refused, r
        assert f"rank {m - 1}: bad batch" in seen, seen
        assert r == m - 1 or seen.startswith("a peer failed: "), seen


def test_first_difference_names_both_sides_or_says_the_records_ran_out():
    a = (0, [(0, 0, "all_gather|...|8", "gather unit a"), (1, 0, "reduce_scatter|sum|8", "reduce unit a")])
    b = (0, [(0, 0, "all_gather|...|8", "gather unit a"), (1, 1, "all_reduce|sum|8", "reduce unit a replicas")])
    msg = _ledger._first_difference([a, b], 0, truncated=False)
    assert "collective #1 differs" in msg and "rank 0 called reduce unit a on the shard group" in msg, msg
    assert "rank 1 called reduce unit a replicas on the replica group" in msg, msg
    same = _ledger._first_difference([(0, a[1][:1]), (0, a[1][:1])], 1, truncated=True)
    assert "not within the last records kept" in same and "[1, 1]" in same
