"""Unit-sized buffers reused within one action of the step's runtime.

[Note: reusing unit buffers]
A unit's gathered storage and its flat gradient buffer have the same size (``m * S`` elements
of the compute dtype), and units of one model mostly share a few sizes (every block alike).
Each runtime action (entering a forward entry, processing backward events, the end of a
phase) frees some of them and then allocates others: the :class:`Pool` keeps what the action
frees and hands it to what the same action allocates, and frees the rest when the action ends
(:meth:`Pool.settle`). So a buffer is never kept while the model computes: the pool cannot raise
a peak, and memory stays what the schedule says. It saves the allocator round trip, and on the
CPU the first touch of fresh pages (copies into freshly mapped memory run at a fraction of
memcpy speed): a unit's all-gather usually writes the storage the previous unit's release
just gave back. (Keeping buffers from one action to the next would save more first touches but
hold memory at the start of backward, where the peak usually is.)

A unit's storage keeps its identity (the leaves are views of it; the runtime maps it back to
the unit by storage): the pool's memory is moved into it and out of it with
``UntypedStorage._swap_data_ptr_`` (where torch lacks it, ``ragged._compat.CAN_SWAP_STORAGE``:
``resize_`` and no reuse).

Lifetimes across streams (see [Note: streams and lifetimes] in ``_device.py``): a buffer given
back carries *fences*, the events after its last use on each stream; whoever uses it next waits
on them first: a :meth:`Pool.take` on another stream, and at :meth:`Pool.settle` the stream that
allocated it (the caching allocator gives a freed block only to that stream's allocations).
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["Pool", "Block"]

_ids = itertools.count()


class Block:
    """Memory the pool handed out: ``storage`` (``nbytes``), allocated on stream ``owner``;
    ``key`` names it to the streams strategy (``alloc`` / ``free`` / ``access``)."""

    __slots__ = ("storage", "nbytes", "owner", "key", "fences")

    def __init__(self, storage, nbytes: int, owner: str):
        self.storage, self.nbytes, self.owner = storage, nbytes, owner
        self.key, self.fences = ("block", next(_ids)), []

    def tensor(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` over this block."""
        return torch.empty(0, dtype=dtype, device=self.storage.device).set_(self.storage, 0, (numel,))


class Pool:
    """See [Note: reusing unit buffers]."""

    def __init__(self, device: torch.device, streams):
        self.device, self.streams = device, streams
        self.spare: dict[int, list[Block]] = {}

    def take(self, nbytes: int, stream: str) -> Block:
        """A block of ``nbytes`` for ``stream``: a spare one (``stream`` waits on its fences
        first) or a new one, allocated on ``stream`` after the spares of other sizes are freed
        (holding them while allocating would raise the peak)."""
        spare = self.spare.get(nbytes)
        if spare:
            block = spare.pop()
            for ev in block.fences:
                self.streams.wait(stream, ev)
            block.fences = []
            return block
        self.settle()
        with self.streams.on(stream):
            storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        block = Block(storage, nbytes, stream)
        self.streams.alloc(stream, block.key, nbytes)
        return block

    def give(self, block: Block, fences=()) -> None:
        """``block`` is free once ``fences`` (events after its last uses) have passed."""
        block.fences = [ev for ev in fences if ev is not None]
        self.spare.setdefault(block.nbytes, []).append(block)

    def settle(self) -> None:
        """The action ended: frees every spare block (its allocating stream waits on its fences)."""
        if not self.spare:
            return
        for blocks in self.spare.values():
            for block in blocks:
                for ev in block.fences:
                    self.streams.wait(block.owner, ev)
                self.streams.free(block.key)
        self.spare = {}


def attach(storage, block: Block) -> None:
    """Moves ``block``'s memory into the (empty) ``storage``, which keeps its identity."""
    storage._swap_data_ptr_(block.storage)


def detach(storage, block: Block) -> None:
    """Moves ``storage``'s memory back into ``block`` (whose storage is empty); ``storage`` is left empty."""
    storage._swap_data_ptr_(block.storage)
