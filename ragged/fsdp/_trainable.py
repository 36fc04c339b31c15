"""What a step threads, :class:`TrainState`, and what the step makes of it besides the gradients:
the trainable part the optimizer sees, and donation.

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

[Note: one donate decision per step]
Donation is decided once, on the optimizer: ``rg.optim.adamw(..., donate=True)`` (likewise
``adam``, ``sgd``, ``adamw_8bit`` and the transforms with ``donate=``) updates its state and
the gradient buffers in place, and says so in ``GradientTransformation.donates`` (combinators
carry it). A step over that optimizer must then donate too (write the new shards into the old
ones and mark the old state donated), or a caller who kept the old state would read moments the
optimizer overwrote. So ``make_step(donate=None)``, the default, follows the optimizer, and an
explicit ``donate=`` that disagrees with it is refused at ``make_step`` (:func:`step_donation`),
before anything runs. A wrapped update keeps the flag with ``opt._replace(update=...)``.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._errors import RaggedKeyError, RaggedValueError
from ragged._pytree import pytree
from ragged.spec._concat import replicated_size

__all__ = ["TrainState", "trainable_shards", "with_trainable", "check_trainable", "check_opt_state", "trainable_part", "check_shards",
           "next_state", "donate", "check_not_donated", "step_donation", "DONATED_MSG"]


class TrainState(NamedTuple):
    """What a step threads: this rank's parameter shards (``{unit name: DBuffer}``) and the
    optimizer state over them."""

    shards: dict[str, DBuffer]
    opt_state: Any


FROZEN_STATE_MSG = (
    "step(state, batch): state.opt_state[...] holds a DBuffer over the whole plan of unit {unit!r}, frozen leaves "
    "({frozen}) included, so the optimizer would expect gradients for parameters that get none (every rank raises "
    "this, before any communication). Fix: build the state with rg.fsdp.init(units, params, optimizer, comm), which "
    "initialises the optimizer over each unit's trainable part (Unit.trainable_plan)."
)

DONATED_MSG = (
    "this state was donated to a previous step call (make_step(donate=True)): its buffers were "
    "overwritten with the new parameters and optimizer state. Fix: pass the state that call returned "
    "(state, metrics = step(state, batch)), or build the step with donate=False to keep old states valid."
)

_DONATED: dict[int, weakref.ref] = {}  # id -> tensor of every donated state (process-wide)

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
    check_shards(units, shards)
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


def check_shards(units, shards) -> None:
    """Refuses shards that lack a unit (a state not built by ``fsdp.init`` over these units)."""
    missing = [u.name for u in units if u.name not in shards]
    if missing:
        raise RaggedKeyError(f"state.shards lacks units {missing}; build the state with rg.fsdp.init(units, ...).")


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


def trainable_part(units, state: TrainState, module, where: str) -> dict[str, DBuffer]:
    """A step's input refused or taken: a donated state, optimizer state over frozen leaves and a
    module whose ``requires_grad`` changed raise (before any communication); otherwise the
    trainable part of the shards the optimizer updates (:func:`trainable_shards`)."""
    check_not_donated(state, where)
    check_opt_state(units, state.opt_state)
    if module is not None:
        check_trainable(units, module.named_parameters(), where)
    return trainable_shards(units, state.shards)


def next_state(units, state: TrainState, trained: dict[str, DBuffer], opt_state, donated: bool) -> TrainState:
    """The step's output: ``trained`` put back into the shards (:func:`with_trainable`), and with
    ``donated`` the input state marked donated (:func:`donate`)."""
    new = TrainState(with_trainable(units, state.shards, trained), opt_state)
    return donate(state, new) if donated else new


def check_not_donated(tree, where: str = "this") -> None:
    """Raises :data:`DONATED_MSG` if ``tree`` holds a tensor of a donated state (see :func:`donate`)."""
    for t in pytree.leaves(tree):
        if isinstance(t, torch.Tensor):
            ref = _DONATED.get(id(t))
            if ref is not None and ref() is t:
                raise RaggedValueError(f"{where}: " + DONATED_MSG)


def donate(old_state, new_state):
    """``new_state`` with fresh tensor objects where it shares tensors with ``old_state`` (aliases of
    the same storage: ``detach()``, nothing copied), and ``old_state``'s tensors marked donated, so
    that :func:`check_not_donated` (the step, ``rg.gather``) refuses them, as equinox's
    ``State.set`` invalidates the old state."""
    old = [t for t in pytree.leaves(old_state) if isinstance(t, torch.Tensor)]
    ids = {id(t) for t in old}
    new_state = pytree.map(lambda t: t.detach() if isinstance(t, torch.Tensor) and id(t) in ids else t, new_state)
    for t in old:
        _DONATED[id(t)] = weakref.ref(t, lambda _, k=id(t): _DONATED.pop(k, None))
    return new_state


def step_donation(donate: bool | None, optimizer) -> bool:
    """Whether a step over ``optimizer`` donates: ``optimizer.donates`` (``False`` for an object
    without it); an explicit ``donate`` must agree (see [Note: one donate decision per step]).

    Raises:
        RaggedValueError: ``donate`` given and not ``optimizer.donates``.

    Examples:
        >>> import ragged as rg
        >>> from ragged.fsdp._trainable import step_donation
        >>> step_donation(None, rg.optim.adamw(1e-3, donate=True)), step_donation(False, rg.optim.sgd(0.1))
        (True, False)
        >>> step_donation(False, rg.optim.adamw(1e-3, donate=True))
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedValueError: make_step: donate=False, but the optimizer updates in place ...
    """
    donates = bool(getattr(optimizer, "donates", False))
    if donate is None or bool(donate) == donates:
        return donates
    if donates:
        raise RaggedValueError(
            "make_step: donate=False, but the optimizer updates in place (its donates is True, e.g. "
            "rg.optim.adamw(..., donate=True)): it overwrites the moments of the state passed to the step, so the "
            "old state cannot stay valid. One decision per step: leave make_step's donate unset (it follows the "
            "optimizer), or build the optimizer with donate=False to keep old states valid."
        )
    raise RaggedValueError(
        "make_step: donate=True, but the optimizer does not update in place (its donates is False): the step would "
        "donate its state while the optimizer allocates new moments. One decision per step: build the optimizer "
        "with donate=True (rg.optim.adamw / adam / sgd / adamw_8bit(..., donate=True); a wrapped update keeps the "
        "flag with opt._replace(update=...)) and leave make_step's donate unset, or pass donate=False."
    )
