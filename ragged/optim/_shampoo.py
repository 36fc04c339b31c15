"""Shampoo (Gupta et al. 2018; Anil et al. 2020) as Distributed Shampoo runs it (Shi et al. 2023,
facebookresearch/optimizers), block-diagonal over the plan's blocks, each block on the rank that
holds it.

[Note: Shampoo's step, as Distributed Shampoo runs it]
Per block ``G`` (``r x c``; see [Note: each granule's tiles are the blocks] in ``_blocks.py``), at
step ``t = 1, 2, ...``:

* statistics: ``L = b2 L + w G G^T``, ``R = b2 R + w G^T G`` with ``w = 1 - b2`` (``w = 1`` when
  ``b2 = 1``: AdaGrad-like sums);
* every ``precondition_frequency`` steps from ``start_preconditioning_step`` on (and at it), the
  inverse roots ``X_L = (L / bc2)^(-e)``, ``X_R = (R / bc2)^(-e)`` by a symmetric
  eigendecomposition ``A + matrix_eps I = Q diag(lambda) Q^T`` in ``matrix_dtype``, the
  eigenvalues shifted up to ``matrix_eps`` when the smallest is below it (``lambda - lambda_min +
  matrix_eps``), ``X = Q diag(lambda^(-e)) Q^T``. ``bc2 = 1 - b2^t`` (1 for ``b2 = 1`` or without
  bias correction); ``e`` = 1/4 for a 2-D block (Distributed Shampoo's ``1 / (2 * order)``) or
  ``inverse_exponent_override``;
* the filtered gradient ``m = b1 m + (1 - b1) G``, ``G_bar = m / (1 - b1^t)`` (``G`` when ``b1 = 0``);
* the grafting direction, element-wise: Adam's ``G_bar / (sqrt(v / (1 - gb2^t)) + grafting_eps)``
  with ``v = gb2 v + (1 - gb2) G^2``, or SGD's ``G_bar``;
* the direction: before ``start_preconditioning_step``, the grafting direction; after, ``P =
  X_L G_bar X_R``, scaled per block to the grafting direction's norm, ``P |D| / (|P| + 1e-16)``
  (``grafting=None``: ``P`` as is);
* the update: ``-lr (P + weight_decay p)`` (decoupled weight decay).

Leaves without blocks get the grafting direction (Adam by default). Defaults: Distributed
Shampoo's README recipe for replacing AdamW (betas ``(0.9, 0.999)``, ``epsilon=1e-12``, Adam
grafting with ``beta2=0.999, epsilon=1e-8``, ``precondition_frequency=100``,
``max_preconditioner_dim=8192``); its constructor's ``start_preconditioning_step=-1`` rule
(= ``precondition_frequency``). Element-wise arithmetic uses single-rounding ops only (see
``_soap.py``), so results are bit-identical at every world size.
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
    ShampooFactors,
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

__all__ = ["ShampooState", "shampoo", "inverse_root"]

GRAFTINGS = ("adam", "sgd", None)


class ShampooState(NamedTuple):
    """State of :func:`shampoo`: ``count`` (steps taken), the filtered gradient ``mu`` (None when
    ``b1 = 0``), Adam grafting's second moment ``graft_nu`` (None for SGD or no grafting), both
    like the params (DBuffers), and one :class:`~ragged.optim.ShampooFactors` per DBuffer.

    Examples:
        >>> import torch, ragged as rg
        >>> local = rg.shard(rg.make_plan({"w": torch.zeros(4, 4)}, rg.spec.Blocks(4, 4), world_size=1), {"w": torch.zeros(4, 4)}, rank=0)
        >>> state = rg.optim.shampoo(1e-3, grafting="sgd").init(local)
        >>> type(state.mu).__name__, state.graft_nu, type(state.factors).__name__
        ('DBuffer', None, 'ShampooFactors')
    """

    count: torch.Tensor
    mu: Any
    graft_nu: Any
    factors: Any


def inverse_root(stats: torch.Tensor, exponent: float, eps: float) -> torch.Tensor:
    """``(S + eps I)^(-exponent)`` of symmetric PSD ``S`` (batched) by eigendecomposition, the
    eigenvalues shifted up to ``eps`` where the smallest is below it, as Distributed Shampoo does
    (retried in float64 if the eigendecomposition fails).

    Examples:
        >>> import torch
        >>> from ragged.optim import inverse_root
        >>> inverse_root(torch.diag(torch.tensor([16.0, 1.0])), 0.25, 0.0)
        tensor([[0.5000, 0.0000],
                [0.0000, 1.0000]])
    """
    eye = torch.eye(stats.shape[-1], dtype=stats.dtype, device=stats.device)
    ridged = stats + eye * eps
    try:
        lam, q = torch.linalg.eigh(ridged)
    except torch.linalg.LinAlgError:
        if not torch.isfinite(stats).all():  # NaN / inf gradients: NaN updates (apply_if_finite skips them)
            return torch.full_like(stats, float("nan"))
        lam, q = (t.to(stats.dtype) for t in torch.linalg.eigh(ridged.double()))
    low = lam.amin(-1, keepdim=True)
    lam = torch.where(low < eps, (lam - low) + eps, lam)
    return (q * lam.pow(-exponent).unsqueeze(-2)) @ q.mT


class _Hyper(NamedTuple):
    b2: float
    weight: float
    bc2: float
    eps: float
    exponent: float
    md: torch.dtype
    root: bool
    precondition: bool
    graft: bool


def _blocks_step(h: _Hyper):
    """One step of a batch of blocks (see [Note: Shampoo's step, as Distributed Shampoo runs it])."""
    def fn(x):
        g = x["G"].to(h.md)
        left = torch.baddbmm(x["L"], g, g.mT, beta=h.b2, alpha=h.weight)
        right = torch.baddbmm(x["R"], g.mT, g, beta=h.b2, alpha=h.weight)
        xl, xr = x["XL"], x["XR"]
        if h.root:
            xl = inverse_root(left / h.bc2, h.exponent, h.eps)
            xr = inverse_root(right / h.bc2, h.exponent, h.eps)
        out = {"L": left, "R": right, "XL": xl, "XR": xr}
        if h.precondition:
            d = x["D"]
            p = (xl @ x["Gbar"].to(h.md) @ xr).to(d.dtype)
            if h.graft:
                norms = lambda t: torch.linalg.vector_norm(t, dim=(-2, -1), keepdim=True)  # noqa: E731
                p = p * (norms(d) / (norms(p) + 1e-16))
            out["P"] = p
        return out

    return fn


def _directions(g, mu, gnu, t: int, b1: float, gb2: float | None, geps: float, bias: bool):
    """Element-wise, on one flat tensor: ``(new mu, new graft_nu, G_bar, grafting direction)``."""
    if mu is not None:
        mu = mu * b1 + g * (1.0 - b1)
        gbar = mu / (1.0 - b1**t) if bias else mu
    else:
        gbar = g
    if gnu is None:
        return mu, None, gbar, gbar
    gnu = gnu * gb2 + (g * g) * (1.0 - gb2)
    d = gbar / ((gnu / (1.0 - gb2**t)).sqrt() + geps)
    return mu, gnu, gbar, (d.nan_to_num_(nan=0.0) if geps == 0 else d)


def _buffer(g, mu, gnu, f: ShampooFactors, h: _Hyper, flat: dict):
    """One DBuffer's step: ``(direction (data, replicated), new mu, new graft_nu, new factors)``."""
    w = wide(g.dtype)
    gd, gr = g.data.to(w), g.replicated.to(w)
    mu_d, gnu_d, gbar_d, d_d = _directions(gd, None if mu is None else mu.data, None if gnu is None else gnu.data, **flat)
    mu_r, gnu_r, _, d_r = _directions(gr, None if mu is None else mu.replicated,
                                      None if gnu is None else gnu.replicated, **flat)
    p_d = d_d.clone() if h.precondition else d_d
    new = {"L": [], "R": [], "XL": [], "XR": []}
    for i, p in enumerate(f.layout.parts):
        x = {"G": gather(gd, p), "L": f.left_stats[i], "R": f.right_stats[i], "XL": f.left_root[i], "XR": f.right_root[i]}
        if h.precondition:
            x.update(Gbar=gather(gbar_d, p), D=gather(d_d, p))
        res = run_batches(p, x, _blocks_step(h))
        for k in new:
            new[k].append(res[k])
        if h.precondition:
            scatter(p_d, p, res["P"])
    factors = ShampooFactors(tuple(new["L"]), tuple(new["R"]), tuple(new["XL"]), tuple(new["XR"]), f.layout)
    mu = None if mu is None else mu.replace(data=mu_d, replicated=mu_r)
    gnu = None if gnu is None else gnu.replace(data=gnu_d, replicated=gnu_r)
    return (p_d, d_r), mu, gnu, factors


@keywords_checked
def shampoo(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    matrix_eps: float = 1e-12,
    weight_decay: float = 0.0,
    *,
    precondition_frequency: int = 100,
    start_preconditioning_step: int | None = None,
    grafting: str | None = "adam",
    grafting_b2: float = 0.999,
    grafting_eps: float = 1e-8,
    use_bias_correction: bool = True,
    inverse_exponent_override: float | None = None,
    max_precondition_dim: int = 8192,
    block: int | tuple[int, int] | None = None,
    matrix_dtype: torch.dtype = torch.float32,
    precondition_filter: Callable[[LeafLayout], bool] | None = None,
) -> GradientTransformation:
    """Block-diagonal Shampoo over DBuffers, each block's preconditioner on the rank that holds it,
    with no communication (see [Note: Shampoo's step, as Distributed Shampoo runs it]).

    The blocks are the plan's (see [Note: each granule's tiles are the blocks] in
    ``ragged/optim/_blocks.py``); other leaves get the grafting direction, and
    :func:`ragged.optim.preconditioned_leaves` says which and why. Results and state are
    bit-identical at every world size.

    Args:
        learning_rate: a float or a schedule ``count -> lr`` (count: steps so far).
        b1: decay of the filtered gradient (Distributed Shampoo's ``betas[0]``; 0: none).
        b2: decay of the statistics, in [0, 1] (``betas[1]``; 1: sums, as AdaGrad).
        matrix_eps: the eigenvalue floor of the roots (Distributed Shampoo's ``epsilon``).
        weight_decay: decoupled weight decay.
        precondition_frequency: steps between recomputations of the inverse roots.
        start_preconditioning_step: the first step that uses Shampoo's direction (and computes
            the first roots); None: ``precondition_frequency``. At least that.
        grafting: ``"adam"``, ``"sgd"`` or None (no grafting): the per-block norm of the
            direction, and the direction before ``start_preconditioning_step`` and of the leaves
            without blocks.
        grafting_b2, grafting_eps: Adam grafting's ``beta2`` and ``epsilon``.
        use_bias_correction: bias-correct the filtered gradient and the statistics.
        inverse_exponent_override: the root's exponent ``e`` in ``X = A^(-e)`` (default 1/4).
        max_precondition_dim: a leaf whose blocks have a side longer than this is not
            preconditioned (Distributed Shampoo's ``max_preconditioner_dim``).
        block: ``(r, c)`` (or ``b``): the block every matrix leaf must be planned with; another
            plan is refused at ``init``. None: each leaf's own ``Blocks``.
        matrix_dtype: ``torch.float32`` (Distributed Shampoo's default) or ``torch.float64`` for
            the statistics and roots.
        precondition_filter: ``LeafLayout -> bool``: leaves it rejects get the grafting direction.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import spec
        >>> params = {"w": torch.randn(8, 8), "b": torch.zeros(8)}
        >>> plan = rg.make_plan(params, {"w": spec.Blocks(4, 4), "b": None}, world_size=2)
        >>> def fn(comm):
        ...     local = rg.shard(plan, params, comm)
        ...     opt = rg.optim.shampoo(1e-3, precondition_frequency=2)
        ...     state = opt.init(local)
        ...     for _ in range(3):
        ...         updates, state = opt.update(local, state, local)
        ...         local = rg.apply_updates(local, updates)
        ...     return int(state.count)
        >>> rg.collectives.simulate(2, fn)
        [3, 3]
    """
    _check_beta("shampoo: b1", b1)
    if not isinstance(b2, (int, float)) or isinstance(b2, bool) or not 0.0 <= b2 <= 1.0:
        raise RaggedValueError(f"shampoo: b2 must be a float in [0, 1], got {b2!r}.")
    _check_beta("shampoo: grafting_b2", grafting_b2)
    for name, value in (("matrix_eps", matrix_eps), ("weight_decay", weight_decay), ("grafting_eps", grafting_eps)):
        _check_nonneg(f"shampoo: {name}", value)
    rate = _check_nonneg("shampoo: learning_rate", learning_rate)
    if grafting not in GRAFTINGS:
        raise RaggedValueError(f"shampoo: grafting must be one of {GRAFTINGS}, got {grafting!r}.")
    freq = check_int("shampoo: precondition_frequency", precondition_frequency)
    start = freq if start_preconditioning_step is None else check_int("shampoo: start_preconditioning_step",
                                                                     start_preconditioning_step)
    if start < freq:
        raise RaggedValueError(f"shampoo: start_preconditioning_step ({start}) must be at least precondition_frequency "
                               f"({freq}), as in Distributed Shampoo.")
    exponent = 0.25 if inverse_exponent_override is None else inverse_exponent_override
    if not isinstance(exponent, (int, float)) or isinstance(exponent, bool) or not exponent > 0:
        raise RaggedValueError(f"shampoo: inverse_exponent_override must be a float > 0, got {exponent!r}.")
    rule = BlockRule("shampoo", check_block("shampoo", block), check_int("shampoo: max_precondition_dim",
                                                                         max_precondition_dim), False, precondition_filter)
    md = check_matrix_dtype("shampoo", matrix_dtype)
    scheduled = callable(rate)

    def init(params):
        bufs, lays, treedef = layouts(params, rule)
        zeros = lambda d: d.replace(data=torch.zeros(d.data.shape, dtype=wide(d.dtype), device=d.data.device),  # noqa: E731
                                    replicated=torch.zeros(d.replicated.shape, dtype=wide(d.dtype), device=d.data.device))
        tree = lambda on: pytree.unflatten(treedef, [zeros(d) for d in bufs]) if on else None  # noqa: E731
        factors = [init_factors(ShampooFactors, lay, md, d.data.device, eye_derived=True) for d, lay in zip(bufs, lays)]
        return ShampooState(count=zero_count(params), mu=tree(b1 > 0), graft_nu=tree(grafting == "adam"),
                            factors=pytree.unflatten(treedef, factors))

    def update(updates, state, params=None):
        if weight_decay and params is None:
            raise RaggedValueError("shampoo with weight_decay needs the params: call opt.update(grads, opt_state, params).")
        bufs, _, treedef = layouts(updates, rule)
        fs = factors_of(state.factors)
        check_state(rule, bufs, fs)
        t = int(state.count) + 1
        bc2 = 1.0 - b2**t if use_bias_correction and b2 < 1.0 else 1.0
        h = _Hyper(b2, 1.0 - b2 if b2 < 1.0 else 1.0, bc2, matrix_eps, exponent, md,
                   root=(t % freq == 0 and t > start) or t == start, precondition=t >= start, graft=grafting is not None)
        flat = dict(t=t, b1=b1, gb2=grafting_b2, geps=grafting_eps, bias=use_bias_correction)
        lr = rate(state.count) if scheduled else rate
        none = [None] * len(bufs)
        mus = pytree.leaves(state.mu, is_leaf=is_dbuffer) if state.mu is not None else none
        gnus = pytree.leaves(state.graft_nu, is_leaf=is_dbuffer) if state.graft_nu is not None else none
        ps = pytree.leaves(params, is_leaf=is_dbuffer) if weight_decay else none
        if state.mu is not None:
            check_like_state(updates, state.mu, "shampoo")
        out = []
        for g, mu, gnu, f, p in zip(bufs, mus, gnus, fs, ps):
            (p_d, p_r), mu, gnu, f = _buffer(g, mu, gnu, f, h, flat)
            upd = g.replace(data=_scale(p_d, p, "data", lr, weight_decay), replicated=_scale(p_r, p, "replicated", lr,
                                                                                           weight_decay))
            out.append((upd, mu, gnu, f))
        unflat = lambda i: pytree.unflatten(treedef, [o[i] for o in out])  # noqa: E731
        return unflat(0), ShampooState(count=next_count(state.count), mu=unflat(1) if state.mu is not None else None,
                                       graft_nu=unflat(2) if state.graft_nu is not None else None, factors=unflat(3))

    return GradientTransformation(init, update)


def _scale(direction, p, which: str, lr, weight_decay):
    """``-lr (direction + weight_decay p)``."""
    if weight_decay and p is not None:
        direction = direction + getattr(p, which).detach().to(direction.dtype) * weight_decay
    return direction * -lr
