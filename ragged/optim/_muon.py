"""Distributed Muon: momentum on the shard, Newton-Schulz on one owner rank per matrix.

[Note: distributed Muon data flow]
1. Momentum is element-wise, so it runs on each rank's shard as is (one ``lerp`` per buffer),
   with ``torch.optim.Muon``'s formulas: ``buf = lerp(buf, g, 1 - momentum)`` and, with
   Nesterov, ``u = lerp(g, buf, momentum)``.
2. Each Muon matrix (a 2-D leaf, or one ``(R, C)`` matrix of a 3-D fused-experts leaf) gets an
   owner rank. Owners are chosen once, jointly over every DBuffer of the params tree (e.g. all
   FSDP units of a model), by longest-processing-time-first list scheduling of the Newton-Schulz cost (``ns_steps * (4 a^2 b + 2 a^3)`` flops for an
   ``a x b`` matrix, ``a <= b``), so the busiest rank exceeds the least busy by at most one
   matrix's cost (:func:`muon_load` reports it).
3. The matrices move to their owners by uneven ``all_to_all`` of contiguous slices (no index
   tensors: each (matrix, rank) piece is one slice). This is the owned RaggedShard (each matrix
   whole on one rank), like :func:`ragged.owned_plan` but at matrix rather than leaf
   granularity, so experts of one leaf can live on different ranks. The matrices are split
   into waves; all waves' forward exchanges are issued asynchronously up front, and each wave's
   result is sent back asynchronously as soon as its Newton-Schulz is done, so communication
   of one wave overlaps the Newton-Schulz of the others.
4. The owner runs Newton-Schulz (bf16, quintic (3.4445, -4.7750, 2.0315), Frobenius norm
   clamped at ``eps``=1e-7, transposed when rows > cols) exactly as ``torch.optim.Muon`` does,
   and scales the result by ``sqrt(max(1, rows / cols))``. The results go back to the ranks
   that hold the pieces; weight decay and ``-learning_rate`` are chained after.

Replicated matrices (``spec.Replicate()``) are orthogonalised locally on every rank.
Elements that are not Muon matrices pass through (``multi_transform`` in :func:`muon`
gives them to AdamW).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._pytree import pytree
from ragged.optim._alias import adamw
from ragged.optim._base import GradientTransformation, Schedule, check_like_state
from ragged.optim._combine import chain, multi_transform
from ragged.optim._transform import _check_beta, add_decayed_weights, scale_by_learning_rate
from ragged.spec import LayoutPlan, LeafLayout
from ragged._errors import RaggedTypeError, RaggedValueError

__all__ = ["ScaleByMuonState", "newton_schulz", "scale_by_muon", "muon", "muon_load", "MuonMatrix",
           "default_muon_filter"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalisation of a 2-D matrix, in bf16 (torch.optim.Muon's).

    Returns a bf16 matrix like ``g`` whose singular values are roughly in [0.5, 1.5].

    Examples:
        >>> import torch
        >>> from ragged.optim import newton_schulz
        >>> o = newton_schulz(torch.randn(8, 32, generator=torch.Generator().manual_seed(0)))
        >>> o.dtype, o.shape, bool(torch.linalg.svdvals(o.float()).max() < 1.6)
        (torch.bfloat16, torch.Size([8, 32]), True)
    """
    if g.ndim != 2:
        raise RaggedValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}.")
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


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


def _ns_cost(rows: int, cols: int, steps: int) -> float:
    a, b = min(rows, cols), max(rows, cols)
    return float(steps * (4 * a * a * b + 2 * a**3))


def _matrices(plans, muon_filter, ns_steps: int) -> list[tuple[MuonMatrix, ...]]:
    """The Muon matrices of every plan, with owners chosen jointly over all plans (LPT)."""
    plans = list(plans)
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
            rows, cols = leaf.shape[-2], leaf.shape[-1]
            count = leaf.shape[0] if len(leaf.shape) == 3 else 1
            for e in range(count):
                start = leaf.offset + e * rows * cols
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
    return [tuple(u) for u in out]


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
    plans = [plans] if isinstance(plans, LayoutPlan) else list(plans)
    assignments = [x for group in _matrices(plans, muon_filter, ns_steps) for x in group]
    m = plans[0].world_size
    flops = [0.0] * m
    count = [0] * m
    for x in assignments:
        flops[x.owner] += x.cost
        count[x.owner] += 1
    return {"assignments": assignments, "flops": flops, "matrices": count}


