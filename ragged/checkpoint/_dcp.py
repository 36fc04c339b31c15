"""DCP planners for ragged pieces, and the driver that runs DCP's save/load protocol over a
ragged ``Collectives``.

[Note: ragged pieces as DCP chunks]
DCP describes a sharded tensor by chunks (offsets + sizes in the global tensor). DTensor cannot
say "rank 1 holds rows 1..7 of 10" (its chunk rule is ``torch.chunk``'s; torch-notes measured
``from_local`` with ragged shards writing wrong metadata). So ragged does not wrap tensors at
all: every leaf is stored as a 1-D tensor of ``numel`` elements and each piece
``[start, stop)`` a rank holds is one chunk at offset ``start``. The planners below emit those
chunks directly (``WriteItem``/``ReadItem``), from a table of ``fqn -> [(start, tensor)]``.
Resharding on load is DCP's own overlap computation
(``create_read_items_for_chunk_list``): any saved chunking can be read into any other.
The same planners move the N-D :class:`Chunk` s of another writer's checkpoints (FSDP2 /
torchtitan, see [Note: a flat range as boxes] in ``_boxes.py``) and the small non-tensor values
DCP stores as bytes (:class:`Blob`: an optimizer's param groups).

[Note: the driver]
``torch.distributed.checkpoint.save``/``load`` need a torch ProcessGroup. ragged code talks to a
``Collectives`` value (gloo, NCCL, or the in-process simulated mesh), so this module runs the
same protocol (set up, local plans, global plan, write, coordinator's finish) with
one exchange per phase as its only collective (see [Note: every rank plans globally] and
[Note: the exchange connects every pair]). Every phase catches the local error
and gathers it, so a failure on one rank is raised on every rank, with that rank's message,
instead of leaving the others waiting in the next collective. The files are plain DCP
(``FileSystemWriter``/``FileSystemReader``): ``torch.distributed.checkpoint.load`` or
``format_utils.dcp_to_torch_save`` can read them without ragged.
"""

from __future__ import annotations

import dataclasses
import io
import traceback
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ragged.checkpoint._format import CheckpointError, error_type
from ragged.collectives._agree import agree, everyone
from ragged.collectives._channel import raised_on_every_rank
from ragged.checkpoint._metadata import reader as checked_reader

__all__ = ["Piece", "Chunk", "Blob", "on_every_rank", "DcpWrite", "dcp_save", "written_names", "dcp_load", "SingleProcess", "reached"]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One contiguous chunk of a 1-D stored tensor: elements ``[start, start + tensor.numel())``
    of the tensor ``fqn`` of ``numel`` elements."""

    fqn: str
    start: int
    numel: int
    tensor: torch.Tensor  # 1-D; the source (save) or the destination view (load)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One N-D box of a stored tensor: ``tensor`` (of the box's sizes) at ``offsets`` of the
    tensor ``fqn`` of shape ``size`` (another writer's layout, e.g. FSDP2's row blocks)."""

    fqn: str
    offsets: tuple[int, ...]
    size: tuple[int, ...]
    tensor: torch.Tensor  # the source (save) or the destination view (load)


@dataclasses.dataclass(frozen=True, slots=True)
class Blob:
    """A non-tensor value DCP stores as bytes (``torch.save``): ``value`` on save; on load the
    value read (``torch.load(weights_only=True)``: plain Python values only) goes to
    ``into[fqn]``."""

    fqn: str
    value: Any = None
    into: dict | None = None


