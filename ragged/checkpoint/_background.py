"""Saving in the background: ``rg.checkpoint.save(path, state, comm, blocking=False)``.

[Note: a save in the background]
A save has collective parts (the state agreed, the write plans exchanged, the checksums
exchanged, the publication) and local parts (writing this rank's files, hashing them). The
collective parts stay on the calling thread, where every rank issues them at the same point of
its program (NCCL's rule: the same collectives in the same order on every rank; a thread of its
own would interleave them with the step's differently on each rank). So ``blocking=False``:

* at the call: finishes the save still in flight (below), agrees the state and the write plans
  (the rounds of a blocking save), copies this rank's pieces into host buffers (:func:`stage`:
  one copy per source tensor, into buffers kept for the next save; pinned when the state is on a
  GPU, whose copies are queued on the current stream, behind which the next step's kernels
  run), and returns a :class:`SaveHandle`;
* on a thread: writes this rank's files from the copies and hashes them, with no collective;
* at the next ``save``, at ``handle.result()`` or at the interpreter's exit (every rank alike):
  waits for the thread, then the last two rounds: every rank's checksums, or its error, reach
  every rank (:func:`~ragged.checkpoint._dcp.on_every_rank`, an agreement round, never a
  timeout), and rank 0 writes the metadata and the manifest and publishes the directory by
  rename (see [Note: publish by rename] in ``_save.py``).

So at most one save is in flight; its error is raised on every rank by whichever of those comes
first (and again by a later ``result()`` of its handle). Until then the checkpoint is not at its
path: a process killed during a background save leaves the previous checkpoints as they were
(the unpublished files stay in a hidden ``.<name>.tmp-*`` sibling). The copies cost host memory
as large as what this rank writes (``handle.staged_bytes``: its shards, optimizer state and
per-rank values), held from the first background save on (docs/checkpointing.md measures it).
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Any, Callable

import torch

from ragged.checkpoint._dcp import Piece

__all__ = ["SaveHandle", "stage", "start", "settle"]


class _Slot(threading.local):
    """Per thread of the program (each rank of ``rg.collectives.simulate`` is one): the save in
    flight and the staging buffers."""

    def __init__(self):
        self.in_flight: list = []  # the one SaveHandle in flight, if any
        self.buffers: dict[tuple, torch.Tensor] = {}  # (dtype, pinned) -> the staging buffer, kept for the next save


_SLOT = _Slot()


class SaveHandle:
    """A background save (see [Note: a save in the background]): returned by
    ``rg.checkpoint.save(..., blocking=False)`` once this rank's pieces are copied.

    ``result()`` waits for it, publishes it and returns its manifest (or raises its error, on
    every rank); ``done()`` says whether this rank's files are written.

    Attributes:
        path: the checkpoint's directory.
        staged_bytes: host bytes this rank's copies take.

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> state = {"x": torch.arange(4.0), "step": 3}
        >>> handle = rg.checkpoint.save(path, state, rg.checkpoint.SingleProcess(), blocking=False)
        >>> state["x"].zero_(), handle.staged_bytes          # copied at the call: 4 float32
        (tensor([0., 0., 0., 0.]), 16)
        >>> os.path.exists(path), handle.result()["entries"]["['step']"]["value"], os.path.exists(path)
        (False, 3, True)
    """

    def __init__(self, save, staged_bytes: int, ready: Callable[[], None]):
        self.path, self.staged_bytes = save.path, staged_bytes
        self._save, self._ready = save, ready
        self._written: tuple | None = None
        self._error: BaseException | None = None
        self._manifest: dict | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name=f"ragged-save {save.path} rank {save.me}", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            self._ready()
            self._written = self._save.write()
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the next round
            self._error = exc

    def _outcome(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._written

    def done(self) -> bool:
        """This rank's files are written (or failed); the checkpoint is published only by the
        next ``save``, :meth:`result` or the interpreter's exit."""
        return not self._thread.is_alive()

    def result(self) -> dict[str, Any]:
        """Waits for the save, publishes it and returns its manifest; call it on every rank.

        Raises:
            CheckpointError: the save failed on some rank (on every rank, naming it).
        """
        if _SLOT.in_flight and _SLOT.in_flight[0] is self:
            settle()
        if self._failure is not None:
            raise self._failure
        return self._manifest

    def _finish(self) -> None:
        try:
            self._manifest = self._save.publish(self._outcome)
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._save = None  # the staged pieces go with it

    def __repr__(self) -> str:
        state = "in flight" if _SLOT.in_flight and _SLOT.in_flight[0] is self else (
            "failed" if self._failure is not None else "published")
        return f"SaveHandle({self.path!r}, {state}, staged_bytes={self.staged_bytes})"


