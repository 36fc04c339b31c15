"""Distributed Muon's plan: the owner of every matrix, and each rank's exchange with the owners.

Pure values from plans (no tensors, no communication), computed once per set of plans and
rank: see [Note: distributed Muon data flow] in ``_muon.py``, which executes them.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any

from ragged._errors import RaggedValueError
from ragged.spec import LayoutPlan, LeafLayout

__all__ = ["MuonMatrix", "MuonPlan", "default_muon_filter", "muon_load", "muon_matrices", "muon_plan"]


def default_muon_filter(leaf: LeafLayout) -> bool:
    """Muon for 2-D leaves and 3-D fused-expert leaves; everything else goes to AdamW.

    Embeddings and output heads are 2-D too: exclude them with your own filter, e.g.
    ``lambda leaf: default_muon_filter(leaf) and "embed" not in leaf.path``.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(4, 4), "experts": torch.empty(2, 4, 4), "b": torch.empty(4)}, world_size=1)
        >>> {l.path: rg.optim.default_muon_filter(l) for l in plan.leaves}
        {"['b']": False, "['experts']": True, "['w']": True}
    """
    return len(leaf.shape) in (2, 3) and leaf.numel > 0


@dataclasses.dataclass(frozen=True, slots=True)
class MuonMatrix:
    """One Muon matrix: ``rows x cols`` elements at global buffer offset ``start``, on rank ``owner``.

    ``matrix`` is the expert index inside a 3-D leaf (0 for a 2-D leaf).

    Examples:
        >>> import torch, ragged as rg
        >>> load = rg.optim.muon_load(rg.make_plan({"w": torch.empty(8, 4), "e": torch.empty(2, 4, 4)}, world_size=2))
        >>> sorted((m.path, m.matrix, m.rows, m.cols, m.numel) for m in load["assignments"])
        [("['e']", 0, 4, 4, 16), ("['e']", 1, 4, 4, 16), ("['w']", 0, 8, 4, 32)]
    """

    path: str
    matrix: int
    start: int
    rows: int
    cols: int
    owner: int
    cost: float

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def stop(self) -> int:
        return self.start + self.numel


def _leaf_matrices(leaf: LeafLayout) -> list[tuple[int, int, int, int]]:
    """``(index, offset, rows, cols)`` of each matrix of a 2-D leaf, or of a 3-D stack of them."""
    rows, cols = leaf.shape[-2:]
    return [(e, leaf.offset + e * rows * cols, rows, cols) for e in range(leaf.shape[0] if len(leaf.shape) == 3 else 1)]


def _ns_cost(rows: int, cols: int, steps: int) -> float:
    a, b = min(rows, cols), max(rows, cols)
    return float(steps * (4 * a * a * b + 2 * a**3))


@functools.lru_cache(maxsize=16)
def muon_matrices(plans: tuple[LayoutPlan, ...], muon_filter, ns_steps: int) -> tuple[tuple[MuonMatrix, ...], ...]:
    """The Muon matrices of every plan, with owners chosen jointly over all plans (LPT; cached:
    every rank, and every sampled rank of a lowering, shares one assignment)."""
    m = plans[0].world_size if plans else 1
    raw = []  # (plan index, path, expert, start, rows, cols, cost)
    for i, plan in enumerate(plans):
        if plan.world_size != m:
            raise RaggedValueError(f"muon: all buffers must share one world size, got {m} and {plan.world_size}.")
        for leaf in plan.leaves:
            if not muon_filter(leaf):
                continue
            if len(leaf.shape) not in (2, 3):
                raise RaggedValueError(
                    f"muon: params{leaf.path} has shape {leaf.shape}; Muon matrices must be 2-D (or 3-D "
                    "stacks of expert matrices). Fix: exclude it with muon_filter (it then gets AdamW)."
                )
            for e, start, rows, cols in _leaf_matrices(leaf):
                raw.append((i, leaf.path, e, start, rows, cols, _ns_cost(rows, cols, ns_steps)))
    least = [(0.0, k) for k in range(m)]  # a heap of (load, rank): the least loaded rank, lowest index on ties
    owner = {}
    for item in sorted(raw, key=lambda u: (-u[6], u[0], u[3])):  # LPT: largest first, least loaded rank
        load, r = heapq.heappop(least)
        owner[(item[0], item[3])] = r
        heapq.heappush(least, (load + item[6], r))
    out: list[list[MuonMatrix]] = [[] for _ in plans]
    for i, path, e, start, rows, cols, cost in sorted(raw, key=lambda u: (u[0], u[3])):
        out[i].append(MuonMatrix(path, e, start, rows, cols, owner[(i, start)], cost))
    return tuple(tuple(u) for u in out)


def muon_load(plans, muon_filter=default_muon_filter, *, ns_steps: int = 5) -> dict[str, Any]:
    """Newton-Schulz work per rank: ``{"assignments", "flops", "matrices"}``.

    Args:
        plans: one :class:`~ragged.spec.LayoutPlan`, or a sequence of them (e.g. one per FSDP
            unit): owners are balanced jointly over all of them, as :func:`muon` does for a
            pytree of DBuffers.
        muon_filter: which leaves are Muon matrices.
        ns_steps: Newton-Schulz iterations (scales the cost).

    ``assignments``: every :class:`MuonMatrix` (with its owner); ``flops[r]``:
    rank r's cost, ``max(flops) - min(flops)`` is at most the largest matrix's (list scheduling).

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w1": torch.empty(64, 64), "w2": torch.empty(64, 64), "e": torch.empty(4, 32, 64)}
        >>> load = rg.optim.muon_load(rg.make_plan(params, world_size=2))
        >>> load["matrices"], len(load["assignments"])
        ([3, 3], 6)
    """
    plans = (plans,) if isinstance(plans, LayoutPlan) else tuple(plans)
    assignments = [x for group in muon_matrices(plans, muon_filter, ns_steps) for x in group]
    m = plans[0].world_size
    flops = [0.0] * m
    count = [0] * m
    for x in assignments:
        flops[x.owner] += x.cost
        count[x.owner] += 1
    return {"assignments": assignments, "flops": flops, "matrices": count}


@dataclasses.dataclass(frozen=True)
class Wave:
    """One wave's exchange, as contiguous spans (no per-element index tensors: the plan keeps
    every matrix contiguous, so each (matrix, rank) piece is one slice)."""

    send_spans: tuple[tuple[int, int], ...]  # (offset in my shard, length), grouped by destination
    send_splits: tuple[int, ...]
    recv_spans: tuple[tuple[int, int, int], ...]  # (offset in recv, offset in owned buffer, length)
    recv_splits: tuple[int, ...]
    owned: tuple[tuple[MuonMatrix, int], ...]  # (matrix, offset in the owned buffer)
    owned_numel: int


def exchange_waves(plan: LayoutPlan, rank: int, matrices: tuple[MuonMatrix, ...], num_waves: int) -> tuple[Wave, ...]:
    """``rank``'s exchange of ``plan``'s ``matrices`` with their owners, in ``num_waves`` contiguous groups."""
    m = plan.world_size
    n = max(1, min(num_waves, len(matrices)))
    # contiguous groups of matrices in buffer order, balanced by element count
    total = sum(u.numel for u in matrices) or 1
    groups: list[list[MuonMatrix]] = [[] for _ in range(n)]
    acc = 0
    for u in matrices:
        groups[min(n - 1, int(acc * n / total))].append(u)
        acc += u.numel
    waves = []
    for group in groups:
        if not group:
            continue
        owned, off = [], 0
        for u in group:
            if u.owner == rank:
                owned.append((u, off))
                off += u.numel
        sends: dict[int, list] = {}  # owner j -> what I hold of the matrices j owns
        recvs: dict[int, list] = {}  # rank j -> what j holds of the matrices I own (offset in owned, length)
        for u in group:
            for _, lo, hi, local in _pieces(plan, u, only=rank):
                sends.setdefault(u.owner, []).append((local, hi - lo))
        for u, o in owned:
            for j, lo, hi, _ in _pieces(plan, u):
                recvs.setdefault(j, []).append((o + lo - u.start, hi - lo))
        send_spans, send_splits, recv_splits = [], [0] * m, [0] * m
        for j in sorted(sends):
            send_spans += sends[j]
            send_splits[j] = sum(k for _, k in sends[j])
        recv_spans, recv_at = [], 0
        for j in sorted(recvs):
            for o, k in recvs[j]:
                recv_spans.append((recv_at, o, k))
                recv_at += k
            recv_splits[j] = sum(k for _, k in recvs[j])
        waves.append(Wave(tuple(send_spans), tuple(send_splits), tuple(recv_spans), tuple(recv_splits), tuple(owned), off))
    return tuple(waves)


def _pieces(plan: LayoutPlan, u: MuonMatrix, only: int | None = None):
    """``(rank, global lo, global hi, offset in that rank's shard)`` of each part of matrix ``u`` (on
    rank ``only``, if given), by buffer, then rank: buffer ``(offset o, shard size s)`` puts rank ``j`` at ``[o + j s, o + (j + 1) s)``
    (:meth:`~ragged.spec.LayoutPlan.shard_ranges`), so the ranks a matrix touches follow from its ends,
    without looking at the others (a plan at 10K ranks). Arithmetic here rather than ``plan.locate`` and
    ``plan.shard_ranges(j)`` per piece: those rebuild the buffers' offsets on every call."""
    base = 0
    for o, size in plan.buffers:
        lo, hi = max(u.start, o), min(u.stop, o + plan.world_size * size)
        if size and lo < hi:
            ranks = range((lo - o) // size, (hi - 1 - o) // size + 1)
            for j in ranks if only is None else (only,) if only in ranks else ():
                a, b = max(lo, o + j * size), min(hi, o + (j + 1) * size)
                yield j, a, b, base + a - o - j * size
        base += size


@dataclasses.dataclass(frozen=True)
class MuonPlan:
    """One rank's Muon update, per DBuffer (flattened order): the exchange ``waves`` of its sharded
    matrices, the ``(offset, rows, cols)`` of its replicated ones (orthogonalised on every rank)."""

    waves: tuple[tuple[Wave, ...], ...]
    replicated: tuple[tuple[tuple[int, int, int], ...], ...]


@functools.lru_cache(maxsize=16)
def muon_plan(plans: tuple[LayoutPlan, ...], ranks: tuple[int, ...], muon_filter, ns_steps: int,
              num_waves: int) -> MuonPlan:
    """The :class:`MuonPlan` of buffers with these plans, held by these ranks (cached)."""
    matrices = muon_matrices(plans, muon_filter, ns_steps)
    replicated = tuple(tuple(x[1:] for leaf in plan.replicated if muon_filter(leaf) and len(leaf.shape) in (2, 3)
                             for x in _leaf_matrices(leaf)) for plan in plans)
    return MuonPlan(waves=tuple(exchange_waves(p, r, x, num_waves) for p, r, x in zip(plans, ranks, matrices)),
                    replicated=replicated)
