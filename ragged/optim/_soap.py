"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam in the
eigenbasis of each block's Shampoo statistics, each block on the rank that holds it.

[Note: SOAP's step, as the reference code runs it]
Per block ``G`` (``r x c``; see [Note: each granule's tiles are the blocks] in ``_blocks.py``),
with ``L = EMA(G G^T)``, ``R = EMA(G^T G)`` (decay ``shampoo_beta``, default ``b2``) and their
eigenbases ``Q_L``, ``Q_R`` (columns by decreasing eigenvalue), following
github.com/nikhilvyas/SOAP's ``soap.py`` (which pytorch-optimizer's ``SOAP`` follows):

* the first step only fills ``L``, ``R`` and takes ``Q = eigh(L + 1e-30 I)`` (flipped): no
  parameter changes, not even by weight decay, on any leaf;
* step ``t >= 1`` (the t-th step after that): ``G' = Q_L^T G Q_R``; ``m = b1 m + (1 - b1) G'``;
  ``v = b2 v + (1 - b2) G'^2``; ``u = Q_L (m / (sqrt(v) + eps)) Q_R^T`` (``normalize_grads``:
  ``u / (1e-30 + rms(u))``, per block); ``p <- p - lr sqrt(1 - b2^t) / (1 - b1^t) u`` (without
  ``correct_bias``: ``p - lr u``); then ``p <- p - lr wd p`` (decoupled, on the updated ``p``);
  then ``L``, ``R`` take this ``G``;
* when ``t % precondition_frequency == 0`` the bases are refreshed after that, by one power
  iteration and a QR: ``Q`` sorted by the estimates ``diag(Q^T L Q)`` (descending, and ``v``'s
  rows / columns with it), then ``Q = qr(L Q)``; ``m``, kept in the eigenbasis as the reference
  keeps it, is rotated into the new one.

Leaves without blocks get the same step with identity bases: Adam with ``b1, b2, eps`` and
SOAP's bias correction, the first step skipped, as the reference treats 1-D parameters. The moments
``mu`` / ``nu`` are DBuffers like the params (a block's eigenbasis coordinates sit at the block's
own elements), so they shard, reshard and checkpoint as AdamW's do.

All element-wise arithmetic uses single-rounding ops (``mul``, ``add``, ``div``, ``sqrt``; never
``lerp`` / ``addcmul``, whose vectorised and scalar paths may differ by an FMA), so an element's
value never depends on where it sits in the shard; with [Note: fixed slots, the same numbers at
every world size] the state and updates are bit-identical at every world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import is_dbuffer
from ragged._errors import RaggedValueError, check_int
from ragged._pytree import pytree
from ragged.optim._base import GradientTransformation, Schedule, check_like_state, keywords_checked
from ragged.optim._count import next_count, zero_count
from ragged.optim._blocks import BlockRule, gather, scatter
from ragged.optim._precond import (
    SoapFactors,
    check_block,
    check_matrix_dtype,
    check_state,
    factors_of,
    init_factors,
    layouts,
    run_batches,
    wide,
)
from ragged.optim._transform import _check_beta, _check_nonneg
from ragged.spec import LeafLayout

__all__ = ["SoapState", "soap", "eigenbasis"]


class SoapState(NamedTuple):
    """State of :func:`soap`: ``count`` (steps taken, the skipped first one included), Adam's
    moments ``mu`` / ``nu`` (like the params: DBuffers; a block's in its eigenbasis) and one
    :class:`~ragged.optim.SoapFactors` per DBuffer (statistics and eigenbases per block).

    Examples:
        >>> import torch, ragged as rg
        >>> local = rg.shard(rg.make_plan({"w": torch.zeros(4, 4)}, rg.spec.Blocks(4, 4), world_size=1), {"w": torch.zeros(4, 4)}, rank=0)
        >>> state = rg.optim.soap(1e-3).init(local)
        >>> state.count, type(state.mu).__name__, type(state.factors).__name__
        (tensor(0), 'DBuffer', 'SoapFactors')
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    factors: Any


def eigenbasis(stats: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of symmetric ``stats`` (batched), columns by decreasing eigenvalue, as the
    reference computes them: ``eigh(S + 1e-30 I)``, retried in float64 if it fails.

    Examples:
        >>> import torch
        >>> from ragged.optim import eigenbasis
        >>> q = eigenbasis(torch.diag(torch.tensor([1.0, 3.0, 2.0])))
        >>> q.abs().argmax(0).tolist()      # the basis vectors of 3, 2, 1
        [1, 2, 0]
    """
    ridge = 1e-30 * torch.eye(stats.shape[-1], dtype=stats.dtype, device=stats.device)
    try:
        q = torch.linalg.eigh(stats + ridge).eigenvectors
    except torch.linalg.LinAlgError:
        if not torch.isfinite(stats).all():  # NaN / inf gradients: NaN updates (apply_if_finite skips them)
            return torch.full_like(stats, float("nan"))
        q = torch.linalg.eigh(stats.double() + ridge.double()).eigenvectors.to(stats.dtype)
    return q.flip(-1)


def _power_qr(stats, basis, nu, dim: int):
    """One power iteration of ``basis`` against ``stats`` and a QR, the columns first sorted by
    their eigenvalue estimates (and ``nu`` with them, along ``dim``)."""
    product = stats @ basis
    est = (product * basis).sum(-2)  # diag(Q^T S Q)
    order = torch.argsort(est, dim=-1, descending=True, stable=True)
    idx = order.unsqueeze(-1) if dim == -2 else order.unsqueeze(-2)
    nu = nu.gather(dim, idx.expand_as(nu))
    return torch.linalg.qr(product.gather(-1, order.unsqueeze(-2).expand_as(product))).Q, nu  # S (Q sorted)


class _Hyper(NamedTuple):
    b1: float
    b2: float
    eps: float
    sb: float
    md: torch.dtype
    normalize: bool
    refresh: bool


def _statistics(x, g, h: _Hyper):
    """``L = sb L + (1 - sb) G G^T``, ``R = sb R + (1 - sb) G^T G`` of a batch."""
    return (torch.baddbmm(x["L"], g, g.mT, beta=h.sb, alpha=1.0 - h.sb),
            torch.baddbmm(x["R"], g.mT, g, beta=h.sb, alpha=1.0 - h.sb))


def _first(h: _Hyper):
    """The first step of a batch of blocks: statistics from ``G``, bases by ``eigh``."""
    def fn(x):
        left, right = _statistics(x, x["G"].to(h.md), h)
        return {"L": left, "R": right, "QL": eigenbasis(left), "QR": eigenbasis(right)}

    return fn


def _adam(m, v, g, h: _Hyper):
    """Adam's moments and direction on a flat tensor, in single-rounding ops (elements move with
    the world size: see the module docstring)."""
    m = m * h.b1 + g * (1.0 - h.b1)
    v = v * h.b2 + (g * g) * (1.0 - h.b2)
    u = m / (v.sqrt() + h.eps)
    return m, v, (u.nan_to_num_(nan=0.0) if h.eps == 0 else u)


def _adam_batch(m, v, g, h: _Hyper):
    """The same on a batch of blocks, fused: there every element has one fixed place at every world
    size (see [Note: fixed slots, the same numbers at every world size]), so an FMA is harmless."""
    m = torch.lerp(m, g, 1.0 - h.b1)
    v = torch.mul(v, h.b2).addcmul_(g, g, value=1.0 - h.b2)
    u = torch.sqrt(v).add_(h.eps)
    u = torch.div(m, u, out=u)
    return m, v, (u.nan_to_num_(nan=0.0) if h.eps == 0 else u)


def _step(h: _Hyper):
    """A later step of a batch of blocks (see [Note: SOAP's step, as the reference code runs it])."""
    def fn(x):
        g, ql, qr = x["G"].to(h.md), x["QL"], x["QR"]
        w = x["M"].dtype
        m, v, d = _adam_batch(x["M"], x["V"], (ql.mT @ g @ qr).to(w), h)
        u = (ql @ d.to(h.md) @ qr.mT).to(w)
        if h.normalize:
            u = u / (u.square().mean((-2, -1), keepdim=True).sqrt() + 1e-30)
        left, right = _statistics(x, g, h)
        if h.refresh:
            original = ql @ m.to(h.md) @ qr.mT
            ql, v = _power_qr(left, ql, v, -2)
            qr, v = _power_qr(right, qr, v, -1)
            m = (ql.mT @ original @ qr).to(w)
        return {"M": m, "V": v, "U": u, "L": left, "R": right, "QL": ql, "QR": qr}

    return fn


def _buffer(g, mu, nu, f: SoapFactors, h: _Hyper, first: bool):
    """One DBuffer's step: ``(direction u (data, replicated), new mu, new nu, new factors)``."""
    w = wide(g.dtype)
    gd = g.data.to(w)
    if first:
        m_d, v_d, u_d = mu.data, nu.data, torch.zeros_like(gd)
        m_r, v_r, u_r = mu.replicated, nu.replicated, torch.zeros(g.replicated.shape, dtype=w, device=gd.device)
    else:
        m_d, v_d, u_d = _adam(mu.data, nu.data, gd, h)  # every element; the blocks' are overwritten below
        m_r, v_r, u_r = _adam(mu.replicated, nu.replicated, g.replicated.to(w), h)
    new = {"L": [], "R": [], "QL": [], "QR": []}
    for i, p in enumerate(f.layout.parts):
        x = {"G": gather(gd, p), "L": f.left_stats[i], "R": f.right_stats[i], "QL": f.left_basis[i],
             "QR": f.right_basis[i]}
        if not first:
            x.update(M=gather(mu.data, p), V=gather(nu.data, p))
        res = run_batches(p, x, _first(h) if first else _step(h))
        for k in new:
            new[k].append(res[k])
        if not first:
            scatter(m_d, p, res["M"])
            scatter(v_d, p, res["V"])
            scatter(u_d, p, res["U"])
    factors = SoapFactors(tuple(new["L"]), tuple(new["R"]), tuple(new["QL"]), tuple(new["QR"]), f.layout)
    return (u_d, u_r), mu.replace(data=m_d, replicated=m_r), nu.replace(data=v_d, replicated=v_r), factors


@keywords_checked
def soap(
    learning_rate: float | Schedule,
    b1: float = 0.95,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    shampoo_beta: float | None = None,
    precondition_frequency: int = 10,
    max_precondition_dim: int = 10000,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    block: int | tuple[int, int] | None = None,
    matrix_dtype: torch.dtype = torch.float32,
    precondition_filter: Callable[[LeafLayout], bool] | None = None,
) -> GradientTransformation:
    """SOAP over DBuffers: Adam in each block's Shampoo eigenbasis, on the rank holding the block,
    with no communication (see [Note: SOAP's step, as the reference code runs it]).

    The blocks are the plan's: each ``r x c`` tile of a ``spec.Blocks(r, c)`` leaf (see [Note:
    each granule's tiles are the blocks] in ``ragged/optim/_blocks.py``). Other leaves get SOAP's
    Adam; :func:`ragged.optim.preconditioned_leaves` (or the state's repr) says which and why.
    Defaults and names are the reference's (betas ``(0.95, 0.95)``, ``shampoo_beta`` = ``b2``,
    ``eps=1e-8``, ``weight_decay=0.01``, ``precondition_frequency=10``,
    ``max_precondition_dim=10000``); the reference's ``lr=3e-3`` is here a required argument.
    Results and state are bit-identical at every world size.

    Args:
        learning_rate: a float or a schedule ``count -> lr`` (count: steps so far).
        b1, b2: Adam's betas (the reference's ``betas``).
        eps: added to ``sqrt(v)``.
        weight_decay: decoupled, applied after the step to the updated parameters, as the
            reference does.
        shampoo_beta: decay of ``L`` and ``R`` (None: ``b2``).
        precondition_frequency: steps between refreshes of the eigenbases.
        max_precondition_dim: a leaf whose blocks have a side longer than this gets Adam.
        precondition_1d: precondition 1-D leaves planned with ``spec.Elements(n)`` as ``1 x n``
            blocks (the reference preconditions a 1-D parameter whole).
        normalize_grads: divide each block's direction by its RMS (the reference: each tensor's).
        correct_bias: Adam's bias correction.
        block: ``(r, c)`` (or ``b`` for ``b x b``): the block every matrix leaf must be planned
            with (``Blocks(r, c)``, or ``Rows(r)`` tiled ``r x c``); another plan is refused at
            ``init``. None: each leaf's own ``Blocks``.
        matrix_dtype: ``torch.float32`` (the reference's) or ``torch.float64`` for the
            statistics, eigenbases and projections.
        precondition_filter: ``LeafLayout -> bool``: leaves it rejects get Adam (e.g. embeddings;
            inside ``multi_transform``, the leaves of other labels).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> params = {"w": torch.randn(8, 8), "b": torch.zeros(8)}
        >>> plan = rg.make_plan(params, {"w": spec.Blocks(4, 4), "b": None}, world_size=2)
        >>> def fn(comm):
        ...     local = rg.shard(plan, params, comm)
        ...     opt = rg.optim.soap(3e-3, block=4)
        ...     state = opt.init(local)
        ...     for _ in range(3):
        ...         updates, state = opt.update(local, state, local)   # the params as gradients
        ...         local = rg.apply_updates(local, updates)
        ...     return int(state.count), rg.gather(local, comm)["w"].shape
        >>> rg.collectives.simulate(2, fn)
        [(3, torch.Size([8, 8])), (3, torch.Size([8, 8]))]
    """
    for name, beta in (("b1", b1), ("b2", b2)) + ((("shampoo_beta", shampoo_beta),) if shampoo_beta is not None else ()):
        _check_beta(f"soap: {name}", beta)
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        _check_nonneg(f"soap: {name}", value)
    rate = _check_nonneg("soap: learning_rate", learning_rate)
    rule = BlockRule("soap", check_block("soap", block), check_int("soap: max_precondition_dim", max_precondition_dim),
                     bool(precondition_1d), precondition_filter)
    check_int("soap: precondition_frequency", precondition_frequency)
    md = check_matrix_dtype("soap", matrix_dtype)
    sb = b2 if shampoo_beta is None else shampoo_beta
    scheduled = callable(rate)

    def init(params):
        bufs, lays, treedef = layouts(params, rule)
        zeros = lambda d: d.replace(data=torch.zeros(d.data.shape, dtype=wide(d.dtype), device=d.data.device),  # noqa: E731
                                    replicated=torch.zeros(d.replicated.shape, dtype=wide(d.dtype), device=d.data.device))
        factors = [init_factors(SoapFactors, lay, md, d.data.device, eye_derived=False) for d, lay in zip(bufs, lays)]
        return SoapState(count=zero_count(params), mu=pytree.unflatten(treedef, [zeros(d) for d in bufs]),
                         nu=pytree.unflatten(treedef, [zeros(d) for d in bufs]), factors=pytree.unflatten(treedef, factors))

    def update(updates, state, params=None):
        if weight_decay and params is None:
            raise RaggedValueError("soap with weight_decay needs the params: call opt.update(grads, opt_state, params).")
        bufs, _, treedef = layouts(updates, rule)
        check_like_state(updates, state.mu, "soap")
        fs = factors_of(state.factors)
        check_state(rule, bufs, fs)
        t = int(state.count)  # the Adam step this call takes (0: the first call, which only fills L, R and Q)
        h = _Hyper(b1, b2, eps, sb, md, normalize_grads, t > 0 and t % precondition_frequency == 0)
        lr = rate(state.count) if scheduled else rate
        size = (lr * (1.0 - b2**t) ** 0.5 / (1.0 - b1**t) if correct_bias else lr) if t else 0.0
        ps = pytree.leaves(params, is_leaf=is_dbuffer) if weight_decay else [None] * len(bufs)
        mus, nus = pytree.leaves(state.mu, is_leaf=is_dbuffer), pytree.leaves(state.nu, is_leaf=is_dbuffer)
        out = []
        for g, mu, nu, f, p in zip(bufs, mus, nus, fs, ps):
            (u_d, u_r), mu, nu, f = _buffer(g, mu, nu, f, h, first=t == 0)
            out.append((_finish(g, u_d, u_r, p, size, lr * weight_decay if t else 0.0), mu, nu, f))
        unflat = lambda i: pytree.unflatten(treedef, [o[i] for o in out])  # noqa: E731
        return unflat(0), SoapState(count=next_count(state.count), mu=unflat(1), nu=unflat(2), factors=unflat(3))

    return GradientTransformation(init, update)


def _finish(g, u_d, u_r, p, size, decay):
    """``-size u``, then the reference's decay of the updated parameters: ``- decay (p - size u)``."""
    def one(u, pt):
        out = u * -size
        if decay and pt is not None:
            out = out - (pt.detach().to(out.dtype) + out) * decay
        return out

    return g.replace(data=one(u_d, p.data if p is not None else None),
                     replicated=one(u_r, p.replicated if p is not None else None))
