"""Learning-rate schedules: functions ``count -> value`` (optax's ``optax.schedules``).

``count`` is the number of updates already applied (0 at the first step), an ``int`` or a 0-d
integer tensor (the counters optimizer states keep). A schedule returns a 0-d float64 tensor on
``count``'s device, so no host sync is needed inside ``update``.
"""

from __future__ import annotations

import math

import torch

from ragged.optim._base import Schedule, check_rate, keywords_checked
from ragged._errors import RaggedValueError, check_int

__all__ = [
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
]


def _as_float(count) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        return count.to(torch.float64)
    return torch.tensor(float(count), dtype=torch.float64)


def _along(count, steps: int, empty: float, curve) -> torch.Tensor:
    """``curve(clamp(count / steps, 0, 1))`` in float64; ``empty`` at every count when ``steps``
    is 0 (a schedule of no steps)."""
    c = _as_float(count)
    if steps == 0:
        return torch.full_like(c, empty)
    return curve(torch.clamp(c / steps, 0.0, 1.0))


def _check_values(where: str, **values) -> None:
    """Schedule values must be finite numbers >= 0 (a negative learning rate trains by gradient
    ascent, a NaN or inf one ruins every parameter); each is named as ``where``'s argument."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RaggedValueError(f"{where}: {name} must be a finite float >= 0, got {v!r}.")
        check_rate(f"{where}: {name}", v)


@keywords_checked
def constant_schedule(value: float) -> Schedule:
    """Returns ``value`` at every step.

    Examples:
        >>> from ragged import optim
        >>> float(optim.constant_schedule(0.1)(7))
        0.1
    """
    _check_values("constant_schedule", value=value)

    def schedule(count):
        return torch.full_like(_as_float(count), value)

    return schedule


@keywords_checked
def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """Goes linearly from ``init_value`` (count 0) to ``end_value`` (count ``transition_steps``),
    then stays at ``end_value``.

    Examples:
        >>> from ragged import optim
        >>> s = optim.linear_schedule(0.0, 1.0, 4)
        >>> [float(s(c)) for c in (0, 2, 4, 9)]
        [0.0, 0.5, 1.0, 1.0]
    """
    _check_values("linear_schedule", init_value=init_value, end_value=end_value)
    check_int("transition_steps", transition_steps, 0)

    def schedule(count):
        return _along(count, transition_steps, end_value, lambda frac: init_value + (end_value - init_value) * frac)

    return schedule


@keywords_checked
def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Examples:
        >>> from ragged import optim
        >>> s = optim.cosine_decay_schedule(1.0, 10)
        >>> [round(float(s(c)), 4) for c in (0, 5, 10, 20)]
        [1.0, 0.5, 0.0, 0.0]
    """
    _check_values("cosine_decay_schedule", init_value=init_value, alpha=alpha)
    check_int("decay_steps", decay_steps, 0)

    def curve(frac):
        cosine = 0.5 * (1.0 + torch.cos(math.pi * frac))
        return init_value * ((1.0 - alpha) * cosine + alpha)

    def schedule(count):
        return _along(count, decay_steps, init_value, curve)

    return schedule


@keywords_checked
def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at count ``decay_steps`` (total, warmup included, as in optax).

    Examples:
        >>> from ragged import optim
        >>> s = optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
        >>> [round(float(s(c)), 4) for c in range(8)]
        [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    _check_values("warmup_cosine_decay_schedule", init_value=init_value, peak_value=peak_value, end_value=end_value)
    check_int("warmup_steps", warmup_steps, 0)
    check_int("decay_steps", decay_steps, 0)
    if decay_steps < warmup_steps:
        raise RaggedValueError(
            f"decay_steps ({decay_steps}) counts the warmup too, so it must be >= warmup_steps "
            f"({warmup_steps})."
        )
    warm = linear_schedule(init_value, peak_value, warmup_steps)
    span = decay_steps - warmup_steps
    alpha = end_value / peak_value if peak_value != 0 else 0.0
    decay = cosine_decay_schedule(peak_value, span, alpha=alpha)

    def schedule(count):
        c = _as_float(count)
        return torch.where(c < warmup_steps, warm(c), decay(c - warmup_steps))

    return schedule
