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

Optional: ``all_gather_into_coalesced(outputs, inputs, *, async_op)`` and
``reduce_scatter_into_coalesced(outputs, inputs, *, op, async_op)`` do what the single-tensor
ops do for each (output, input) pair, in one launch (both bundled backends have them; the
transforms fall back to one call per buffer for a backend without them). They move the buffers
of a multi-buffer plan (see ``transforms.all_gather_flat``).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch

from ragged._errors import RaggedValueError

ReduceOp = Literal["sum", "mean", "max"]
REDUCE_OPS = ("sum", "mean", "max")
# when transforms make the ranks agree on their plans (an optional ``plan_check`` attribute of a
# backend; absent means "every_call", the safe choice): see [Note: plan check before collectives] in ragged/transforms/_check.py
PLAN_CHECKS = ("every_call", "first_use")

__all__ = ["Collectives", "Handle", "ReduceOp", "REDUCE_OPS", "PLAN_CHECKS", "DoneHandle", "completed", "check_op", "check_coalesced"]


@runtime_checkable
class Handle(Protocol):
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
    for out, inp in zip(outputs, inputs, strict=True):
        big, small, name = (out, inp, "output") if gather else (inp, out, "input")
        if big.numel() != world_size * small.numel():
            raise RaggedValueError(
                f"{where}: an {name} has {big.numel()} elements, needs world_size * {small.numel()} = "
                f"{world_size * small.numel()}."
            )


@runtime_checkable
class Collectives(Protocol):
    """One shard group (and, for HSDP, its replica group), seen from one rank.

    See [Note: shard group and replica group].
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

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle | None:
        """``output`` (world_size * n) <- concatenation of every rank's ``input`` (n)."""

    def reduce_scatter_into(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", async_op: bool = False
    ) -> Handle | None:
        """``output`` (n) <- chunk ``rank`` of the reduction over the shard group of every
        rank's ``input`` (world_size * n). ``"mean"`` divides by ``world_size``."""

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = "sum", async_op: bool = False) -> Handle | None:
        """In-place reduction over the shard group."""

    def all_reduce_replicas(
        self, tensor: torch.Tensor, *, op: ReduceOp = "sum", async_op: bool = False
    ) -> Handle | None:
        """In-place reduction over the replica group (no-op without replicas)."""

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
        *, async_op: bool = False,
    ) -> Handle | None:
        """Uneven all-to-all of flat tensors (``input_splits[j]`` elements go to rank j)."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small picklable objects from every rank of the mesh (shard group x replicas), in
        mesh order (replica-major)."""
