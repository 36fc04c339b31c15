"""What one call of the step saw: :class:`Observer` (what the ranks agree on at the end of the
call and the next call's schedule learns from), :class:`Counters` (what the metrics report) and
its trace (:func:`tracer`).
Both only record; neither moves data nor decides anything (see [Note: one agreement at the start
of a call, one at the end] in ``_grad.py``)."""

from __future__ import annotations

import torch

from ragged.fsdp._schedule import Observation

__all__ = ["Observer", "Counters", "tracer"]


class Observer:
    """This rank's view of the schedule in one call.

    Attributes:
        used: forward entries whose unit a torch call read.
        inserts: ``(entry, unit)`` reads in forward where the schedule has no entry of the unit.
        needs: ``(segment, unit)`` reads in backward; ``missing``: those where the unit was freed.
        late: ``(unit, segment)`` gradients that arrived after the unit's reduce-scatter.
        deviations: what made this rank compute on zeros (for the error message).
        foreign: ``nn.Parameter``s requiring grad that forward read and the step does not own.
    """

    __slots__ = ("used", "inserts", "needs", "missing", "late", "deviations", "foreign")

    def __init__(self):
        self.used: set[int] = set()
        self.inserts: list = []
        self.needs: set[tuple[int, int]] = set()
        self.missing: list = []
        self.late: list = []
        self.deviations: list[str] = []
        self.foreign: dict[int, tuple] = {}

    def foreign_read(self, p: torch.Tensor) -> None:
        if id(p) not in self.foreign:
            self.foreign[id(p)] = (p, p.grad)

    def foreign_grads(self) -> list:
        """Shapes of the parameters read in forward that are not the step's and got a gradient."""
        return [tuple(p.shape) for p, before in self.foreign.values() if p.grad is not None and p.grad is not before]

    def observation(self) -> Observation:
        return Observation(used=frozenset(self.used), inserts=tuple(self.inserts), needs=frozenset(self.needs),
                           missing=tuple(self.missing), late=tuple(self.late))


class Counters:
    """Bytes and calls of one call, for the step's metrics (see :meth:`metrics`)."""

    __slots__ = ("live", "peak", "grad_live", "grad_peak", "shard_live", "shard_peak", "gathers", "reduces", "saved",
                 "saved_peak")

    def __init__(self):
        self.live = self.peak = self.grad_live = self.grad_peak = self.shard_live = self.shard_peak = 0
        self.gathers = self.reduces = self.saved = self.saved_peak = 0

    def gathered(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def grad_taken(self, nbytes: int) -> None:
        self.grad_live += nbytes
        self.grad_peak = max(self.grad_peak, self.grad_live)

    def shards(self, nbytes: int) -> None:
        """Reduced gradient shards: ``nbytes`` more (fewer) alive, a reduce-scatter's output or the
        micro-batches' sums (see ``_reducing.py``)."""
        self.shard_live += nbytes
        self.shard_peak = max(self.shard_peak, self.shard_live)

    def new_micro_batch(self) -> None:
        self.saved_peak, self.saved = max(self.saved_peak, self.saved), 0

    def metrics(self) -> dict:
        return {"peak_gathered_bytes": self.peak, "peak_grad_bytes": self.grad_peak, "peak_shard_bytes": self.shard_peak,
                "num_gathers": self.gathers, "num_reduces": self.reduces,
                "saved_activation_bytes": max(self.saved_peak, self.saved)}


def tracer(trace, cursor, layouts):
    """The trace callback the run's parts share; it holds no reference to the run, so a finished
    run (and the gradients it held) is freed at once, not at the next garbage collection. A list
    gets ``(event, unit, phase)`` tuples; a callable is called as ``trace(event, unit, cursor)``
    (``fsdp.profile_activations`` reads the cursor's ``phase`` and ``busy``)."""
    def log(event: str, i: int | None):
        name = layouts[i].name if i is not None else "-"
        if callable(trace):
            trace(event, name, cursor)
        elif trace is not None:
            trace.append((event, name, cursor.phase))
    return log
