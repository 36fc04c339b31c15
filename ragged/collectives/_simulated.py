"""An in-process simulated mesh: m ranks as m threads of this process.

For notebooks and property tests. Every collective is a rendezvous of the group's threads
(a barrier with a timeout) at which the ranks compare their calls (operation,
dtype, elements, identity and label: see [Note: what a collective call carries] in
``_base.py``): a difference raises :class:`~ragged.PlanMismatchError` on every rank, naming
both sides, as the torch backend does. A rank that poisons its comm (or raises: see
:func:`run_ranks`) or returns from ``fn`` while the others still wait makes them raise
:class:`~ragged.CollectiveError` at once; a rank that is merely absent, after ``timeout``.
Results equal the torch backend's bit for bit up to summation order.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ragged._errors import CollectiveError, PlanMismatchError, RaggedValueError, check_int
from ragged.collectives._base import BufferOps, DoneHandle, check_coalesced, check_op, poison_on_error, scoped_label
from ragged.collectives._channel import raised_on_every_rank
from ragged.collectives._header import Call, call_difference, identity_of

__all__ = ["SimulatedCollectives", "simulate"]


def _differs(a: Call, b: Call) -> str | None:
    why = call_difference(a, b)
    if why is None and a.identity != b.identity:
        return "the plan, transform or label"
    return why


class _Group:
    """Rendezvous state of one group of simulated ranks."""

    def __init__(self, size: int, timeout: float, name: str):
        self.size = size
        self.name = name
        self.timeout = timeout
        self._cond = threading.Condition()
        self._generation = 0
        self._arrived = 0
        self.slots: list[Any] = [None] * size
        self.calls: list[Call | None] = [None] * size
        self.failure: tuple[int, str] | None = None  # (rank, reason): see fail()
        self.departed: set[int] = set()  # ranks whose fn returned

    def exchange(self, index: int, seq: int, call: Call, value):
        if self.size == 1:
            return [value]
        self._check(index, seq, call)
        self.slots[index] = value
        self.calls[index] = call
        self._wait(index, seq, call)
        values, calls = list(self.slots), list(self.calls)
        self._wait(index, seq, call)
        bad = [(j, c, _differs(call, c)) for j, c in enumerate(calls) if _differs(call, c)]
        if bad:
            j, theirs, why = bad[0]
            others = [k for k, _, _ in bad[1:]]
            raise raised_on_every_rank(PlanMismatchError(
                f"collective #{seq} of the simulated {self.name} group differs between ranks ({why}): rank {index} "
                f"called {call.describe()}, rank {j} called {theirs.describe()}"
                + (f"; ranks {others} also differ from rank {index}" if others else "")
                + ". Every rank must issue the same ragged collectives in the same order, with the same plans, "
                "dtypes and options (a rank that skipped or added a call, or built another plan)."))
        return values

    def _check(self, index, seq, call):
        if self.failure is not None:
            rank, reason = self.failure
            if rank == index:
                raise CollectiveError(f"this comm no longer runs collectives: {reason}")
            raise CollectiveError(f"rank {rank} failed: {reason} (rank {index} learnt it in collective #{seq}, "
                                  f"{call.describe()}, of the simulated {self.name} group)", peer=rank)
        gone = sorted(self.departed - {index})
        if gone:
            raise CollectiveError(
                f"rank {gone[0]} returned (stopped early) while rank {index} calls collective #{seq} "
                f"({call.describe()}) of the simulated {self.name} group. Every rank must issue the same "
                "collectives in the same order.", peer=gone[0])

    def _wait(self, index, seq, call):
        """A barrier of the group's ranks that a failure or a departure breaks."""
        with self._cond:
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            released = self._cond.wait_for(
                lambda: self._generation != generation or self.failure is not None or bool(self.departed - {index}),
                self.timeout)
            if self._generation != generation:
                return
            self._arrived -= 1
        self._check(index, seq, call)
        if not released:
            raise CollectiveError(
                f"simulated {self.name} group: rank {index} waited in collective #{seq} ({call.describe()}) but the "
                f"other ranks did not arrive within {self.timeout}s. Every rank must issue the same "
                "collectives in the same order.")

    def depart(self, rank: int):
        with self._cond:
            self.departed.add(rank)
            self._cond.notify_all()

    def fail(self, rank: int, reason: str):
        """Every rank of this group raises at its current or next collective (see :meth:`_check`)."""
        with self._cond:
            if self.failure is None:
                self.failure = (rank, reason)
            self._cond.notify_all()


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


