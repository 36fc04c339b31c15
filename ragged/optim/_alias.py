"""Ready-made optimizers built by chaining transforms (optax's ``alias.py``)."""

from __future__ import annotations

from ragged.optim._base import GradientTransformation, Schedule, check_floating, keywords_checked
from ragged.optim._combine import chain, masked
from ragged.optim._transform import (
    _check_beta,
    _check_nonneg,
    add_decayed_weights,
    scale_by_adam,
    scale_by_adamw,
    scale_by_learning_rate,
    trace,
)
from ragged._errors import RaggedValueError

__all__ = ["sgd", "adam", "adamw"]


@keywords_checked
def sgd(
    learning_rate: float | Schedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    donate: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with optional (Nesterov) momentum.

    Matches ``torch.optim.SGD(lr, momentum, nesterov=..., weight_decay=...)`` with
    ``dampening=0``: weight decay is coupled (added to the gradient before momentum).

    Args:
        learning_rate: a float or a schedule ``count -> lr``.
        momentum: momentum decay, or ``None`` for plain SGD.
        nesterov: use Nesterov momentum.
        weight_decay: L2 coefficient added to the gradient (torch.optim.SGD semantics).
        donate: write the update into the gradient buffer passed to ``update`` (the gradients
            must not be read after it; the momentum trace is new each step).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.sgd(0.1, momentum=0.9)
        >>> p = torch.tensor([1.0])
        >>> s = opt.init(p)
        >>> for _ in range(2):
        ...     u, s = opt.update(torch.tensor([1.0]), s, p)
        ...     p = rg.optim.apply_updates(p, u)
        >>> p
        tensor([0.7100])
    """
    _check_nonneg("sgd: learning_rate", learning_rate)
    _check_nonneg("sgd: weight_decay", weight_decay)
    if momentum is not None:
        _check_beta("sgd: momentum", momentum)
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay, donate=donate))
    if momentum is not None and momentum != 0:
        parts.append(trace(momentum, nesterov=nesterov))
    elif nesterov:
        raise RaggedValueError("nesterov=True needs a momentum > 0 (as in torch.optim.SGD).")
    parts.append(scale_by_learning_rate(learning_rate, donate=donate))
    opt = chain(*parts)

    def init(params):
        check_floating(params, "sgd")
        return opt.init(params)

    return GradientTransformation(init, opt.update, donates=opt.donates, collectives=opt.collectives)


@keywords_checked
def adam(
    learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, donate: bool = False
) -> GradientTransformation:
    """Adam (``torch.optim.Adam`` without weight decay).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.adam(0.1)
        >>> u, _ = opt.update(torch.tensor([2.0, -3.0]), opt.init(torch.zeros(2)))
        >>> u
        tensor([-0.1000,  0.1000])
    """
    return scale_by_adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=0.0, donate=donate)


@keywords_checked
def adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    mask=None,
    donate: bool = False,
) -> GradientTransformation:
    """AdamW with decoupled weight decay: ``torch.optim.AdamW``'s step, optax's signature.

    One step is ``p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``, which is
    torch's ``p *= 1 - lr * wd`` followed by the Adam step, with the same bias corrections (and
    optax's ``adamw``, whose decay is also scaled by the learning rate).

    Defaults: ``b1=0.9``, ``b2=0.999``, ``eps=1e-8`` are torch's and optax's alike;
    ``learning_rate`` has none, as in optax (torch: ``lr=1e-3``). ``weight_decay=0.0`` is
    neither torch's (``0.01``) nor optax's (``1e-4``): ragged's contract keeps ``adamw(lr)``
    plain Adam until decay is asked for, and code outside this repository relies on it. For
    torch's default pass ``weight_decay=0.01`` (usually with ``mask=`` to spare biases and
    norms). Keywords are optax's (``learning_rate``, ``b1``, ``b2``), not torch's (``lr``,
    ``betas``): a torch spelling is refused with the name to use.

    Args:
        learning_rate: a float or a schedule ``count -> lr``.
        b1, b2, eps: Adam's hyperparameters.
        weight_decay: decoupled weight decay coefficient (default 0.0: no decay, see above).
        mask: optional leaf predicate (``LeafLayout -> bool``) or pytree of bools choosing
            which leaves get weight decay (e.g. skip biases and norms).
        donate: update the moments in place and write the update into the gradient buffer
            (like ``jax.jit(donate_argnums=...)``; the old state and the gradients must not be
            read after ``update``). No allocation per step; see bench/optim.py.

    The state is ``(ScaleByAdamState, EmptyState, lr state)``, as for the chain
    ``scale_by_adam, add_decayed_weights, scale_by_learning_rate``; without ``mask`` the three
    run fused in one pass (:func:`ragged.optim.scale_by_adamw`).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.adamw(0.1, weight_decay=0.5)
        >>> p = torch.tensor([1.0, 0.0], dtype=torch.float64)
        >>> u, _ = opt.update(torch.tensor([2.0, 0.0], dtype=torch.float64), opt.init(p), p)
        >>> [round(x, 6) for x in rg.optim.apply_updates(p, u).tolist()]   # p - lr * (1 + wd * p); 0 stays 0
        [0.85, 0.0]
    """
    if mask is None or not weight_decay:
        return scale_by_adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, donate=donate)
    decay = masked(add_decayed_weights(weight_decay), mask)
    return chain(scale_by_adam(b1=b1, b2=b2, eps=eps, donate=donate), decay, scale_by_learning_rate(learning_rate))
