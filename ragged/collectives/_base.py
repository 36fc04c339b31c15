"""The collectives protocol every backend implements.

Transforms talk to a ``Collectives`` value only; they never import torch.distributed.
All ops work on flat contiguous tensors. ``async_op=True`` returns a :class:`Handle`
whose ``wait()`` completes the op; otherwise the op is done on return (and ``None`` is
returned).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch

ReduceOp = Literal["sum", "mean", "max"]


@runtime_checkable
class Handle(Protocol):
    def wait(self) -> None: ...


@runtime_checkable
class Collectives(Protocol):
    """One shard group, seen from one rank.

    For HSDP the value also knows its replica group: ``reduce_scatter_into`` then reduces
    over every replica too, while ``all_gather_into`` stays within the shard group.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle | None:
        """``output`` (world_size * n) <- concatenation of every rank's ``input`` (n)."""

    def reduce_scatter_into(
        self, output: torch.Tensor, input: torch.Tensor, *, op: ReduceOp = "sum", async_op: bool = False
    ) -> Handle | None:
        """``output`` (n) <- chunk ``rank`` of the reduction of every rank's ``input`` (world_size * n)."""

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = "sum", async_op: bool = False) -> Handle | None:
        """In-place reduction over the shard group (and replicas, for HSDP: see ``all_reduce_replicas``)."""

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
        *, async_op: bool = False,
    ) -> Handle | None:
        """Uneven all-to-all of flat tensors (``input_splits[j]`` elements go to rank j)."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small picklable objects from every rank (used for plan checks before collectives)."""