class SimulatedCollectives(BufferOps):
    """:class:`~ragged.collectives.Collectives` for one simulated rank (see :func:`simulate`).

    Async ops complete immediately; their handle's ``wait()`` does nothing.

    Examples:
        >>> import ragged as rg
        >>> comms = rg.collectives.simulate(3, lambda comm: comm)   # one per rank (threads)
        >>> [type(c).__name__ for c in comms], [c.rank for c in comms]
        (['SimulatedCollectives', 'SimulatedCollectives', 'SimulatedCollectives'], [0, 1, 2])
    """

    def __init__(self, rank, shard_group: _Group, replica_rank=0, replica_group: _Group | None = None, world_group=None):
        self._rank = rank
        self._shard = shard_group
        self._replica_rank = replica_rank
        self._replica = replica_group
        self._world = world_group if world_group is not None else shard_group
        self._global_rank = replica_rank * shard_group.size + rank
        self.plan_check = "every_call"  # or "first_use": see [Note: plan check before collectives]
        self.checked_plans: dict = {}  # (ragged/transforms/_check.py)
        self.scope = None  # see [Note: what a collective call carries] (_base.py)
        self._seq: dict[int, int] = {}

    def _exchange(self, group, index, op, reduce, tensor, value, label, numel=None):
        scope = self.scope
        call = Call(op, reduce, None if tensor is None else tensor.dtype,
                    (-1 if tensor is None else tensor.numel()) if numel is None else numel,
                    identity_of(scope.identity if scope is not None else 0, label), scoped_label(scope, label))
        seq = self._seq.get(id(group), 0)
        self._seq[id(group)] = seq + 1
        with poison_on_error(self):
            return group.exchange(index, seq, call, value)

    def memberships(self) -> list:
        """``(group, this rank's index in it)`` for every group this rank belongs to."""
        out = {id(self._shard): (self._shard, self._rank)}
        if self._replica is not None:
            out[id(self._replica)] = (self._replica, self._replica_rank)
        out.setdefault(id(self._world), (self._world, self._global_rank))
        return list(out.values())

    def verify(self) -> None:
        """A no-op: every call is compared at its rendezvous."""

    def poison(self, reason: str) -> None:
        """See :meth:`ragged.collectives.Collectives.poison`."""
        for g, index in self.memberships():
            g.fail(index, reason)

    def __repr__(self) -> str:
        return f"SimulatedCollectives(rank={self._rank}, world_size={self.world_size}, replicas={self.num_replicas})"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._shard.size

    @property
    def num_replicas(self) -> int:
        return 1 if self._replica is None else self._replica.size

    @property
    def replica_rank(self) -> int:
        return self._replica_rank

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def _done(async_op):
        return DoneHandle() if async_op else None

    def _all_gather(self, outs, ins, async_op, label, where):
        with poison_on_error(self):
            check_coalesced(outs, ins, self.world_size, where, gather=True)
        values = self._exchange(self._shard, self._rank, "all_gather", None, ins[0], [_plain(i).clone() for i in ins],
                                label, numel=sum(i.numel() for i in ins))
        with torch.no_grad():
            for b, (o, i) in enumerate(zip(outs, ins)):
                n = i.numel()
                for j, v in enumerate(values):
                    o[j * n : (j + 1) * n].copy_(v[b].reshape(-1))
        return self._done(async_op)

    def _reduce(self, values, op, like):
        with torch.no_grad():
            acc = values[0].to(like.dtype).clone()
            for v in values[1:]:
                if op == "max":
                    torch.maximum(acc, v, out=acc)
                else:
                    acc.add_(v)
            if op == "mean":
                acc.div_(len(values))
        return acc

    def _reduce_scatter(self, outs, ins, op, async_op, label, where):
        with poison_on_error(self):
            check_op(op)
            check_coalesced(outs, ins, self.world_size, where, gather=False)
        values = self._exchange(self._shard, self._rank, "reduce_scatter", op, ins[0], [_plain(i).clone() for i in ins],
                                label, numel=sum(o.numel() for o in outs))
        with torch.no_grad():
            for b, o in enumerate(outs):
                n = o.numel()
                chunks = [v[b].reshape(-1)[self._rank * n : (self._rank + 1) * n] for v in values]
                o.copy_(self._reduce(chunks, op, o).view_as(o))
        return self._done(async_op)

    def _all_reduce(self, group, index, tensor, op, async_op, label):
        with poison_on_error(self):
            check_op(op)
        values = self._exchange(group, index, "all_reduce", op, tensor, _plain(tensor).clone(), label)
        with torch.no_grad():
            tensor.copy_(self._reduce(values, op, tensor))
        return self._done(async_op)

    def all_reduce(self, tensor, *, op="sum", async_op=False, label=None):
        return self._all_reduce(self._shard, self._rank, tensor, op, async_op, label)

    def all_reduce_replicas(self, tensor, *, op="sum", async_op=False, label=None):
        if self._replica is None:
            check_op(op)
            return self._done(async_op)
        return self._all_reduce(self._replica, self._replica_rank, tensor, op, async_op, label)

    def all_to_all(self, output, input, output_splits, input_splits, *, async_op=False, label=None):
        m = self.world_size
        with poison_on_error(self):
            if len(input_splits) != m or len(output_splits) != m:
                raise RaggedValueError(f"all_to_all: splits must have world_size={m} entries.")
        flat = _plain(input).reshape(-1)
        starts = [sum(input_splits[:j]) for j in range(m)]
        parts = [flat[s : s + k].clone() for s, k in zip(starts, input_splits)]
        values = self._exchange(self._shard, self._rank, "all_to_all", None, input, parts, label, numel=-1)
        with torch.no_grad():
            pos = 0
            for j in range(m):
                piece = values[j][self._rank]
                if piece.numel() != output_splits[j]:
                    self.poison(f"all_to_all: rank {self._rank} expected {output_splits[j]} elements from rank {j}, "
                                f"got {piece.numel()}")
                    raise RaggedValueError(
                        f"all_to_all: rank {self._rank} expected {output_splits[j]} elements from rank {j}, "
                        f"got {piece.numel()}."
                    )
                output[pos : pos + piece.numel()].copy_(piece)
                pos += piece.numel()
        return self._done(async_op)

    def all_gather_object(self, obj: Any, *, label=None) -> list[Any]:
        return self._exchange(self._world, self._global_rank, "all_gather_object", None, None, obj, label)

    def barrier(self, *, label=None) -> None:
        self._exchange(self._world, self._global_rank, "barrier", None, None, None, label)


