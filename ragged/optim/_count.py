"""Step counters whose value the host knows, and where they live.

An optimizer's step count decides its bias corrections and schedules; it is a 0-d int64 tensor on
the parameters' device, so the update reads it there without a host sync. The host needs its value
too (a learning-rate schedule checked and compared across ranks before the step, see [Note: the
optimizer's settings join the step's agreement] in ``_base.py``): the counters are made and advanced
here, so the host knows each one it made without reading the device (a copy from a GPU waits for
it); one it did not make (loaded from a checkpoint, built by hand) is read once.
"""

from __future__ import annotations

import weakref

import torch

from ragged._pytree import pytree

__all__ = ["first_tensor", "zero_count", "next_count", "host_count"]


def first_tensor(tree) -> torch.Tensor | None:
    """The first tensor leaf of ``tree`` (used to pick the device of step counters)."""
    return next((leaf for leaf in pytree.leaves(tree) if isinstance(leaf, torch.Tensor)), None)


def zero_count(params) -> torch.Tensor:
    """A 0-d int64 step counter on the device of ``params`` (its value known on the host, see
    :func:`host_count`)."""
    t = first_tensor(params)
    count = torch.zeros((), dtype=torch.int64, device=t.device if t is not None else None)
    if not torch.compiler.is_compiling():
        _known(count, 0)
    return count


def next_count(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, its value known on the host when ``count``'s was (see :func:`host_count`)."""
    new = count + 1
    if torch.compiler.is_compiling():  # a compiled update's counts are the device's (read once by host_count)
        return new
    hit = _HOST_COUNTS.get(id(count))
    if hit is not None and hit[0]() is count:
        _known(new, hit[1] + 1)
    return new


def host_count(count: torch.Tensor) -> int:
    """The value of a step counter, without reading the device where the host made it: counters
    from :func:`zero_count` and :func:`next_count` are known; another (loaded from a checkpoint,
    built by hand) is read once (a device-to-host copy on a GPU) and known from then on."""
    hit = _HOST_COUNTS.get(id(count))
    if hit is not None and hit[0]() is count:
        return hit[1]
    value = int(count.cpu())
    _known(count, value)
    return value


_HOST_COUNTS: dict = {}  # id(count) -> (weakref to it, its value): dropped with the tensor


def _known(count: torch.Tensor, value: int) -> None:
    key = id(count)
    _HOST_COUNTS[key] = (weakref.ref(count, lambda _: _HOST_COUNTS.pop(key, None)), value)
