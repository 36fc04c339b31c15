"""Deferred agreement: checking native (NCCL) collectives without a sync on the hot path.

[Note: deferred agreement]
NCCL runs collectives on the device in issue order; it has no tagged messages to carry a
header, and agreeing on sizes first would make the host wait for the peers at every call. So
under ``handshake="deferred"`` each call is recorded on the host (operation, reduction, dtype,
elements, identity: a running 63-bit hash, plus the last ``history`` records with their
labels) and verified later:

* at agreement points, with a host sync: ``check_plans``' round folds the hash into its
  all-reduce (``rg.fsdp``'s step makes one per step; first uses of a plan and
  ``plan_check="every_call"`` too), and ``comm.verify()`` runs one itself (one all-reduce of
  two int64). On a difference every rank all-gathers its records since the last agreement and
  raises :class:`~ragged.PlanMismatchError` naming the first call that differs, both sides;
* every ``verify_every`` calls, without a sync: an all-reduce of ``(h, -h)`` is issued with
  the calls (on the device, its result copied to pinned host memory behind an event); a later
  call looks at the event (``query()``: no sync) and compares once it has completed. A
  difference raises on the rank that sees it (naming its own calls) and poisons the comm.

Poison (``comm.poison(reason)``, or a failure seen by the periodic check) writes the reason
to the c10d store under a key of the group; a daemon thread per ledger polls that key
(``POLL_SECONDS``) and, when a peer set it, fails this ledger and aborts the process group, so
a collective hung on a mismatch raises instead of waiting for NCCL's watchdog. On the CPU (gloo in
NCCL's shape) the host's wait of a native work does not rely on that abort: it looks at the
ledger between slices and ends at the comm's ``timeout`` (``_wait_watched`` in ``_handles.py``),
which is what NCCL's abort and watchdog do to a device work.

Guaranteed on NCCL: a mismatch of operation, dtype, size or identity is raised at the latest
at the next agreement point (once per ``rg.fsdp`` step), on every rank, naming both sides; a
rank that poisons makes its peers fail within about ``POLL_SECONDS``. Not guaranteed: the
collectives issued between the mismatch and its detection may have hung (until the abort or
NCCL's watchdog) or computed wrong numbers; a step that raises returns no new state, but with
``donate=True`` the old state's buffers may already be overwritten. (On gloo the ``"header"``
handshake checks every call before its data moves, see ``_channel.py``.)
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import threading
import time
import weakref

import torch
import torch.distributed as dist

from ragged._errors import CollectiveError, PlanMismatchError
from ragged.collectives._channel import raised_on_every_rank
from ragged.collectives._handles import _Work

__all__ = ["Ledger", "POLL_SECONDS"]

POLL_SECONDS = 1.0


def _mix(digest: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{digest}|{key}".encode(), digest_size=8).digest(), "little") >> 1


def _store():
    return dist.distributed_c10d._get_default_store()


class Ledger:
    """The record of one process group's calls since they were last agreed (see [Note: deferred agreement])."""

    def __init__(self, group, device, *, every: int, timeout: float, history: int = 1024, watch: bool = True):
        self.group = group
        self.device = device
        self.every = every
        self.timeout = timeout
        self.rank, self.size = group.rank(), group.size()
        self.seq = 0
        self.since = 0
        self.digest = 0
        self.log: collections.deque = collections.deque(maxlen=history)
        self.failure: CollectiveError | None = None
        self._inflight = None
        try:
            name = group.group_name
        except (AttributeError, RuntimeError):
            name = "default"
        self.key = f"ragged/poisoned/{name}"
        self._watch = watch and self.size > 1
        self._watcher = None

    # ---- recording ---------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.failure is not None:
            raise CollectiveError(f"this comm no longer runs collectives: {self.failure}", peer=self.failure.peer)

    def record(self, op, reduce, dtype, numel, identity, text) -> None:
        self.check_alive()
        if self._inflight is not None:
            self._poll(block=False)
        key = f"{op}|{reduce}|{dtype}|{numel}|{identity}"
        self.digest = _mix(self.digest, key)
        self.log.append((self.seq, key, text))
        self.seq += 1
        if self.size > 1:
            if self._watch and self._watcher is None:
                self._start_watcher()
            if self.every and self.seq % self.every == 0 and self._inflight is None:
                self._launch()

    # ---- the periodic check (no sync) ---------------------------------------------------------
    def _launch(self) -> None:
        d = self.digest
        if self.device.type == "cuda":
            src = torch.tensor([d, -d], dtype=torch.int64).pin_memory()
            t = src.to(self.device, non_blocking=True)
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            work.wait()  # orders the current stream after the all-reduce (no host wait)
            host = torch.empty(2, dtype=torch.int64).pin_memory()
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._inflight = (lambda: event.query(), host, (src, t), self.seq)
        else:
            t = torch.tensor([d, -d], dtype=torch.int64)
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            future = work.get_future()  # not work.is_completed: see [Note: asking a torch work whether it is done]
            self._inflight = (future.done, t, work, self.seq)

    def _poll(self, block: bool) -> None:
        ready, values, keep, upto = self._inflight
        if not ready():
            if not block:
                return
            while not ready():
                time.sleep(0.0005)
        self._inflight = None
        top, neg = values.tolist()
        if top != -neg:
            mine = [text or key for s, key, text in self.log if s < upto][-3:]
            msg = (f"rank {self.rank}: the collectives issued before call #{upto} differ between ranks of "
                   f"{self.key.rsplit('/', 1)[-1]!r} (found by the periodic check of handshake='deferred'); this "
                   f"rank's last calls were {mine}. Every rank must issue the same collectives in the same order; "
                   "comm.verify() at the same point on every rank names both sides.")
            self.poison(msg)
            raise PlanMismatchError(msg)

    # ---- agreement points (a host sync) --------------------------------------------------------
    def confirm(self) -> None:
        """The current digest was just agreed by an outside round (``check_plans``)."""
        self.since, self.digest = self.seq, 0

    def verify(self) -> None:
        """One all-reduce of the digest; on a difference, explains and raises on every rank."""
        self.check_alive()
        if self.size == 1:
            self.confirm()
            return
        if self._inflight is not None:
            self._poll(block=True)
        t = torch.tensor([self.digest, -self.digest], dtype=torch.int64, device=self.device)
        _Work([dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)], None, (self,)).wait()
        top, neg = t.tolist()
        if top == -neg:
            self.confirm()
            return
        self.explain()

    def explain(self) -> None:
        """Every rank: all-gather the records since the last agreement; raise naming the first
        call that differs on both sides."""
        mine = [(s, key, text) for s, key, text in self.log if s >= self.since]
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, (self.since, mine), group=self.group)
        msg = _first_difference(everyone, self.rank, len(self.log) == self.log.maxlen)
        self.confirm()
        raise raised_on_every_rank(PlanMismatchError(msg))

    # ---- poison --------------------------------------------------------------------------------
    def poison(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = CollectiveError(reason)
        try:
            _store().set(self.key, reason)
        except Exception:  # noqa: BLE001 - best effort: the store may be gone with its host
            pass

    def read_poison(self) -> CollectiveError | None:
        """This ledger's failure, after looking in the store for a peer's poison now (the watcher
        looks every ``POLL_SECONDS``; a collective that a peer's abort broke looks at once)."""
        if self.failure is None:
            try:
                store = _store()
                if store.check([self.key]):
                    reason = store.get(self.key).decode("utf-8", "replace")
                    if self.failure is None:
                        self.failure = CollectiveError(f"a peer failed: {reason}")
            except Exception:  # noqa: BLE001 - the store's host is gone: the group is failing anyway
                pass
        return self.failure

    def _start_watcher(self) -> None:
        me = weakref.ref(self)

        def watch():
            while True:
                time.sleep(POLL_SECONDS)
                led = me()
                if led is None or led.failure is not None:
                    return
                if led.read_poison() is not None:
                    led._abort()
                    return
                del led

        self._watcher = threading.Thread(target=watch, name=f"ragged-watch-{self.key}", daemon=True)
        self._watcher.start()

    def _abort(self) -> None:
        """Makes this process's collectives on the group raise: NCCL's abort; on gloo a receive waited
        with a 1 ms timeout, after which gloo closes the group's pairs."""
        try:
            if self.device.type == "cuda":
                dist.distributed_c10d._abort_process_group(self.group)
            else:
                probe = torch.empty(1, dtype=torch.uint8)
                self.group.recv([probe], (self.rank + 1) % self.size, 0x5247FFFF).wait(datetime.timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - gloo raises the timeout it was asked for
            pass


def _first_difference(everyone, me: int, truncated: bool) -> str:
    """``everyone[r] = (since, [(seq, key, text), ...])``: the first call where ranks differ."""
    logs = [dict((s, (k, t)) for s, k, t in recs) for _, recs in everyone]
    seqs = sorted(set().union(*[set(l) for l in logs]))
    for s in seqs:
        calls = [l.get(s) for l in logs]
        keys = [c[0] if c else None for c in calls]
        if len(set(keys)) > 1:
            other = next(r for r, k in enumerate(keys) if k != keys[me])
            fmt = lambda c: "no call" if c is None else (c[1] or c[0])  # noqa: E731
            return (f"collective #{s} differs between ranks: rank {me} called {fmt(calls[me])}, rank {other} called "
                    f"{fmt(calls[other])} (checked late: handshake='deferred'). Every rank must issue the same "
                    "collectives in the same order, with the same plans, dtypes and options.")
    counts = [len(l) for l in logs]
    return ("the collectives since the last agreement differ between ranks, but not within the "
            f"{'last ' if truncated else ''}records kept (calls per rank: {counts}); every rank must issue the same "
            "collectives in the same order.")
