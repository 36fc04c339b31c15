"""``make_step(donate=True)``: the input state's buffers become the output's; the old state is
marked donated and refused wherever ragged reads a state."""

from __future__ import annotations

import weakref

import torch

from ragged._errors import RaggedValueError
from ragged._pytree import pytree

__all__ = ["donate", "check_not_donated", "DONATED_MSG"]

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
