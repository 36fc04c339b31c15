"""The collectives protocol every backend implements.

Transforms talk to a ``Collectives`` value only; they never import torch.distributed.
All ops work on flat contiguous tensors. ``async_op=True`` returns a :class:`Handle`
whose ``wait()`` completes the op; otherwise the op is done on return (and ``None`` is
returned).

[Note: shard group and replica group]
A ``Collectives`` value is one rank's view of a 1-D shard group (FSDP) or of a 2-D mesh
``(replicas, shard)`` (HSDP). ``rank`` / ``world_size`` always refer to the *shard group*:
``all_gather_into``, ``reduce_scatter_into``, ``all_reduce`` and ``all_to_all`` run within it.
``all_reduce_replicas`` runs across the replica group (a no-op when ``num_replicas == 1``),
and ``all_gather_object`` spans every rank of the mesh (used to compare plans).

Optional: ``all_gather_into_coalesced(outputs, inputs, *, async_op, label)`` and
``reduce_scatter_into_coalesced(outputs, inputs, *, op, async_op, label)`` do what the
single-tensor ops do for each (output, input) pair, in one launch (both bundled backends have
them; the transforms fall back to one call per buffer for a backend without them). They move
the buffers of a multi-buffer plan (see ``transforms.all_gather_flat``). A coalesced call is
ONE call in the sense of [Note: what a collective call carries]: one header per peer on gloo,
one ledger entry on NCCL, describing all its buffers.

[Note: what a collective call carries]
Every call carries its operation, dtype and sizes, an *identity* and a human-readable label,
and every rank must issue the same calls in the same order. The identity is what the caller
declared: the transforms declare their operation and plan fingerprints through
``check_plans`` (a :class:`CallScope` set on ``comm.scope`` for the rest of the entry point,
see :func:`poison_on_error`); a caller adds ``label="gather unit 'layers.3' forward #5"``
(compared across ranks too: keep rank-specific text out of it). How backends check it: the
torch backend on gloo before the data moves, on NCCL deferred (``_torch.py``); the simulated
backend at each rendezvous. A mismatch raises :class:`~ragged.PlanMismatchError` on every
rank, naming both sides.

A rank that fails where its peers would wait for it calls ``comm.poison(reason)``: its peers'
current or next collective raises :class:`~ragged.CollectiveError` "rank k failed: <reason>"
and the comm refuses further calls. :func:`poison_on_error` does that for a block of code
(the transforms' entry points use it through ``ragged.transforms._check.poisons``); the
backends do it themselves for failures inside a collective (a lost peer, a timeout).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch

from ragged._errors import RaggedValueError

ReduceOp = Literal["sum", "mean", "max"]
REDUCE_OPS = ("sum", "mean", "max")
# when transforms make the ranks agree on their plans (an optional ``plan_check`` attribute of a
# backend; absent means "every_call", the safe choice): see [Note: plan check before collectives] in ragged/transforms/_check.py
PLAN_CHECKS = ("every_call", "first_use")
HANDSHAKES = ("header", "deferred")  # see [Note: two transports] in _torch.py

# seconds a collective waits for a peer (its header, then its data) before the comm fails:
# long enough for a slow rank's step or checkpoint write, far shorter than gloo's 30 min
DEFAULT_TIMEOUT = 300.0

__all__ = ["Collectives", "Handle", "ReduceOp", "REDUCE_OPS", "PLAN_CHECKS", "DoneHandle", "completed", "check_op",
           "check_coalesced", "CallScope", "poison_on_error", "DEFAULT_TIMEOUT", "scoped_label", "BufferOps"]


class CallScope(NamedTuple):
    """What a transform declared for the collectives it is about to issue (see [Note: what a
    collective call carries]): ``identity``, a hash every rank must share (operation and plan
    fingerprints), and ``text``, the same in words (error messages).

    Examples:
        >>> from ragged.collectives import CallScope
        >>> CallScope(identity=1234, text="gather of plan 3f2a").text
        'gather of plan 3f2a'
    """

    identity: int
    text: str


def scoped_label(scope: CallScope | None, label: str | None) -> str:
    """The text a call carries: its scope's and the caller's label."""
    if scope is None:
        return label or ""
    return f"{scope.text}: {label}" if label else scope.text


class poison_on_error:  # noqa: N801 - used as a context manager, like contextlib's
    """``with poison_on_error(comm): ...``: an exception raised inside (other than one that
    every rank raises at the same point, such as a :class:`~ragged.PlanMismatchError` from the
    agreement) poisons ``comm`` (``comm.poison(reason)``, when it has one) before it
    propagates, so the peers raise instead of waiting for this rank. It also restores
    ``comm.scope`` on exit. See [Note: what a collective call carries].

    Examples:
        >>> import ragged as rg
        >>> def fn(comm):
        ...     with rg.collectives.poison_on_error(comm):
        ...         if comm.rank == 1:
        ...             raise RuntimeError("bad batch")
        ...     comm.barrier()              # rank 0 does not wait for the timeout
        >>> try:
        ...     rg.collectives.simulate(2, fn)
        ... except RuntimeError as err:
        ...     print(err)
        bad batch
    """

    __slots__ = ("comm", "scope")

    def __init__(self, comm):
        self.comm = comm

    def __enter__(self):
        self.scope = getattr(self.comm, "scope", None)
        return self.comm

    def __exit__(self, kind, exc, tb):
        comm = self.comm
        if exc is not None and not getattr(exc, "_ragged_every_rank", False):
            poison = getattr(comm, "poison", None)
            if poison is not None:
                poison(f"{type(exc).__name__}: {exc}")
        if hasattr(comm, "scope"):
            comm.scope = self.scope
        return False


@runtime_checkable
class Handle(Protocol):
    """What an ``async_op=True`` collective returns: ``wait()`` blocks until the op is done
    (its output is then valid). A comm's handles may also have ``is_completed()``.

    Examples:
        >>> import torch, ragged as rg
        >>> def fn(comm):
        ...     out = torch.empty(2)
        ...     handle = comm.all_gather_into(out, torch.full((1,), float(comm.rank)), async_op=True)
        ...     handle.wait()
        ...     return out.tolist()
        >>> rg.collectives.simulate(2, fn)
        [[0.0, 1.0], [0.0, 1.0]]
    """

    def wait(self) -> None: ...


class DoneHandle:
    """A handle of an op that already completed (``wait()`` does nothing)."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def completed(handle) -> bool:
    """Whether an async op's handle says it has finished (``wait()`` would not block); a
    handle without ``is_completed`` counts as not finished."""
    probe = getattr(handle, "is_completed", None)
    return bool(probe()) if probe is not None else False


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise RaggedValueError(f"op must be one of {REDUCE_OPS}, got {op!r}.")
    return op


