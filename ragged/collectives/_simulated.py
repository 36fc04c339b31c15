"""An in-process simulated mesh: m ranks as m threads of this process.

For notebooks and property tests. Every collective is a rendezvous of the group's threads
(``threading.Barrier`` with a timeout, so a rank that skips a collective gives a clear error
instead of a hang). Results equal the torch backend's bit for bit up to summation order.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ragged._errors import RaggedError, RaggedValueError
from ragged.collectives._base import DoneHandle, check_coalesced, check_op

__all__ = ["SimulatedCollectives", "simulate"]


class _Group:
    """Rendezvous state of one group of simulated ranks."""

    def __init__(self, size: int, timeout: float, name: str):
        self.size = size
        self.name = name
        self.timeout = timeout
        self.barrier = threading.Barrier(size, timeout=timeout) if size > 1 else None
        self.slots: list[Any] = [None] * size
        self.ops: list[str | None] = [None] * size

    def exchange(self, index: int, opname: str, value):
        if self.size == 1:
            return [value]
        self.slots[index] = value
        self.ops[index] = opname
        self._wait(index, opname)
        values, ops = list(self.slots), list(self.ops)
        self._wait(index, opname)
        if len(set(ops)) > 1:
            raise RaggedError(
                f"simulated {self.name} group: ranks called different collectives at the same step: "
                f"{dict(enumerate(ops))}. Every rank must issue the same collectives in the same order."
            )
        return values

    def _wait(self, index, opname):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise RaggedError(
                f"simulated {self.name} group: rank {index} waited in {opname} but the other ranks did not "
                f"arrive within {self.timeout}s (or a rank failed). Every rank must issue the same "
                "collectives in the same order."
            ) from None

    def abort(self):
        if self.barrier is not None:
            self.barrier.abort()


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


class SimulatedCollectives:
    """:class:`~ragged.collectives.Collectives` for one simulated rank (see :func:`simulate`).

    Async ops complete immediately; their handle's ``wait()`` does nothing.
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

    def all_gather_into(self, output, input, *, async_op=False):
        m, n = self.world_size, input.numel()
        if output.numel() != m * n:
            raise RaggedValueError(f"all_gather_into: output has {output.numel()} elements, needs world_size * {n} = {m * n}.")
        values = self._shard.exchange(self._rank, "all_gather", _plain(input).clone())
        with torch.no_grad():
            for j, v in enumerate(values):
                output[j * n : (j + 1) * n].copy_(v.reshape(-1))
        return self._done(async_op)

    def all_gather_into_coalesced(self, outputs, inputs, *, async_op=False):
        m = self.world_size
        check_coalesced(outputs, inputs, m, "all_gather_into_coalesced", gather=True)
        values = self._shard.exchange(self._rank, "all_gather_coalesced", [_plain(i).clone() for i in inputs])
        with torch.no_grad():
            for b, (out, inp) in enumerate(zip(outputs, inputs)):
                n = inp.numel()
                for j, v in enumerate(values):
                    out[j * n : (j + 1) * n].copy_(v[b].reshape(-1))
        return self._done(async_op)

    def reduce_scatter_into_coalesced(self, outputs, inputs, *, op="sum", async_op=False):
        check_op(op)
        m = self.world_size
        check_coalesced(outputs, inputs, m, "reduce_scatter_into_coalesced", gather=False)
        values = self._shard.exchange(self._rank, f"reduce_scatter_coalesced_{op}", [_plain(i).clone() for i in inputs])
        with torch.no_grad():
            for b, out in enumerate(outputs):
                n = out.numel()
                chunks = [v[b].reshape(-1)[self._rank * n : (self._rank + 1) * n] for v in values]
                out.copy_(self._reduce(chunks, op, out).view_as(out))
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

    def reduce_scatter_into(self, output, input, *, op="sum", async_op=False):
        check_op(op)
        m, n = self.world_size, output.numel()
        if input.numel() != m * n:
            raise RaggedValueError(f"reduce_scatter_into: input has {input.numel()} elements, needs world_size * {n} = {m * n}.")
        values = self._shard.exchange(self._rank, f"reduce_scatter_{op}", _plain(input).clone())
        chunks = [v.reshape(-1)[self._rank * n : (self._rank + 1) * n] for v in values]
        with torch.no_grad():
            output.copy_(self._reduce(chunks, op, output).view_as(output))
        return self._done(async_op)

    def _all_reduce(self, group, index, tensor, op, async_op):
        check_op(op)
        values = group.exchange(index, f"all_reduce_{op}", _plain(tensor).clone())
        with torch.no_grad():
            tensor.copy_(self._reduce(values, op, tensor))
        return self._done(async_op)

    def all_reduce(self, tensor, *, op="sum", async_op=False):
        return self._all_reduce(self._shard, self._rank, tensor, op, async_op)

    def all_reduce_replicas(self, tensor, *, op="sum", async_op=False):
        if self._replica is None:
            check_op(op)
            return self._done(async_op)
        return self._all_reduce(self._replica, self._replica_rank, tensor, op, async_op)

    def all_to_all(self, output, input, output_splits, input_splits, *, async_op=False):
        m = self.world_size
        if len(input_splits) != m or len(output_splits) != m:
            raise RaggedValueError(f"all_to_all: splits must have world_size={m} entries.")
        flat = _plain(input).reshape(-1)
        starts = [sum(input_splits[:j]) for j in range(m)]
        parts = [flat[s : s + k].clone() for s, k in zip(starts, input_splits)]
        values = self._shard.exchange(self._rank, "all_to_all", parts)
        with torch.no_grad():
            pos = 0
            for j in range(m):
                piece = values[j][self._rank]
                if piece.numel() != output_splits[j]:
                    raise RaggedValueError(
                        f"all_to_all: rank {self._rank} expected {output_splits[j]} elements from rank {j}, "
                        f"got {piece.numel()}."
                    )
                output[pos : pos + piece.numel()].copy_(piece)
                pos += piece.numel()
        return self._done(async_op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._world.exchange(self._global_rank, "all_gather_object", obj)

    def barrier(self) -> None:
        self._world.exchange(self._global_rank, "barrier", None)


def simulate(world_size: int, fn, *args, mesh_shape: tuple[int, int] | None = None, timeout: float = 60.0, **kwargs):
    """Runs ``fn(comm, *args, **kwargs)`` on ``world_size`` simulated ranks (threads).

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
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise RaggedValueError(f"world_size must be a positive int, got {world_size!r}.")
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


def run_ranks(comms, fn, args, kwargs, groups, *, describe) -> list:
    """Runs ``fn(comms[i], *args, **kwargs)`` on one thread per rank and returns the results.

    The first failure aborts every group (so the other ranks' collectives fail fast instead
    of waiting for their timeout) and is re-raised here, noted with ``describe(rank)``; the
    original failure is preferred over the "did not arrive" errors it caused elsewhere.
    """
    n = len(comms)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def run(i):
        try:
            results[i] = fn(comms[i], *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[i] = e
            for g in groups:
                g.abort()

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
        primary = [(i, e) for i, e in failed if "did not arrive" not in str(e)] or failed
        i, e = primary[0]
        e.add_note(f"(raised on {describe(i)})")
        raise e
    return results