def simulate(world_size: int, fn, *args, mesh_shape: tuple[int, int] | None = None, timeout: float = 60.0, **kwargs):
    """Runs ``fn(comm, *args, **kwargs)`` on ``world_size`` simulated ranks (threads).

    The ranks are threads of this one process, so they share torch's global random generator:
    ``torch.manual_seed(s)`` then building a model inside ``fn`` races with the other ranks'
    draws, and the ranks can end up with different weights (``fsdp.init`` refuses that, see
    ``fsdp.ParamsMismatchError``). Instead build the model once outside ``fn`` and pass it in
    (or ``copy.deepcopy`` it per rank), draw from a generator of the rank's own
    (``torch.Generator().manual_seed(s)`` passed explicitly, e.g. to ``torch.randn(...,
    generator=g)``), build on ``meta`` and let ``fsdp.init`` initialise it, or pass
    ``fsdp.init(..., broadcast_from=0)``.

    Args:
        world_size: number of simulated ranks (all of them; for HSDP ``replicas * shard``).
        fn: called once per rank with that rank's :class:`SimulatedCollectives` first.
        mesh_shape: ``(replicas, shard)`` for an HSDP mesh; ``comm.world_size`` is then
            ``shard`` and ``comm.num_replicas`` is ``replicas``. Default: ``(1, world_size)``.
        timeout: seconds a collective waits for the other ranks before failing.

    Returns:
        ``[result_rank0, ..., result_rank{world_size-1}]`` (mesh order: replica-major).

    Raises:
        Any exception raised on a rank, re-raised here with a note naming the rank.

    Examples:
        >>> import torch, ragged as rg
        >>> def fn(comm):
        ...     out = torch.empty(2 * comm.world_size)
        ...     comm.all_gather_into(out, torch.full((2,), float(comm.rank)))
        ...     return out.tolist()
        >>> rg.collectives.simulate(2, fn)
        [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]
    """
    check_int("world_size", world_size)
    replicas, shard = (1, world_size) if mesh_shape is None else tuple(mesh_shape)
    if replicas * shard != world_size:
        raise RaggedValueError(f"mesh_shape {mesh_shape} has {replicas * shard} ranks but world_size is {world_size}.")
    world = _Group(world_size, timeout, "world")
    shard_groups = [_Group(shard, timeout, f"shard[{r}]") for r in range(replicas)]
    replica_groups = [_Group(replicas, timeout, f"replica[{s}]") for s in range(shard)] if replicas > 1 else None
    groups = [world, *shard_groups, *(replica_groups or [])]
    comms = []
    for r in range(replicas):
        for s in range(shard):
            comms.append(
                SimulatedCollectives(
                    s, shard_groups[r], r, None if replica_groups is None else replica_groups[s],
                    world if replicas > 1 else shard_groups[r],
                )
            )
    if replicas == 1:
        groups = [shard_groups[0]]
    return run_ranks(comms, fn, args, kwargs, groups, describe=lambda i: f"simulated rank {i} of {world_size}")