@dataclasses.dataclass(frozen=True)
class _Wave:
    """One wave's exchange, as contiguous spans (no per-element index tensors: the plan keeps
    every matrix contiguous, so each (matrix, rank) piece is one slice)."""

    send_spans: tuple[tuple[int, int], ...]  # (offset in my shard, length), grouped by destination
    send_splits: tuple[int, ...]
    recv_spans: tuple[tuple[int, int, int], ...]  # (offset in recv, offset in owned buffer, length)
    recv_splits: tuple[int, ...]
    owned: tuple[tuple[MuonMatrix, int], ...]  # (matrix, offset in the owned buffer)
    owned_numel: int


def _waves(plan: LayoutPlan, rank: int, matrices: tuple[MuonMatrix, ...], num_waves: int) -> tuple[_Wave, ...]:
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
            for j, lo, hi, local in _pieces(plan, u):
                if j == rank:
                    sends.setdefault(u.owner, []).append((local, hi - lo))
        for u, o in owned:
            for j, lo, hi, _ in _pieces(plan, u):
                recvs.setdefault(j, []).append((o + lo - u.start, hi - lo))
        send_spans = [span for j in sorted(sends) for span in sends[j]]
        send_splits, recv_splits = [0] * m, [0] * m
        for j, spans in sends.items():
            send_splits[j] = sum(k for _, k in spans)
        recv_spans, recv_at = [], 0
        for j in sorted(recvs):
            for o, k in recvs[j]:
                recv_spans.append((recv_at, o, k))
                recv_at += k
            recv_splits[j] = sum(k for _, k in recvs[j])
        waves.append(_Wave(tuple(send_spans), tuple(send_splits), tuple(recv_spans), tuple(recv_splits), tuple(owned), off))
    return tuple(waves)


