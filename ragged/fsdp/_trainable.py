"""The trainable part of a state's shards: what gradients, optimizer state and updates cover.

[Note: frozen parameters]
A leaf with ``requires_grad=False`` (or ``make_units(trainable=...)`` saying so for a pytree)
is frozen: ``torch.optim`` gives it no gradient, no state and no update, and so does ragged. The
step makes it a leaf that does not require a gradient, so autograd computes none for it (nor
for what only it depends on); its unit's plan holds it in buffers after the trainable ones (see
[Note: trainable buffers first] in ``ragged/spec/_concat.py``), so the gradient buffer, the
reduce-scatter and the optimizer state cover the trainable prefix only, and a unit where
nothing trains is gathered for forward and backward and moves no gradient at all. The
optimizer sees ``{unit: DBuffer}`` over each unit's ``trainable_plan`` (units where nothing
trains are absent): :func:`trainable_shards` gives those views of the shards (nothing copied),
:func:`with_trainable` puts the updated part back (in place under donation; otherwise the frozen
part is copied once into the new shard, so the old state stays valid).
Which leaves train may change between runs: load the parameters from a checkpoint into units
made with the new trainable set and start the optimizer afresh over their trainable part
(``shards = rg.checkpoint.load(path, fsdp.TrainState(like.shards, None), comm,
strict=False).shards``; ``fsdp.TrainState(shards, opt.init(fsdp.trainable_shards(units,
shards)))``), as a torch user builds a new optimizer for a new stage.
A leaf's trainability is fixed when the units are made: a module parameter whose
``requires_grad`` no longer agrees with its unit is refused (:func:`check_trainable`) by
``fsdp.init`` and by every call of a step bound to the module, before anything changes.
"""

from __future__ import annotations

import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._errors import RaggedValueError
from ragged._pytree import pytree
from ragged.spec._concat import replicated_size

__all__ = ["trainable_shards", "with_trainable", "check_trainable", "check_opt_state"]

FROZEN_STATE_MSG = (
    "step(state, batch): state.opt_state[...] holds a DBuffer over the whole plan of unit {unit!r}, frozen leaves "
    "({frozen}) included, so the optimizer would expect gradients for parameters that get none (every rank raises "
    "this, before any communication). Fix: build the state with rg.fsdp.init(units, params, optimizer, comm), which "
    "initialises the optimizer over each unit's trainable part (Unit.trainable_plan)."
)

FLIPPED_MSG = (
    "{where}: parameter {path!r} has requires_grad={now}, but the units were made when it was {then}: a leaf's "
    "trainability is part of its unit (it decides the plan's buffers, the gradients and the optimizer state), so "
    "ragged refuses rather than train a frozen parameter or freeze a trained one (every rank raises this, before "
    "any parameter changes). Fix: set requires_grad before rg.fsdp.make_units, or make the units again (and load "
    "the state from a checkpoint) after changing it."
)


def trainable_shards(units, shards: dict[str, DBuffer]) -> dict[str, DBuffer]:
    """``{unit: DBuffer}`` over each unit's ``trainable_plan``: views of the prefix of its shard
    (the shard itself when nothing is frozen); units where nothing trains are left out. What
    the optimizer sees (``fsdp.init`` calls ``optimizer.init`` on it; see [Note: frozen
    parameters]).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> params = {"w": torch.ones(4, 2), "emb": torch.zeros(6)}
        >>> units = fsdp.make_units(params, world_size=2, trainable=lambda p: "emb" not in p)
        >>> def fn(comm):
        ...     part = trainable_shards(units, rg.shard(units, params, comm))["rest"]
        ...     return part.data.tolist(), part.plan.num_leaves
        >>> rg.collectives.simulate(2, fn)[1], units["rest"].trainable_paths
        (([1.0, 1.0, 1.0, 1.0], 1), ("['w']",))
    """
    out = {}
    for u in units:
        plan, d = u.trainable_plan, shards[u.name]
        if plan is None:
            continue
        if plan == d.plan:
            out[u.name] = d
        else:
            out[u.name] = DBuffer(data=d.data[: plan.shard_size], replicated=d.replicated[: replicated_size(plan)],
                                  plan=plan, rank=d.rank)
    return out


def with_trainable(units, shards: dict[str, DBuffer], trained: dict[str, DBuffer]) -> dict[str, DBuffer]:
    """``shards`` with each unit's trainable part replaced by ``trained[unit]`` (the frozen part
    unchanged)."""
    out = {}
    for u in units:
        d, t = shards[u.name], trained.get(u.name)
        if t is None:
            out[u.name] = d
        elif t.plan == d.plan:
            out[u.name] = t
        else:
            out[u.name] = d.replace(data=_join(t.data, d.data), replicated=_join(t.replicated, d.replicated))
    return out


def _join(prefix: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    if prefix.numel() == 0 or prefix.data_ptr() == whole.data_ptr():  # nothing there, or updated in place
        return whole
    return torch.cat([prefix, whole[prefix.numel():]])


def check_opt_state(units, opt_state) -> None:
    """Refuses optimizer state laid out over a partly frozen unit's whole plan (see [Note: frozen
    parameters])."""
    whole = {u.plan: u for u in units if u.frozen and u.plan != u.trainable_plan}
    if not whole:
        return
    for d in pytree.leaves(opt_state, is_leaf=is_dbuffer, none_is_leaf=True):
        u = whole.get(getattr(d, "plan", None))
        if u is not None:
            raise RaggedValueError(FROZEN_STATE_MSG.format(unit=u.name, frozen=", ".join(sorted(u.frozen)[:3])))


def check_trainable(units, params, where: str) -> None:
    """Refuses module parameters (``nn.Parameter`` values, a module's placeholders included)
    whose ``requires_grad`` disagrees with ``units`` (see [Note: frozen parameters])."""
    frozen = {p for u in units for p in u.frozen}
    for path, t in params:
        if isinstance(t, torch.nn.Parameter) and t.requires_grad == (path in frozen):
            raise RaggedValueError(FLIPPED_MSG.format(where=where, path=path, now=t.requires_grad,
                                                      then=not t.requires_grad))
