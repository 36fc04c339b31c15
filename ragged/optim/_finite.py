"""Non-finite gradients: detect them on every rank alike, skip or refuse the update.

[Note: every rank takes the same decision]
A NaN in one rank's gradient shard reaches every rank's parameters only through later steps;
what must never happen is ranks deciding differently (one skips, the others apply: the replicas
of replicated leaves diverge silently, and any collective inside the inner transformation
pairs with the wrong call). So the decision is made on an agreed flag: one all-reduce (max) of
one scalar over the shard group (and the replicas), then a host sync to branch on it (see
[Note: one way to agree] in ``ragged/collectives/_agree.py``). The
update is skipped, or the error raised, before anything is changed.

[Note: a skipped update is -0.0]
A skipped step returns updates of negative zero, not zero: ``x + (-0.0)`` is ``x`` bit for bit
for every ``x``, while ``-0.0 + 0.0`` is ``+0.0``. So ``apply_updates`` leaves parameters
bit-identical on a skipped step, negative zeros included (and padding stays +0.0).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._errors import RaggedError, RaggedTypeError, RaggedValueError, check_int
from ragged._pytree import pytree
from ragged.collectives._agree import agree, agree_collectives
from ragged.optim._base import GradientTransformation, keywords_checked, settings_of
from ragged.optim._count import first_tensor, zero_count

__all__ = ["NonFiniteError", "ApplyIfFiniteState", "apply_if_finite", "local_nonfinite", "nonfinite_report", "check_sharded_comm"]


class NonFiniteError(RaggedError, RuntimeError):
    """The gradients hold NaN or inf and the transformation was asked to refuse them (raised
    on every rank, before any parameter changes).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.clip_by_global_norm(1.0, comm=None, error_if_nonfinite=True)
        >>> try:
        ...     opt.update(torch.tensor([float("nan")]), opt.init(None))
        ... except rg.optim.NonFiniteError as err:
        ...     print(type(err).__name__, isinstance(err, rg.RaggedError))
        NonFiniteError True
    """


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.leaves(tree) if isinstance(t, torch.Tensor)]


def local_nonfinite(tensors, device=None) -> torch.Tensor:
    """A 0-d float64 tensor: 1.0 if any of ``tensors`` holds NaN or inf on this rank, else 0.0."""
    flags = [torch.logical_not(torch.isfinite(t).all()) for t in tensors if t.numel()]
    if not flags:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(flags).any().to(torch.float64)


def nonfinite_report(tree, limit: int = 5) -> str:
    """Which leaves hold NaN / inf on this rank (key paths; DBuffers by their plan's leaves)."""
    found = []
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree, namespace="ragged", is_leaf=is_dbuffer)
    for accessor, leaf in zip(accessors, leaves):
        name = accessor.codify("")
        if isinstance(leaf, DBuffer):
            spans = [(p.leaf.path, leaf.data[p.local_offset : p.local_offset + p.numel]) for p in leaf.plan.local_pieces(leaf.rank)]
            spans += [(l.path, leaf.replicated[l.offset : l.stop]) for l in leaf.plan.replicated]
            found += [f"{name}{p}" for p, t in spans if t.numel() and not bool(torch.isfinite(t).all())]
        elif isinstance(leaf, torch.Tensor) and leaf.numel() and not bool(torch.isfinite(leaf).all()):
            found.append(name or "<root>")
    if not found:
        return "this rank's gradients are finite (another rank's are not)"
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return "non-finite on this rank: " + ", ".join(found[:limit]) + more


def check_sharded_comm(updates, comm, where: str) -> None:
    """Refuses ``comm=None`` for DBuffers sharded over several ranks: a decision (or a norm)
    taken per rank would differ between ranks."""
    if comm is not None:
        return
    for leaf in pytree.leaves(updates, is_leaf=is_dbuffer):
        if isinstance(leaf, DBuffer) and leaf.plan.world_size > 1:
            raise RaggedValueError(
                f"{where}: the updates are DBuffers sharded over world_size={leaf.plan.world_size} ranks but "
                "comm=None, so each rank would decide on its own shard alone. Fix: pass the shard group's comm."
            )


