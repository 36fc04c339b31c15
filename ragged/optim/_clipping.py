"""Clipping by the global norm of the updates, over every rank of the shard group (optax's
``transforms/_clipping.py``)."""

from __future__ import annotations

import torch

from ragged._dbuffer import DBuffer, is_dbuffer, norm as _norm, norm_collectives
from ragged._pytree import pytree
from ragged.optim._base import EmptyState, GradientTransformation, keywords_checked
from ragged.collectives._agree import agree_collectives
from ragged.collectives._channel import raised_on_every_rank
from ragged.optim._finite import NonFiniteError, any_rank, check_sharded_comm, nonfinite_report
from ragged.optim._transform import _check_nonneg

__all__ = ["ClipByGlobalNormState", "tree_norm", "clip_by_global_norm"]

ClipByGlobalNormState = EmptyState


def _global_norm_collectives(tree, comm, agree_finite: bool) -> tuple:
    """What :func:`tree_norm` (and the finiteness agreement) issues on ``comm`` for a tree shaped like ``tree``."""
    if comm is None:
        return ()
    sharded = any(isinstance(x, DBuffer) for x in pytree.leaves(tree, is_leaf=is_dbuffer))
    return norm_collectives(comm, sharded) + (agree_collectives(comm, 1) if agree_finite else ())


def tree_norm(tree, *, comm=None) -> torch.Tensor:
    """The L2 norm of every element of ``tree``, across all ranks of ``comm``.

    Layout-free: it sees only the tree and one comm. For a whole model over a layout (units
    with data groups, a mesh plan), :func:`ragged.global_norm` weighs out copies on other axes.

    Sharded parts (``DBuffer.data``) are summed locally, then all-reduced once (one scalar);
    replicated parts (``DBuffer.replicated`` and plain tensors) are the same on every rank
    and count once. Computed in float64 on the tensors' device; no host sync.

    Args:
        tree: a pytree of tensors and/or DBuffers.
        comm: the shard group's :class:`~ragged.collectives.Collectives` (``None``: one rank).

    Examples:
        >>> import torch, ragged as rg
        >>> float(rg.optim.tree_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}))
        5.0
    """
    parts = [x for x in pytree.leaves(tree, is_leaf=is_dbuffer) if isinstance(x, (DBuffer, torch.Tensor))]
    return _norm(parts, comm)


@keywords_checked
def clip_by_global_norm(max_norm: float, *, comm, norm=None, error_if_nonfinite: bool = False) -> GradientTransformation:
    """Scales updates so that their global L2 norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``: the factor is
    ``min(1, max_norm / (norm + 1e-6))``. The norm is global over the shard group (see
    :func:`tree_norm`: one all-reduce of one scalar; replicated leaves count once).

    Args:
        max_norm: the largest allowed norm.
        comm: the shard group's collectives, or ``None`` for a single rank.
        norm: ``norm(updates) -> 0-d tensor`` replacing :func:`tree_norm` over ``comm``, for
            updates spread over more than the shard group (e.g. ``rg.global_norm(units, ...)`` with
            the step's ``data_groups`` under expert parallelism). It must be equal on every rank.
        error_if_nonfinite: raise :class:`~ragged.optim.NonFiniteError` when the norm is NaN
            or inf (torch's ``clip_grad_norm_(error_if_nonfinite=True)``), on every rank alike
            (a NaN anywhere, replicated leaves included, is seen by all: each rank's verdict on
            its norm is agreed, one more all-reduce of one scalar) and before anything is
            updated. Costs one host sync per step.
            To skip such steps instead, wrap the optimizer in :func:`ragged.optim.apply_if_finite`.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.clip_by_global_norm(1.0, comm=None)
        >>> opt.update(torch.tensor([3.0, 4.0]), opt.init(None))[0]
        tensor([0.6000, 0.8000])
        >>> strict = rg.optim.clip_by_global_norm(1.0, comm=None, error_if_nonfinite=True)
        >>> strict.update(torch.tensor([3.0, float("inf")]), strict.init(None))
        Traceback (most recent call last):
        ...
        ragged.optim._finite.NonFiniteError: clip_by_global_norm: the global norm of the gradients is not finite ...
    """
    _check_nonneg("max_norm", max_norm)

    def init(params):
        del params
        return ClipByGlobalNormState()

    def update(updates, state, params=None):
        del params
        if norm is None:
            check_sharded_comm(updates, comm, "clip_by_global_norm")
            total = tree_norm(updates, comm=comm)
            # every rank alike: a NaN in one rank's replicated leaves reaches its norm alone
            nonfinite = error_if_nonfinite and any_rank(torch.logical_not(torch.isfinite(total)), comm,
                                                        "clip_by_global_norm")
        else:
            total = norm(updates)
            nonfinite = error_if_nonfinite and not bool(torch.isfinite(total))
        if nonfinite:  # every rank alike (an agreed or equal norm): no poison needed
            raise raised_on_every_rank(NonFiniteError(
                "clip_by_global_norm: the global norm of the gradients is not finite (NaN or inf on at least one "
                f"rank; error_if_nonfinite=True, as torch.nn.utils.clip_grad_norm_); nothing was updated, on any "
                f"rank. {nonfinite_report(updates)}. Fix: find where the NaN/inf comes from (learning rate, loss "
                "scale, data), or skip such steps with rg.optim.apply_if_finite(opt, max_consecutive_errors, comm=comm)."
            ))
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return pytree.map(lambda u: u * factor.to(u.dtype), updates), state

    collectives = None if norm is not None else lambda params: _global_norm_collectives(params, comm, error_if_nonfinite)
    return GradientTransformation(init, update, collectives=collectives)