def _pieces(plan: LayoutPlan, u: MuonMatrix):
    """``(rank, global lo, global hi, offset in that rank's shard)`` of each part of matrix ``u``, by
    buffer, then rank: buffer ``(offset o, shard size s)`` puts rank ``j`` at ``[o + j s, o + (j + 1) s)``
    (:meth:`~ragged.spec.LayoutPlan.shard_ranges`), so the ranks a matrix touches follow from its ends,
    without looking at the others (a plan at 10K ranks). Arithmetic here rather than ``plan.locate`` and
    ``plan.shard_ranges(j)`` per piece: those rebuild the buffers' offsets on every call, which made
    DeepSeek-V3's Muon lowering at 10,240 ranks 82 s instead of 14 s."""
    base = 0
    for o, size in plan.buffers:
        lo, hi = max(u.start, o), min(u.stop, o + plan.world_size * size)
        if size and lo < hi:
            for j in range((lo - o) // size, (hi - 1 - o) // size + 1):
                a, b = max(lo, o + j * size), min(hi, o + (j + 1) * size)
                yield j, a, b, base + a - o - j * size
        base += size


def _cat_spans(src: torch.Tensor, spans) -> torch.Tensor:
    """The spans ``(offset, length)`` of ``src`` concatenated (one ``torch.cat``)."""
    if not spans:
        return src.new_empty(0)
    return torch.cat([src[o : o + n] for o, n in spans])


class ScaleByMuonState(NamedTuple):
    """State of :func:`scale_by_muon`: the momentum buffer, like the params.

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(4, 4)}, world_size=1)
        >>> state = rg.optim.scale_by_muon(comm=None).init(rg.shard(plan, {"w": torch.ones(4, 4)}, rank=0))
        >>> type(state.momentum).__name__, state.momentum.data.abs().sum().item()
        ('DBuffer', 0.0)
    """

    momentum: Any


def scale_by_muon(
    *,
    comm,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    muon_filter: Callable[[LeafLayout], bool] = default_muon_filter,
    num_waves: int = 4,
) -> GradientTransformation:
    """Muon's direction (see [Note: distributed Muon data flow]): momentum, then Newton-Schulz
    of each matrix on its owner rank, scaled by ``sqrt(max(1, rows / cols))``.

    Elements of leaves that ``muon_filter`` rejects pass through as the momentum update (use
    :func:`muon`, which gives them to AdamW).

    Args:
        comm: the shard group's collectives (``None`` only for single-rank plans).
        momentum: momentum coefficient (torch.optim.Muon's EMA form).
        nesterov: Nesterov momentum.
        ns_steps: Newton-Schulz iterations.
        muon_filter: ``LeafLayout -> bool``: which leaves are Muon matrices.
        num_waves: how many groups of matrices to pipeline (communication of one group
            overlaps Newton-Schulz of another).

    Examples:
        >>> import torch, ragged as rg
        >>> plan = rg.make_plan({"w": torch.empty(4, 4)}, world_size=1)
        >>> p = rg.shard(plan, {"w": torch.zeros(4, 4)}, rank=0)
        >>> opt = rg.optim.scale_by_muon(comm=None)
        >>> u, _ = opt.update(p.replace(data=torch.eye(4).reshape(-1)), opt.init(p), p)
        >>> [round(s, 2) for s in torch.linalg.svdvals(u.views()["w"]).tolist()]   # Newton-Schulz: all equal, near 1
        [0.82, 0.82, 0.82, 0.82]
    """
    _check_beta("momentum", momentum)
    if ns_steps < 1 or ns_steps >= 100:
        raise RaggedValueError(f"ns_steps must be in [1, 100), got {ns_steps}.")
    cache: dict = {}

    def waves_for(tree, *, agree: bool = True) -> list:
        """Per DBuffer of ``tree`` (flattened order): its exchange waves; owners are balanced
        jointly over all the buffers. ``agree`` (each update, before its all-to-alls): the buffers
        are this rank's and every rank holds the same plans; ``init`` and ``collectives`` check
        only what the buffers themselves say (they serve ``step.lower`` for every rank)."""
        bufs = pytree.leaves(tree, is_leaf=is_dbuffer)
        key = tuple((d.plan, d.rank, d.data.device) for d in bufs)
        if key not in cache:
            for d in bufs:
                if not isinstance(d, DBuffer):
                    raise RaggedTypeError(
                        f"muon works on DBuffers (rg.shard output), got a {type(d).__name__} leaf. "
                        "Fix: pass the DBuffer(s); for plain tensors use torch.optim.Muon."
                    )
                if d.plan.world_size > 1 and (comm is None or comm.world_size != d.plan.world_size):
                    raise RaggedValueError(
                        f"muon: the plan has world_size={d.plan.world_size} but comm is "
                        f"{'None' if comm is None else f'a group of {comm.world_size}'}; pass the shard group's comm."
                    )
            matrices = _matrices([d.plan for d in bufs], muon_filter, ns_steps)
            if len(cache) > 8:
                cache.clear()
            cache[key] = [_waves(d.plan, d.rank, x, num_waves) for d, x in zip(bufs, matrices)]
        if agree and comm is not None:  # not in init: a lowered step's init builds every rank's state
            for d in bufs:
                if comm.rank != d.rank:
                    raise RaggedValueError(f"muon: the DBuffer belongs to rank {d.rank} but comm.rank is {comm.rank}.")
        if agree and comm is not None and comm.world_size > 1:
            from ragged.transforms._check import check_plans

            # every rank must hold the same plans before the all_to_alls (every call: a cache hit
            # on one rank says nothing about the others)
            check_plans([d.plan for d in bufs], comm, f"muon:{ns_steps}:{num_waves}")
        return cache[key]

    def orthogonalize(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        o = newton_schulz(x.view(rows, cols), steps=ns_steps)
        return o.to(x.dtype).mul_(math.sqrt(max(1.0, rows / cols)))

    def one(u: DBuffer, waves) -> DBuffer:
        data, dev = u.data, u.data.device
        out = data.clone()  # non-Muon elements pass through
        pending = []
        for w in waves:
            send = _cat_spans(data, w.send_spans)
            recv = torch.empty(sum(w.recv_splits), dtype=data.dtype, device=dev)
            h = _a2a(recv, send, w.recv_splits, w.send_splits)
            pending.append((w, recv, h))
        back = []
        for w, recv, h in pending:
            if h is not None:
                h.wait()
            owned = torch.empty(w.owned_numel, dtype=data.dtype, device=dev)
            for r_off, o_off, n in w.recv_spans:
                owned[o_off : o_off + n].copy_(recv[r_off : r_off + n])
            for unit, off in w.owned:
                owned[off : off + unit.numel] = orthogonalize(owned[off : off + unit.numel], unit.rows, unit.cols).reshape(-1)
            ret = _cat_spans(owned, [(o_off, n) for _, o_off, n in w.recv_spans])
            got = torch.empty(sum(w.send_splits), dtype=data.dtype, device=dev)
            back.append((w, got, _a2a(got, ret, w.send_splits, w.recv_splits)))
        for w, got, h in back:
            if h is not None:
                h.wait()
            k = 0
            for off, n in w.send_spans:
                out[off : off + n].copy_(got[k : k + n])
                k += n
        rep = u.replicated.clone()
        for leaf in u.plan.replicated:
            if muon_filter(leaf) and len(leaf.shape) in (2, 3):
                rows, cols = leaf.shape[-2], leaf.shape[-1]
                for e in range(leaf.numel // (rows * cols)):
                    s = leaf.offset + e * rows * cols
                    rep[s : s + rows * cols] = orthogonalize(rep[s : s + rows * cols], rows, cols).reshape(-1)
        return u.replace(data=out, replicated=rep)

    def _a2a(output, input, output_splits, input_splits):
        if comm is None or comm.world_size == 1:
            output.copy_(input)
            return None
        return comm.all_to_all(output, input, list(output_splits), list(input_splits), async_op=True)

    def init(params):
        waves_for(params, agree=False)  # validate buffers / filter / comm now, before any training step
        return ScaleByMuonState(momentum=pytree.map(torch.zeros_like, params))

    def collectives(params):
        if comm is None or comm.world_size == 1:
            return ()
        from ragged.transforms._check import agreement_collectives

        bufs = pytree.leaves(params, is_leaf=is_dbuffer)
        calls = nbytes = 0
        for d, waves in zip(bufs, waves_for(params, agree=False)):
            calls += 2 * len(waves)  # each wave's exchange to the owners and back
            nbytes += d.data.element_size() * sum(sum(w.send_splits) + sum(w.recv_splits) for w in waves)
        return agreement_collectives(comm, every_call=False) + ((("all_to_all", "shard", calls, nbytes),) if calls else ())

    def update(updates, state, params=None):
        del params
        check_like_state(updates, state.momentum, "muon")
        buf = pytree.map(lambda b, g: torch.lerp(b, g.to(b.dtype), 1.0 - momentum), state.momentum, updates)
        direction = pytree.map(lambda g, b: torch.lerp(g.to(b.dtype), b, momentum), updates, buf) if nesterov else buf
        bufs, treedef = pytree.flatten(direction, is_leaf=is_dbuffer)
        out = [one(d, w) for d, w in zip(bufs, waves_for(direction))]
        return pytree.unflatten(treedef, out), ScaleByMuonState(momentum=buf)

    return GradientTransformation(init, update, collectives=collectives)


def muon(
    learning_rate: float | Schedule,
    *,
    comm,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: float = 0.0,
    muon_filter: Callable[[LeafLayout], bool] = default_muon_filter,
    adam: GradientTransformation | None = None,
    num_waves: int = 4,
) -> GradientTransformation:
    """Distributed Muon for the matrices, AdamW for everything else, via :func:`multi_transform`.

    The Muon part matches ``torch.optim.Muon(lr=learning_rate, momentum=momentum,
    nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)`` (adjust_lr_fn
    "original"): ``p <- p * (1 - lr * wd) - lr * sqrt(max(1, rows/cols)) * NS(u)``.

    Args:
        learning_rate: Muon's learning rate (float or schedule).
        comm: the shard group's collectives.
        momentum, nesterov, ns_steps, weight_decay: as in ``torch.optim.Muon``.
        muon_filter: ``LeafLayout -> bool`` choosing the Muon matrices (default: 2-D and 3-D
            leaves; exclude embeddings and heads with your own filter).
        adam: the transformation for the other leaves (default
            ``rg.optim.adamw(3e-4, weight_decay=weight_decay)``); it runs on their elements
            packed into short buffers (``multi_transform(compact=...)``), so it must be
            element-wise, and its state covers only those elements.
        num_waves: pipelining depth of the owner exchange.

    Examples:
        >>> import torch, ragged as rg
        >>> params = {"w": torch.randn(16, 8), "b": torch.randn(8)}
        >>> plan = rg.make_plan(params, world_size=2)
        >>> def fn(comm):
        ...     local = rg.shard(plan, params, comm)
        ...     opt = rg.optim.muon(0.02, comm=comm)
        ...     state = opt.init(local)
        ...     updates, state = opt.update(local, state, local)
        ...     return rg.gather(rg.apply_updates(local, updates), comm)["w"].shape
        >>> rg.collectives.simulate(2, fn)
        [torch.Size([16, 8]), torch.Size([16, 8])]
    """
    muon_part = chain(
        scale_by_muon(
            comm=comm, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, muon_filter=muon_filter,
            num_waves=num_waves,
        ),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )
    other = adam if adam is not None else adamw(3e-4, weight_decay=weight_decay)
    return multi_transform(
        {"muon": muon_part, "adam": other},
        lambda leaf: "muon" if muon_filter(leaf) else "adam",
        compact=("adam",),  # AdamW state only for the non-Muon elements
    )
