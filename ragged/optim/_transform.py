"""Gradient transformations: the building blocks that ``_alias`` chains into optimizers.

Every transform maps over pytrees through :data:`ragged.pytree`, so on a
:class:`~ragged.DBuffer` each element-wise step is one kernel per flat buffer (see
[Note: one kernel per buffer] in ``_base.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ragged._pytree import pytree
from ragged.optim._base import (EmptyState, GradientTransformation, Schedule, check_floating, check_like_state,
                                check_rate, checked_schedule, keywords_checked)
from ragged.optim._count import next_count, zero_count
from ragged._errors import RaggedValueError

__all__ = [
    "ScaleState",
    "ScaleByScheduleState",
    "ScaleByAdamState",
    "TraceState",
    "AddDecayedWeightsState",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "scale_by_adam",
    "scale_by_adamw",
    "trace",
    "add_decayed_weights",
]

ScaleState = EmptyState
AddDecayedWeightsState = EmptyState


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: ``count`` updates applied so far (0-d int64).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.scale_by_schedule(lambda count: 0.1)
        >>> opt.update(torch.ones(1), opt.init(torch.zeros(1)))[1]
        ScaleByScheduleState(count=tensor(1))
    """

    count: torch.Tensor


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: step count and first/second moments like the params.

    Examples:
        >>> import torch, ragged as rg
        >>> rg.optim.scale_by_adam().init(torch.zeros(2))
        ScaleByAdamState(count=tensor(0), mu=tensor([0., 0.]), nu=tensor([0., 0.]))
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class TraceState(NamedTuple):
    """State of :func:`trace`: the momentum buffer, like the params.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.trace(0.9)
        >>> opt.update(torch.ones(2), opt.init(torch.zeros(2)))[1]
        TraceState(trace=tensor([1., 1.]))
    """

    trace: Any


def _wide(u: torch.Tensor) -> torch.Tensor:
    """``u`` in at least float32: bf16 / fp16 gradients give fp32 updates (mixed precision)."""
    return u.to(torch.float32) if u.is_floating_point() and u.element_size() < 4 else u


def _check_nonneg(name: str, value):
    """``value`` if it is a finite number >= 0 (NaN, inf, negative and non-numbers are refused,
    naming the hyperparameter), or, when it is callable, the schedule with each value it returns
    checked as an update computes it (:func:`~ragged.optim._base.checked_schedule`)."""
    if callable(value):
        return checked_schedule(name, value)
    check_rate(name, value)
    return value