def check_coalesced(outputs, inputs, world_size: int, where: str, *, gather: bool) -> None:
    """Sizes of a coalesced op's (output, input) pairs: ``world_size`` times the input (all-gather)
    or the output (reduce-scatter)."""
    if len(outputs) != len(inputs):
        raise RaggedValueError(f"{where}: {len(outputs)} outputs for {len(inputs)} inputs.")
    for out, inp in zip(outputs, inputs):
        big, small, name = (out, inp, "output") if gather else (inp, out, "input")
        if big.numel() != world_size * small.numel():
            raise RaggedValueError(
                f"{where}: an {name} has {big.numel()} elements, needs world_size * {small.numel()} = "
                f"{world_size * small.numel()}."
            )


class BufferOps:
    """The all-gather and reduce-scatter verbs of the bundled backends, single-tensor and
    coalesced, as one call of the backend's ``_all_gather(outs, ins, async_op, label, where)`` /
    ``_reduce_scatter(outs, ins, op, async_op, label, where)`` over lists of buffers: a
    single-tensor op is the one-buffer case, so both forms carry the same checks."""

    def all_gather_into(self, output, input, *, async_op=False, label=None):
        return self._all_gather([output], [input], async_op, label, "all_gather_into")

    def all_gather_into_coalesced(self, outputs, inputs, *, async_op=False, label=None):
        return self._all_gather(list(outputs), list(inputs), async_op, label, "all_gather_into_coalesced")

    def reduce_scatter_into(self, output, input, *, op="sum", async_op=False, label=None):
        return self._reduce_scatter([output], [input], op, async_op, label, "reduce_scatter_into")

    def reduce_scatter_into_coalesced(self, outputs, inputs, *, op="sum", async_op=False, label=None):
        return self._reduce_scatter(list(outputs), list(inputs), op, async_op, label, "reduce_scatter_into_coalesced")


@runtime_checkable
class Collectives(Protocol):
    """One shard group (and, for HSDP, its replica group), seen from one rank.

    See [Note: shard group and replica group].

    Examples:
        >>> import torch, ragged as rg
        >>> def fn(comm):                                  # any backend: simulated here, torch.distributed in a job
        ...     x = torch.full((2,), float(comm.rank + 1))
        ...     comm.all_reduce(x, op="sum")
        ...     return comm.rank, comm.world_size, x.tolist()
        >>> rg.collectives.simulate(2, fn)
        [(0, 2, [3.0, 3.0]), (1, 2, [3.0, 3.0])]
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_replicas(self) -> int: ...

    @property
    def replica_rank(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """The device tensors passed to this backend live on."""

    def all_gather_into(self, output, input, *, async_op: bool = False, label: str | None = None) -> Handle | None:
        """``output`` (world_size * n) <- concatenation of every rank's ``input`` (n).
        ``label``: see [Note: what a collective call carries]."""

    def reduce_scatter_into(
        self, output, input, *, op: ReduceOp = "sum", async_op: bool = False, label: str | None = None
    ) -> Handle | None:
        """``output`` (n) <- chunk ``rank`` of the reduction over the shard group of every
        rank's ``input`` (world_size * n). ``"mean"`` divides by ``world_size``."""

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp = "sum", async_op: bool = False, label: str | None = None
    ) -> Handle | None:
        """In-place reduction over the shard group (the same bits on every rank)."""

    def all_reduce_replicas(
        self, tensor: torch.Tensor, *, op: ReduceOp = "sum", async_op: bool = False, label: str | None = None
    ) -> Handle | None:
        """In-place reduction over the replica group (no-op without replicas)."""

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
        *, async_op: bool = False, label: str | None = None,
    ) -> Handle | None:
        """Uneven all-to-all of flat tensors (``input_splits[j]`` elements go to rank j)."""

    def all_gather_object(self, obj: Any, *, label: str | None = None) -> list[Any]:
        """Small picklable objects from every rank of the mesh (shard group x replicas), in
        mesh order (replica-major)."""

    def barrier(self, *, label: str | None = None) -> None:
        """Returns once every rank of the mesh has called it."""

    def verify(self) -> None:
        """Checks now that every call so far agreed across ranks (a backend that checks late,
        such as the torch backend on NCCL, does it here; others return at once). Call it at the
        same point on every rank."""

    def poison(self, reason: str) -> None:
        """Fails this comm on every rank: peers raise "rank k failed: <reason>" at their
        current or next collective, and this comm refuses further calls (see [Note: what a
        collective call carries]). Idempotent."""