def _box(p: Piece | Chunk) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes, size)`` of a piece (1-D) or a chunk in its stored tensor."""
    if isinstance(p, Piece):
        return (p.start,), (p.tensor.numel(),), (p.numel,)
    return tuple(p.offsets), tuple(p.tensor.shape), tuple(p.size)


class SingleProcess:
    """A one-rank stand-in for a Collectives (export and other single-process reads).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> comm = rg.checkpoint.SingleProcess()
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = rg.checkpoint.save(path, {"x": torch.arange(3.0)}, comm)   # no process group needed
        >>> rg.checkpoint.load(path, {"x": torch.zeros(3)}, comm)["x"].tolist()
        [0.0, 1.0, 2.0]
    """

    rank = 0
    world_size = 1

    def all_gather_object(self, obj):
        return [obj]



def _who(comm, index: int) -> str:
    if getattr(comm, "num_replicas", 1) == 1:
        return f"rank {index}"
    return f"rank {index % comm.world_size} of replica {index // comm.world_size}"


# [Note: protocol steps] ``reached(step)`` marks each step of the save and load protocols
# (``_save.SAVE_STEPS``, ``_load.LOAD_STEPS``). ``FAULT``, when set (tests only), is called with
# the step's name: the fault tests stop a process there (os._exit) to check that every other rank
# raises promptly and that the path always holds a complete checkpoint.
FAULT: Callable[[str], None] | None = None


def reached(step: str) -> None:
    if FAULT is not None:
        FAULT(step)


def on_every_rank(comm, call: str, step: str, fn: Callable[[], Any], *, failure: Exception | None = None) -> list[Any]:
    """Runs ``fn()`` on every rank and gathers the results (indexed as :func:`everyone`); if any
    rank failed, raises on every rank (a CheckpointError subclass named by the first failing
    rank's error). ``failure``: this rank's error in preparing the call (checking its state),
    which joins the round in place of ``fn()``'s result and is raised on this rank as it is (see
    [Note: a rank's error joins the next agreement] in ``ragged/collectives/_agree.py``).

    ``call`` names the checkpoint call (``"save('/x/ckpt')"``) and ``step`` its round: ranks in
    another call or another round (a rank saving another path, loading while the others save)
    make every rank raise before any result is used. The only collective is one round of
    :func:`~ragged.collectives._agree.agree` (objects only: every rank's outcome), which every
    rank reaches whether or not its ``fn`` raised: an error on one rank never leaves the others
    waiting. If the round itself fails (a rank died or left the call), this rank raises a
    CheckpointError (the comm poisons itself, so that peers in other collectives fail too).

    [Note: the exchange connects every pair]
    The round is ``comm.all_gather_object``, which both transports run between every pair of
    ranks (gloo's default: one checked exchange with each peer; NCCL's shape: native
    all-gathers waited like its other calls), not as gloo's own object all-gather, a ring: when a
    rank dies, a ring tells only its two neighbours at once and the others wait for the group
    timeout (measured: 30 s of 30 s at W=4), where every survivor of an all-pairs round fails within
    milliseconds. Objects come from the other ranks of this job, never from disk.
    """
    try:
        if failure is not None:
            raise failure
        out = (True, fn())
    except CheckpointError as exc:
        out = (False, (type(exc).__name__, str(exc)))
    except Exception as exc:  # noqa: BLE001 - forwarded to every rank below
        text = f"{type(exc).__name__}: {exc}"
        tb = traceback.format_exc(limit=4)
        out = (False, ("CheckpointError", f"{text}\n{tb}"))
    what = f"checkpoint {call} ({step})"
    try:
        results = agree(comm, explain=lambda _: (call, step, out), label="checkpoint").details
    except BaseException as exc:  # noqa: BLE001 - a torch error from the collective: say which call
        if failure is not None:  # this rank's own error says more than the round's
            raise failure
        reason = f"{what}: the ranks could not exchange ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        if not isinstance(exc, Exception):
            raise
        raise CheckpointError(f"{reason}; a rank died, was killed, or is not in this checkpoint call.") from exc
    calls = [(c, s) for c, s, _ in results]
    if len(set(calls)) > 1:
        mine = calls[everyone(comm)[0]]
        others = "; ".join(f"{_who(comm, i)} is in {c} ({s})" for i, (c, s) in enumerate(calls) if (c, s) != mine)
        raise CheckpointError(
            f"{what}: the ranks are not in the same checkpoint call: {others}. Every rank must call the "
            "same rg.checkpoint.save / load with the same path, at the same point of the program."
        )
    failures = [(rank, payload) for rank, (_, _, (ok, payload)) in enumerate(results) if not ok]
    if failure is not None:
        raise raised_on_every_rank(failure)
    if failures:
        index, (name, message) = failures[0]
        others = [_who(comm, i) for i, _ in failures[1:]]
        extra = f" ({', '.join(others)} failed too)" if others else ""
        if len(results) == 1:
            raise error_type(name)(f"{what}: {message}")
        raise error_type(name)(f"{what} failed on {_who(comm, index)}{extra}: {message}")
    return [payload for _, _, (_, payload) in results]


# ---- save -------------------------------------------------------------------------------------
class _PieceSavePlanner(DefaultSavePlanner):
    """Writes the given pieces, chunks and blobs, nothing else (see [Note: ragged pieces as DCP chunks])."""

    def __init__(self, pieces: list[Piece | Chunk | Blob]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blobs = {p.fqn: p for p in pieces if isinstance(p, Blob)}
        self._pieces = {(p.fqn, _box(p)[0]): p for p in pieces if not isinstance(p, Blob)}

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self._blobs]
        for (fqn, offsets), piece in self._pieces.items():
            _, sizes, size = _box(piece)
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                        properties=TensorProperties.create_from_tensor(piece.tensor),
                        size=torch.Size(size),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            data = io.BytesIO()
            torch.save(self._blobs[write_item.index.fqn].value, data)
            data.seek(0)
            return data
        return self._pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor.detach()


class DcpWrite:
    """One DCP checkpoint written from this rank's pieces, in three phases: :meth:`plan` (every
    rank, one round), :meth:`write` (this rank's files: no collective, so it may run on another
    thread, see [Note: a save in the background] in ``_background.py``) and :meth:`finish` (the
    coordinator's ``.metadata``, from every rank's write results).

    ``pieces`` may be a function that makes them, run inside the first round (an error there
    raises on every rank). Pieces with the same ``(fqn, offset)`` on several ranks (replicated
    values) are written once.
    """

    def __init__(self, path: str, pieces: list[Piece | Chunk | Blob] | Callable[[], list], comm, call: str):
        self.pieces, self.comm, self.call = pieces, comm, call
        self.writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.me = everyone(comm)[0]
        self.planner = None

    def plan(self) -> None:
        """The local plans exchanged; every rank derives the global plan and keeps its part.

        [Note: every rank plans globally] DCP's coordinator builds the global plan and scatters
        it; the Collectives protocol has no scatter, and broadcasting every plan to every rank
        through all_gather_object would cost world_size x the plans on each rank. The global
        plan is a deterministic function of the gathered local plans (dedup, index hints, file
        prefixes), so every rank computes it and keeps its own part."""
        coordinator = self.me == 0

        def local_step():
            self.planner = _PieceSavePlanner(self.pieces() if callable(self.pieces) else self.pieces)
            self.planner.set_up_planner(is_coordinator=coordinator)
            self.writer.set_up_storage_writer(coordinator, rank=self.me, use_collectives=True)
            return self.writer.prepare_local_plan(self.planner.create_local_plan())

        all_local = on_every_rank(self.comm, self.call, "local plans", local_step)
        plans, self.metadata = self.planner.create_global_plan(all_local)  # the same inputs on every rank
        self.final = self.planner.finish_plan(self.writer.prepare_global_plan(plans)[self.me])

    def write(self) -> list:
        """Writes this rank's files; returns its write results (no collective)."""
        future = self.writer.write_data(self.final, self.planner)
        future.wait()
        reached("written")
        return future.value()

    def finish(self, all_results: list) -> None:
        """The coordinator (index 0) writes ``.metadata``, given every rank's write results."""
        if self.me == 0:
            self.writer.finish(metadata=self.metadata, results=all_results)


def dcp_save(path: str, pieces: list[Piece | Chunk | Blob] | Callable[[], list], comm, call: str) -> list[str]:
    """Writes ``pieces`` (this rank's, or a function that makes them: see :class:`DcpWrite`) as a
    DCP checkpoint in ``path``; every rank calls it (``call`` names the checkpoint call for
    :func:`on_every_rank`). Returns the names of the files this rank wrote (rank 0's list
    includes ``.metadata``)."""
    dcp = DcpWrite(path, pieces, comm, call)
    dcp.plan()
    all_results = on_every_rank(comm, call, "writing data", dcp.write)

    def finish_step():
        dcp.finish(all_results)
        return written_names(all_results[dcp.me]) + ([".metadata"] if dcp.me == 0 else [])

    return on_every_rank(comm, call, "metadata", finish_step)[dcp.me]


def written_names(results) -> list[str]:
    """The files one rank's write results name."""
    return sorted({r.storage_data.relative_path for r in results})


# ---- load -------------------------------------------------------------------------------------
class _PieceLoadPlanner(DefaultLoadPlanner):
    """Reads exactly the given destination pieces, chunks and blobs (any saved chunking; DCP
    computes overlaps)."""

    def __init__(self, pieces: list[Piece | Chunk | Blob]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = pieces

    def set_up_planner(self, state_dict=None, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        self._by_index: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._blobs: dict[str, Blob] = {}
        for piece in self._pieces:
            if isinstance(piece, Blob):
                self._blobs[piece.fqn] = piece
                index = MetadataIndex(piece.fqn)
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                      storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
                continue
            if piece.tensor.numel() == 0:
                continue
            offsets, sizes, _ = _box(piece)
            md = self.metadata.state_dict_metadata[piece.fqn]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            self._by_index[(piece.fqn, offsets)] = piece.tensor
            items.extend(create_read_items_for_chunk_list(piece.fqn, md, [chunk]))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem):
        dest = self._by_index[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, offset, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item, value) -> None:
        blob = self._blobs.get(read_item.dest_index.fqn)
        if blob is None:  # ragged stores no byte items
            raise CheckpointError(f"unexpected byte item {read_item.dest_index.fqn!r} in a ragged checkpoint.")
        blob.into[blob.fqn] = torch.load(value, weights_only=True)


def dcp_load(path: str, pieces: list[Piece | Chunk | Blob] | Callable[[], list], metadata: Metadata, comm,
             call: str) -> None:
    """Fills the destination ``pieces`` (this rank's) from the DCP checkpoint at ``path``;
    ``pieces`` may be a function that makes them (allocating them: an error there raises on
    every rank).

    [Note: load plans are local]
    DCP's default load planner's global step is the identity and ``FileSystemReader`` plans
    nothing globally, so each rank plans and reads on its own; one gather at the end reports
    errors from every rank to every rank.
    """

    def read_step():
        planner = _PieceLoadPlanner(pieces() if callable(pieces) else pieces)
        reader = checked_reader(path)
        me, _ = everyone(comm)
        planner.set_up_planner(metadata=metadata, is_coordinator=me == 0)
        reader.set_up_storage_reader(metadata, me == 0, rank=me, use_collectives=True)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(plan)
        reader.read_data(plan, planner).wait()
        reached("read")
        return None

    on_every_rank(comm, call, "reading data", read_step)
