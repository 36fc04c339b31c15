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

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._pytree import pytree
from ragged.optim._alias import adamw
from ragged.optim._base import GradientTransformation, Schedule, check_like_state, keywords_checked
from ragged.optim._combine import chain, multi_transform
from ragged.optim._transform import _check_beta, add_decayed_weights, scale_by_learning_rate
from ragged.optim._muon_plan import MuonPlan, Wave, default_muon_filter, muon_matrices, muon_plan
from ragged.spec import LeafLayout
from ragged.transforms._check import agreement_collectives, check_plans
from ragged._errors import RaggedTypeError, RaggedValueError, check_int

__all__ = ["ScaleByMuonState", "newton_schulz", "scale_by_muon", "muon"]

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


@keywords_checked
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
    check_int("ns_steps", ns_steps, 1, 100)

    def plan_of(bufs) -> MuonPlan:
        return muon_plan(tuple(d.plan for d in bufs), tuple(d.rank for d in bufs), muon_filter, ns_steps, num_waves)

    def orthogonalize(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        o = newton_schulz(x.view(rows, cols), steps=ns_steps)
        return o.to(x.dtype).mul_(math.sqrt(max(1.0, rows / cols))).reshape(-1)

    def init(params):
        # validate buffers / filter / comm now, before any training step (the owners, not each
        # rank's exchange: a lowered step's init builds the state of many ranks)
        muon_matrices(tuple(d.plan for d in _dbuffers(params, comm)), muon_filter, ns_steps)
        return ScaleByMuonState(momentum=pytree.map(torch.zeros_like, params))

    def collectives(params):
        if comm is None or comm.world_size == 1:
            return ()
        bufs = _dbuffers(params, comm)
        waves = plan_of(bufs).waves
        calls = sum(2 * len(ws) for ws in waves)  # each wave's exchange to the owners and back
        nbytes = sum(d.data.element_size() * sum(sum(w.send_splits) + sum(w.recv_splits) for w in ws)
                     for d, ws in zip(bufs, waves))
        return agreement_collectives(comm, every_call=False) + ((("all_to_all", "shard", calls, nbytes),) if calls else ())

    def update(updates, state, params=None):
        del params
        check_like_state(updates, state.momentum, "muon")
        buf = pytree.map(lambda b, g: torch.lerp(b, g.to(b.dtype), 1.0 - momentum), state.momentum, updates)
        direction = pytree.map(lambda g, b: torch.lerp(g.to(b.dtype), b, momentum), updates, buf) if nesterov else buf
        bufs, treedef = pytree.flatten(direction, is_leaf=is_dbuffer)
        plan = plan_of(_dbuffers(bufs, comm))
        _agree(bufs, comm, f"muon:{ns_steps}:{num_waves}")
        out = [_orthogonalized(d, waves, rep, comm, orthogonalize)
               for d, waves, rep in zip(bufs, plan.waves, plan.replicated)]
        return pytree.unflatten(treedef, out), ScaleByMuonState(momentum=buf)

    return GradientTransformation(init, update, collectives=collectives)


def _dbuffers(tree, comm) -> list[DBuffer]:
    """The DBuffers of ``tree`` (flattened order), each checked against ``comm``'s size."""
    bufs = pytree.leaves(tree, is_leaf=is_dbuffer)
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
    return bufs


def _agree(bufs, comm, label: str) -> None:
    """Each update, before its all-to-alls: the buffers are this rank's, and every rank holds the
    same plans (every call: a cached plan on one rank says nothing about the others)."""
    if comm is None:
        return
    for d in bufs:
        if comm.rank != d.rank:
            raise RaggedValueError(f"muon: the DBuffer belongs to rank {d.rank} but comm.rank is {comm.rank}.")
    if comm.world_size > 1:
        check_plans([d.plan for d in bufs], comm, label)


def _orthogonalized(u: DBuffer, waves: tuple[Wave, ...], replicated, comm, orthogonalize) -> DBuffer:
    """``u`` with every Muon matrix orthogonalised: the sharded ones on their owners (each wave's
    exchange issued up front, each sent back as soon as its owner is done), the replicated ones here."""
    data, dev = u.data, u.data.device
    out = data.clone()  # non-Muon elements pass through
    pending = []
    for w in waves:
        recv = torch.empty(sum(w.recv_splits), dtype=data.dtype, device=dev)
        pending.append((w, recv, _a2a(comm, recv, _cat_spans(data, w.send_spans), w.recv_splits, w.send_splits)))
    back = []
    for w, recv, h in pending:
        if h is not None:
            h.wait()
        owned = torch.empty(w.owned_numel, dtype=data.dtype, device=dev)
        for r_off, o_off, n in w.recv_spans:
            owned[o_off : o_off + n].copy_(recv[r_off : r_off + n])
        for unit, off in w.owned:
            owned[off : off + unit.numel] = orthogonalize(owned[off : off + unit.numel], unit.rows, unit.cols)
        ret = _cat_spans(owned, [(o_off, n) for _, o_off, n in w.recv_spans])
        got = torch.empty(sum(w.send_splits), dtype=data.dtype, device=dev)
        back.append((w, got, _a2a(comm, got, ret, w.send_splits, w.recv_splits)))
    for w, got, h in back:
        if h is not None:
            h.wait()
        k = 0
        for off, n in w.send_spans:
            out[off : off + n].copy_(got[k : k + n])
            k += n
    rep = u.replicated.clone()
    for s, rows, cols in replicated:
        rep[s : s + rows * cols] = orthogonalize(rep[s : s + rows * cols], rows, cols)
    return u.replace(data=out, replicated=rep)


def _a2a(comm, output, input, output_splits, input_splits):
    if comm is None or comm.world_size == 1:
        output.copy_(input)
        return None
    return comm.all_to_all(output, input, list(output_splits), list(input_splits), async_op=True)


@keywords_checked
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