def _check_beta(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise RaggedValueError(f"{name} must be a float in [0, 1), got {value!r}.")


def _check_adam(b1, b2, eps, weight_decay=0.0) -> None:
    _check_beta("b1", b1)
    _check_beta("b2", b2)
    _check_nonneg("eps", eps)
    _check_nonneg("weight_decay", weight_decay)


def _mul(u: torch.Tensor, factor, donate: bool) -> torch.Tensor:
    """``u * factor`` in the wide dtype; in place into ``u`` when donated and already wide."""
    wide = _wide(u)
    if isinstance(factor, torch.Tensor):
        factor = factor.to(wide.dtype)
    if donate and wide is u and not u.requires_grad:
        return u.mul_(factor)
    return wide * factor


@keywords_checked
def scale(step_size: float, *, donate: bool = False) -> GradientTransformation:
    """Multiplies updates by ``step_size`` (in place into the updates with ``donate=True``).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.scale(-2.0)
        >>> opt.update(torch.ones(2), opt.init(torch.ones(2)))[0]
        tensor([-2., -2.])
    """

    def init(params):
        del params
        return ScaleState()

    def update(updates, state, params=None):
        del params
        return pytree.map(lambda u: _mul(u, step_size, donate), updates), state

    return GradientTransformation(init, update, donates=donate)


@keywords_checked
def scale_by_schedule(step_size_fn: Schedule, *, donate: bool = False) -> GradientTransformation:
    """Multiplies updates by ``step_size_fn(count)``; ``count`` starts at 0 (in place into the
    updates with ``donate=True``).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.scale_by_schedule(lambda c: c + 1)
        >>> state = opt.init(torch.ones(1))
        >>> u, state = opt.update(torch.ones(1), state)
        >>> u, state = opt.update(torch.ones(1), state)
        >>> u
        tensor([2.])
    """

    def init(params):
        return ScaleByScheduleState(count=zero_count(params))

    def update(updates, state, params=None):
        del params
        factor = step_size_fn(state.count)
        updates = pytree.map(lambda u: _mul(u, factor, donate), updates)
        return updates, ScaleByScheduleState(count=next_count(state.count))

    return GradientTransformation(init, update, donates=donate)


@keywords_checked
def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True, donate: bool = False
) -> GradientTransformation:
    """Scales updates by ``-learning_rate`` (a float, or a schedule of the step count); in place
    into the updates with ``donate=True``.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.scale_by_learning_rate(0.5)
        >>> opt.update(torch.ones(2), opt.init(torch.ones(2)))[0]
        tensor([-0.5000, -0.5000])
    """
    rate = _check_nonneg("learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0
    if callable(rate):
        return scale_by_schedule(lambda count: sign * rate(count), donate=donate)
    return scale(sign * rate, donate=donate)


def _adam_step(g, m, v, *, b1, b2, eps, bc2_sqrt, step, decay, p, donate):
    """One Adam step on one flat tensor: returns ``(update, new m, new v)``.

    ``update = step * m_hat / (sqrt(v_hat) + eps) + decay * p`` (``step``/``decay`` 0-d tensors
    or floats; ``decay`` may be ``None``). With ``donate`` the moments are updated in place and
    the update is written into ``g`` (when dtypes allow). Otherwise three tensors are allocated
    (new m, new v, the update) and nothing is modified: on CPU, fresh memory costs a page-fault
    pass, so fewer temporaries is most of the speed (see bench/optim.py).
    """
    if donate:
        m_new = m.lerp_(g.to(m.dtype), 1.0 - b1)
        v_new = v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    else:
        m_new = torch.lerp(m, g.to(m.dtype), 1.0 - b1)
        v_new = torch.mul(v, b2).addcmul_(g, g, value=1.0 - b2)
    out = g if donate and g.dtype == m.dtype and not g.requires_grad else torch.empty_like(m)
    torch.sqrt(v_new, out=out)
    out.div_(bc2_sqrt).add_(eps)
    torch.div(m_new, out, out=out)
    if eps == 0:
        out.nan_to_num_(nan=0.0)  # 0 / 0 on all-zero state (padding)
    out.mul_(step)
    if decay is not None:
        out.addcmul_(p.to(out.dtype), decay)
    return out, m_new, v_new


def _adam_init(params, where: str) -> ScaleByAdamState:
    check_floating(params, where)
    return ScaleByAdamState(count=zero_count(params), mu=pytree.map(torch.zeros_like, params),
                            nu=pytree.map(torch.zeros_like, params))


def _adam_tree(updates, state: ScaleByAdamState, params, *, b1, b2, eps, lr, decay, donate):
    """:func:`_adam_step` on every leaf with ``step = lr / (1 - b1^t)``: the updates and the new
    state. ``params`` is read only when ``decay`` is not ``None``."""
    count = next_count(state.count)
    t = count.to(torch.float64)
    step, bc2_sqrt = lr / (1.0 - b1**t), torch.sqrt(1.0 - b2**t)
    if isinstance(decay, float):  # a fill on the device, not a copy from the host (a host sync)
        decay = torch.full((), decay, dtype=torch.float64, device=count.device)
    g_leaves, treedef = pytree.flatten(updates)
    p_leaves = [None] * len(g_leaves) if decay is None else pytree.leaves(params)
    outs = [
        _adam_step(g, m, v, b1=b1, b2=b2, eps=eps, bc2_sqrt=bc2_sqrt, step=step, decay=decay, p=p, donate=donate)
        for g, m, v, p in zip(g_leaves, pytree.leaves(state.mu), pytree.leaves(state.nu), p_leaves)
    ]
    unflat = lambda i: pytree.unflatten(treedef, [o[i] for o in outs])  # noqa: E731
    return unflat(0), ScaleByAdamState(count=count, mu=unflat(1), nu=unflat(2))


@keywords_checked
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, donate: bool = False) -> GradientTransformation:
    """Rescales updates by Adam's bias-corrected moments: ``m_hat / (sqrt(v_hat) + eps)``.

    The arithmetic follows ``torch.optim.AdamW``: ``m = lerp(m, g, 1 - b1)``,
    ``v = b2 v + (1 - b2) g^2``, ``v_hat`` is ``sqrt(v) / sqrt(1 - b2^t)`` and ``eps`` is added
    after the square root. A zero gradient on zero state gives a zero update (padding stays
    zero); with ``eps == 0`` such elements are set to 0 instead of NaN.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
        donate: reuse the buffers of the state and of the updates passed to ``update`` (like
            ``jax.jit(donate_argnums=...)``): no allocation per step, but the caller must not
            read the old state or the gradients after the call.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.scale_by_adam()
        >>> g = torch.tensor([3.0, 0.0], dtype=torch.float64)
        >>> u, state = opt.update(g, opt.init(torch.zeros_like(g)))
        >>> [round(x, 6) for x in u.tolist()], int(state.count)
        ([1.0, 0.0], 1)
    """
    _check_adam(b1, b2, eps)

    def update(updates, state, params=None):
        del params
        check_like_state(updates, state.mu, "scale_by_adam")
        check_like_state(updates, state.nu, "scale_by_adam")
        return _adam_tree(updates, state, None, b1=b1, b2=b2, eps=eps, lr=1.0, decay=None, donate=donate)

    return GradientTransformation(lambda params: _adam_init(params, "scale_by_adam"), update, donates=donate)