def any_rank(flag: torch.Tensor, comm, label: str) -> bool:
    """Whether ``flag`` (0-d, 0 or 1) is set on any rank of ``comm`` (shard group and replicas),
    the same answer on every rank (see [Note: one way to agree] in ``ragged/collectives/_agree.py``)."""
    if comm is None:
        return float(flag) > 0
    return agree(comm, flag.to(torch.float64).reshape(1), label=label).values[0] > 0  # read once, with the round


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite` (optax's fields; 0-d tensors).

    Attributes:
        notfinite_count: consecutive steps with non-finite updates so far (int64).
        last_finite: whether the last step's updates were finite on every rank (bool).
        total_notfinite: steps with non-finite updates in total (int64).
        inner_state: the inner transformation's state.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.apply_if_finite(rg.optim.scale(1.0), 3, comm=None)
        >>> _, state = opt.update(torch.tensor([float("nan")]), opt.init(torch.zeros(1)))
        >>> state.notfinite_count.item(), state.last_finite.item(), state.total_notfinite.item()
        (1, False, 1)
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


@keywords_checked
def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int, *, comm) -> GradientTransformation:
    """Runs ``inner`` only on steps whose updates are finite on every rank (optax's
    ``apply_if_finite``).

    A step whose updates hold NaN or inf on any rank returns updates that leave the parameters
    bit-identical (see [Note: a skipped update is -0.0]) and keeps the inner state as it was, on
    every rank (see [Note: every rank takes the same decision]: one all-reduce of one scalar and
    one host sync per step). After more than ``max_consecutive_errors`` non-finite steps in a row
    the update is applied anyway, as optax does (the NaN then reaches the parameters: the
    caller watches ``notfinite_count``).

    Args:
        inner: the transformation to guard (e.g. ``rg.optim.adamw(...)``).
        max_consecutive_errors: how many non-finite steps in a row are skipped.
        comm: the shard group's collectives (``None``: one rank).

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.apply_if_finite(rg.optim.sgd(0.1), 2, comm=None)
        >>> p = torch.tensor([1.0, -0.0])
        >>> state = opt.init(p)
        >>> u, state = opt.update(torch.tensor([float("nan"), 1.0]), state, p)
        >>> rg.optim.apply_updates(p, u), int(state.notfinite_count), bool(state.last_finite)
        (tensor([1., -0.]), 1, False)
        >>> u, state = opt.update(torch.tensor([1.0, 1.0]), state, p)
        >>> rg.optim.apply_updates(p, u), int(state.notfinite_count), int(state.total_notfinite)
        (tensor([ 0.9000, -0.1000]), 0, 1)
    """
    if not isinstance(inner, GradientTransformation):
        raise RaggedTypeError(f"apply_if_finite: inner must be a GradientTransformation, got {type(inner).__name__}.")
    check_int("apply_if_finite: max_consecutive_errors", max_consecutive_errors, 0)

    def init(params):
        count = zero_count(params)
        return ApplyIfFiniteState(
            notfinite_count=count, last_finite=torch.ones((), dtype=torch.bool, device=count.device),
            total_notfinite=count.clone(), inner_state=inner.init(params),
        )

    def update(updates, state, params=None):
        check_sharded_comm(updates, comm, "apply_if_finite")
        ref = first_tensor(updates)
        finite = not any_rank(local_nonfinite(_tensors(updates), None if ref is None else ref.device), comm,
                              "apply_if_finite")
        notfinite = torch.zeros_like(state.notfinite_count) if finite else state.notfinite_count + 1
        if finite or int(notfinite) > max_consecutive_errors:
            updates, inner_state = inner.update(updates, state.inner_state, params)
        else:
            updates, inner_state = pytree.map(lambda u: torch.full_like(u, -0.0), updates), state.inner_state
        return updates, ApplyIfFiniteState(
            notfinite_count=notfinite,
            last_finite=torch.full_like(state.last_finite, finite),
            total_notfinite=state.total_notfinite + (0 if finite else 1),
            inner_state=inner_state,
        )

    def collectives(params):
        return agree_collectives(comm, 1) + (inner.collectives(params) if inner.collectives is not None else ())

    def fingerprint(state):
        return (("apply_if_finite.max_consecutive_errors", str(max_consecutive_errors)),
                *settings_of(inner, state.inner_state, "apply_if_finite"))

    return GradientTransformation(init, update, donates=inner.donates, collectives=collectives, fingerprint=fingerprint)
