"""``make_step(donate=True)``: the input state's buffers become the output's; the old state is
marked donated and refused wherever ragged reads a state.

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

import torch

from ragged._errors import RaggedValueError
from ragged._pytree import pytree

__all__ = ["donate", "check_not_donated", "step_donation", "DONATED_MSG"]

DONATED_MSG = (
    "this state was donated to a previous step call (make_step(donate=True)): its buffers were "
    "overwritten with the new parameters and optimizer state. Fix: pass the state that call returned "
    "(state, metrics = step(state, batch)), or build the step with donate=False to keep old states valid."
)

_DONATED: dict[int, weakref.ref] = {}  # id -> tensor of every donated state (process-wide)


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
        >>> from ragged.fsdp._donate import step_donation
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