@keywords_checked
def scale_by_adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    donate: bool = False,
) -> GradientTransformation:
    """``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)`` fused into one pass.

    Same results and the same state structure (a 3-tuple of those transforms' states) as the
    chain, with one read of each buffer and at most three allocations per buffer (none with
    ``donate=True``; see :func:`scale_by_adam`). :func:`ragged.optim.adamw` uses it.

    Examples:
        >>> import torch, ragged as rg
        >>> fused = rg.optim.scale_by_adamw(0.1, weight_decay=0.5)
        >>> chained = rg.optim.chain(rg.optim.scale_by_adam(), rg.optim.add_decayed_weights(0.5),
        ...                          rg.optim.scale_by_learning_rate(0.1))
        >>> p, g = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])
        >>> torch.allclose(fused.update(g, fused.init(p), p)[0], chained.update(g, chained.init(p), p)[0])
        True
    """
    _check_adam(b1, b2, eps, weight_decay)
    rate = _check_nonneg("learning_rate", learning_rate)
    scheduled = callable(rate)

    def init(params):
        adam = _adam_init(params, "adamw")
        lr_state = ScaleByScheduleState(count=zero_count(params)) if scheduled else ScaleState()
        return (adam, AddDecayedWeightsState(), lr_state)

    def update(updates, state, params=None):
        adam, decay_state, lr_state = state
        if weight_decay and params is None:
            raise RaggedValueError("adamw with weight_decay needs the params: call opt.update(grads, opt_state, params).")
        check_like_state(updates, adam.mu, "adamw")
        check_like_state(updates, adam.nu, "adamw")
        if weight_decay:
            check_like_state(params, adam.mu, "adamw", what="params")
        lr = rate(lr_state.count) if scheduled else rate
        decay = (-lr * weight_decay) if weight_decay else None
        updates, adam = _adam_tree(updates, adam, params, b1=b1, b2=b2, eps=eps, lr=-lr, decay=decay, donate=donate)
        new_lr_state = ScaleByScheduleState(count=next_count(lr_state.count)) if scheduled else lr_state
        return updates, (adam, decay_state, new_lr_state)

    hyperparams = {"optimizer": "AdamW", "lr": learning_rate, "betas": (b1, b2), "eps": eps, "weight_decay": weight_decay}
    return GradientTransformation(init, update, donates=donate, hyperparams=hyperparams)


@keywords_checked
def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = g + decay * t``; returns ``t`` (or ``g + decay * t`` with Nesterov).

    Matches ``torch.optim.SGD``'s momentum buffer with ``dampening=0`` (the buffer starts at
    the first gradient because it starts at zero).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.trace(0.5)
        >>> s = opt.init(torch.zeros(1))
        >>> u, s = opt.update(torch.ones(1), s)
        >>> u, s = opt.update(torch.ones(1), s)
        >>> u
        tensor([1.5000])
    """
    _check_beta("decay", decay)

    def init(params):
        check_floating(params, "trace")
        return TraceState(trace=pytree.map(torch.zeros_like, params))

    def update(updates, state, params=None):
        del params
        check_like_state(updates, state.trace, "trace")
        new = pytree.map(lambda g, t: g + t * decay, updates, state.trace)
        out = pytree.map(lambda g, t: g + t * decay, updates, new) if nesterov else new
        return out, TraceState(trace=new)

    return GradientTransformation(init, update)


@keywords_checked
def add_decayed_weights(weight_decay: float = 0.0, *, donate: bool = False) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates (decoupled weight decay when chained
    before :func:`scale_by_learning_rate`, as in ``torch.optim.AdamW``); in place into the
    updates with ``donate=True``.

    Zero parameters (padding) add zero. Restrict it to some leaves with
    :func:`ragged.optim.masked`.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.add_decayed_weights(0.1)
        >>> opt.update(torch.zeros(2), opt.init(None), torch.tensor([1.0, 0.0]))[0]
        tensor([0.1000, 0.0000])
    """
    _check_nonneg("weight_decay", weight_decay)

    def init(params):
        del params
        return AddDecayedWeightsState()

    def update(updates, state, params=None):
        if weight_decay == 0:
            return updates, state
        if params is None:
            raise RaggedValueError(
                "add_decayed_weights needs the params: call opt.update(grads, opt_state, params)."
            )
        if donate:
            return pytree.map(lambda u, p: u.add_(p.to(u.dtype) * weight_decay), updates, params), state
        return pytree.map(lambda u, p: u + p.to(u.dtype) * weight_decay, updates, params), state

    return GradientTransformation(init, update, donates=donate)