def settle() -> None:
    """Finishes the save in flight, if any (a collective: every rank calls it at the same point)."""
    if _SLOT.in_flight:
        _SLOT.in_flight.pop()._finish()


def start(save, staged_bytes: int, ready: Callable[[], None]) -> SaveHandle:
    """Writes ``save`` (a ``_save._Save`` over staged pieces) on a thread; the handle."""
    handle = SaveHandle(save, staged_bytes, ready)
    _SLOT.in_flight.append(handle)
    return handle


def stage(pieces: list[Piece]) -> tuple[list[Piece], int, Callable[[], None]]:
    """Host copies of ``pieces``: ``(pieces over the copies, bytes, ready)``; ``ready()`` (on the
    writing thread) waits for copies from a GPU. Pieces that view one tensor (a DBuffer's) are
    copied with it, in one copy of the span of its storage they cover."""
    spans: dict[tuple, list] = {}  # source -> [first element, end, a piece's tensor on it]
    for p in pieces:
        key, lo, hi = _span(p.tensor)
        got = spans.setdefault(key, [lo, hi, p.tensor])
        got[0], got[1] = min(got[0], lo), max(got[1], hi)
    need: dict[tuple, int] = {}  # (dtype, pinned) -> elements
    for lo, hi, t in spans.values():
        pool = (t.dtype, t.device.type != "cpu")
        need[pool] = need.get(pool, 0) + hi - lo
    for pool, n in need.items():
        if pool not in _SLOT.buffers or _SLOT.buffers[pool].numel() < n:
            _SLOT.buffers[pool] = torch.empty(n, dtype=pool[0], pin_memory=pool[1])
    used = dict.fromkeys(need, 0)
    for got in spans.values():
        lo, hi, t = got
        pool = (t.dtype, t.device.type != "cpu")
        dst = _SLOT.buffers[pool][used[pool] : used[pool] + hi - lo]
        used[pool] += hi - lo
        src = t if t.dim() != 1 or t.stride() != (1,) else t.new_empty(0).set_(t.untyped_storage(), lo, (hi - lo,), (1,))
        dst.copy_(src.reshape(-1), non_blocking=pool[1])
        got.append(dst)
    staged = []
    for p in pieces:
        key, lo, hi = _span(p.tensor)
        first, _, _, dst = spans[key]
        staged.append(Piece(p.fqn, p.start, p.numel, dst[lo - first : hi - first]))
    nbytes = sum(n * dtype.itemsize for (dtype, _), n in need.items())
    if any(pinned for _, pinned in need):
        event = torch.cuda.Event()
        event.record()
        return staged, nbytes, event.synchronize
    return staged, nbytes, lambda: None


def _span(t: torch.Tensor) -> tuple[tuple, int, int]:
    """``(source, first, end)``: the elements of its storage a flat tensor covers; a strided one
    is a source of its own."""
    if t.dim() == 1 and t.stride() == (1,):
        return (t.untyped_storage().data_ptr(), t.dtype, t.device), t.storage_offset(), t.storage_offset() + t.numel()
    return (id(t),), 0, t.numel()


def _at_exit() -> None:
    """The interpreter's exit finishes the save in flight (see [Note: a save in the background])."""
    if not _SLOT.in_flight:
        return
    path = _SLOT.in_flight[0].path
    try:
        settle()
    except Exception as exc:  # noqa: BLE001 - nothing to raise to at exit: say it
        print(f"ragged: the background save to {path!r} was not published at exit: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}. Call handle.result() before "
              "destroy_process_group().", file=sys.stderr, flush=True)


atexit.register(_at_exit)