def _memberships(comm) -> list:
    """``(group, index)`` pairs of a simulated rank's comm (or of a mesh comm's axes and world)."""
    if hasattr(comm, "memberships"):
        return comm.memberships()
    parts = [*getattr(comm, "axes", {}).values(), getattr(comm, "world", None)]
    return [m for c in parts if c is not None for m in c.memberships()]


def run_ranks(comms, fn, args, kwargs, groups, *, describe) -> list:
    """Runs ``fn(comms[i], *args, **kwargs)`` on one thread per rank and returns the results.

    A rank that raises poisons its comm (so the other ranks' collectives fail fast, naming
    it, instead of waiting for their timeout), and so does a rank that returns while others
    may still wait for it. The failure is re-raised here, noted with ``describe(rank)``; the
    original failure is preferred over the errors it caused elsewhere.
    """
    n = len(comms)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def run(i):
        try:
            results[i] = fn(comms[i], *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[i] = e
            for g, index in _memberships(comms[i]):
                g.fail(index, f"{type(e).__name__}: {e}")
            return
        for g, index in _memberships(comms[i]):  # returned: a peer still waiting for it fails now
            g.depart(index)

    if n == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(i,), name=f"ragged-sim-rank{i}", daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if failed:
        primary = [(i, e) for i, e in failed if not isinstance(e, CollectiveError)] or failed
        i, e = primary[0]
        e.add_note(f"(raised on {describe(i)})")
        raise e
    return results
