"""Deferred agreement: checking native (NCCL) collectives without a sync on the hot path.

[Note: deferred agreement]
NCCL runs collectives on the device in issue order; it has no tagged messages to carry a
header, and agreeing on sizes first would make the host wait for the peers at every call. So
under ``handshake="deferred"`` each call is recorded on the host, in one :class:`Ledger` per comm
that covers its shard group and, for HSDP, its replica group: the call's group, operation,
reduction, dtype, elements and identity go into a running 63-bit hash of the calls *in the
order this rank issued them, across both groups*, and the last ``history`` records keep their
labels. Two groups' calls must interleave the same way on every rank: NCCL runs each group's
kernels in issue order on the device, so ranks that issue a shard-group and a replica-group
call in different orders wait on each other for ever (see [Note: NCCL's rules on gloo] in
``_gloo_device.py``). The record is verified:

* at agreement points, with a host sync: ``check_plans``' round folds the hash into its
  all-reduce over the whole mesh (``rg.fsdp``'s step makes one per step; first uses of a plan
  and ``plan_check="every_call"`` too), and ``comm.verify()`` runs one itself (all-reduces of
  two int64 over each group). On a difference every rank all-gathers its records since the last
  agreement and raises :class:`~ragged.PlanMismatchError` naming the first call that differs,
  its group and both sides;
* every ``verify_every`` calls of a group, without a sync: an all-reduce of ``(h, -h)`` over that
  group is issued with the calls, at that point of the sequence on every rank (on the device,
  its result copied to pinned host memory behind an event); later calls look at the oldest
  check in flight (``query()``: no sync) and compare once it has completed. Whether a check has
  completed decides only when its result is read, never whether a collective is issued: the
  device's progress differs between ranks. A difference raises on the rank that sees it
  (naming its own calls) and poisons the comm.

Poison (``comm.poison(reason)``, or a failure seen by the periodic check) writes the reason
to the c10d store under a key of each group; a daemon thread per ledger polls the keys
(``POLL_SECONDS``) and, when a peer set one, fails this ledger and aborts the process groups,
so a collective hung on a mismatch raises instead of waiting for NCCL's watchdog. On gloo the
host waits a collective of this transport under the ledger's watch and ends the wait at once
when the ledger fails, or at the comm's ``timeout`` (``GlooDevice.host_wait``), which is what
NCCL's abort and watchdog do to a device wait.

Guaranteed on NCCL: a mismatch of operation, dtype, size, identity or order across groups is
raised at the latest at the next agreement point (once per ``rg.fsdp`` step), on every rank,
naming both sides; a rank that poisons makes its peers fail within about ``POLL_SECONDS``. Not
guaranteed: the collectives issued between the mismatch and its detection may have hung (until
the abort or NCCL's watchdog) or computed wrong numbers; a step that raises returns no new state,
but with ``donate=True`` the old state's buffers may already be overwritten. (On gloo the
``"header"`` handshake checks every call before its data moves, see ``_channel.py``.)
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
from ragged.collectives._gloo_device import GlooDevice
from ragged.collectives._handles import _Work
from ragged.collectives._rendezvous import incarnation, release

__all__ = ["Ledger", "POLL_SECONDS", "GROUPS"]

POLL_SECONDS = 1.0
GROUPS = ("shard", "replica")  # a record's group, by index
_CHECKS_IN_FLIGHT = 2  # periodic checks issued and not yet read; one more makes the host wait for the oldest


def _mix(digest: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{digest}|{key}".encode(), digest_size=8).digest(), "little") >> 1


def _store():
    return dist.distributed_c10d._get_default_store()


def _name(group) -> str:
    try:
        return group.group_name
    except (AttributeError, RuntimeError):
        return "default"


class Ledger:
    """The record of one comm's calls, on its shard group and its replica group (``None``
    without replicas), since they were last agreed (see [Note: deferred agreement]).

    On gloo the works of the comm are :class:`~ragged.collectives._gloo_device.DeviceWork`
    (:meth:`issued`): NCCL's rules, kept (see [Note: NCCL's rules on gloo])."""

    def __init__(self, shard_group, replica_group, device, *, every: int, timeout: float, history: int = 1024,
                 watch: bool = True):
        self.groups = (shard_group, replica_group)
        self.device = device
        self.every = every
        self.timeout = timeout
        self.rank, self.size = shard_group.rank(), shard_group.size()
        self.seq = 0
        self.since = 0
        self.digest = 0
        self.calls = [0, 0]  # per group: calls recorded (a periodic check every ``every`` of them)
        self.log: collections.deque = collections.deque(maxlen=history)  # (seq, group index, key, text)
        self.failure: CollectiveError | None = None
        self._checks: collections.deque = collections.deque()  # periodic checks in flight, oldest first
        # named per attempt: see [Note: restarts and the rendezvous store]
        self.keys = tuple(f"ragged/{incarnation(g)}/poisoned/{_name(g)}" for g in self.groups if g is not None)
        self._watch = watch and any(g is not None and g.size() > 1 for g in self.groups)
        self._watcher = None
        gloo = "gloo" in str(dist.get_backend(shard_group)).lower()
        self._gloo = GlooDevice(dist.get_rank(), self) if gloo else None

    def issued(self, work):
        """A work of this comm as its waits and queries must see it: NCCL's own, or on gloo a
        :class:`~ragged.collectives._gloo_device.DeviceWork`."""
        return work if self._gloo is None else self._gloo.work(work)

    # ---- recording ---------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.failure is not None:
            raise CollectiveError(f"this comm no longer runs collectives: {self.failure}", peer=self.failure.peer)

    def record(self, index, op, reduce, dtype, numel, identity, text) -> None:
        """Group ``index``'s next call (see :data:`GROUPS`), recorded before it is issued."""
        self.check_alive()
        self._poll(block=False)
        key = f"{GROUPS[index]}|{op}|{reduce}|{dtype}|{numel}|{identity}"
        self.digest = _mix(self.digest, key)
        self.log.append((self.seq, index, key, text))
        self.seq += 1
        self.calls[index] += 1
        if self._watch and self._watcher is None:
            self._start_watcher()
        if self.every and self.calls[index] % self.every == 0:
            self._launch(index)

    # ---- the periodic check (no sync) ---------------------------------------------------------
    def _launch(self, index: int) -> None:
        """Issues the check of group ``index``: the same point of the sequence on every rank,
        whatever the earlier checks' progress (see [Note: deferred agreement])."""
        d, group = self.digest, self.groups[index]
        if self.device.type == "cuda":
            src = torch.tensor([d, -d], dtype=torch.int64).pin_memory()
            t = src.to(self.device, non_blocking=True)
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
            work.wait()  # orders the current stream after the all-reduce (no host wait)
            host = torch.empty(2, dtype=torch.int64).pin_memory()
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._checks.append((event.query, host, (src, t), self.seq, index))
        else:
            t = torch.tensor([d, -d], dtype=torch.int64)
            work = _Work([self.issued(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True))])
            self._checks.append((work.is_completed, t, work, self.seq, index))
        if len(self._checks) > _CHECKS_IN_FLIGHT:
            self._poll(block=True)

    def _poll(self, block: bool) -> None:
        """Reads the periodic checks that have completed, oldest first; ``block``: the oldest
        one at least, waiting for it."""
        while self._checks:
            ready, values, _, upto, index = self._checks[0]
            if not ready():
                if not block:
                    return
                while not ready():
                    time.sleep(0.0005)
            block = False
            self._checks.popleft()
            top, neg = values.tolist()
            if top != -neg:
                mine = [text or key for s, _, key, text in self.log if s < upto][-3:]
                name = _name(self.groups[index])
                msg = (f"rank {self.rank}: the collectives issued before call #{upto} differ between ranks of {name!r} "
                       f"(found by the periodic check of handshake='deferred'); this rank's last calls were {mine}. "
                       "Every rank must issue the same collectives in the same order; comm.verify() at the same "
                       "point on every rank names both sides.")
                self.poison(msg)
                raise PlanMismatchError(msg)

    # ---- agreement points (a host sync) --------------------------------------------------------
    def confirm(self) -> None:
        """The current digest was just agreed by an outside round (``check_plans``)."""
        self.since, self.digest = self.seq, 0
        for group in self.groups:  # every peer took part in that round: all are connected
            if group is not None:
                release(group)

    def verify(self) -> None:
        """All-reduces the digest over each group; on a difference, explains and raises on every rank."""
        self.check_alive()
        self._poll(block=False)
        t = torch.tensor([self.digest, -self.digest], dtype=torch.int64, device=self.device)
        for group in self.groups:
            if group is not None:
                _Work([self.issued(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True))], None,
                      self).wait()
        top, neg = t.tolist()
        if top == -neg:
            self.confirm()
            return
        self.explain()

    def explain(self) -> None:
        """Every rank of the mesh: all-gather the records since the last agreement; raise
        naming the first call that differs on both sides."""
        mine = [(s, i, key, text) for s, i, key, text in self.log if s >= self.since]
        shard, replica = self.groups
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, (self.since, mine), group=shard)
        if replica is not None:
            rows: list = [None] * replica.size()
            dist.all_gather_object(rows, everyone, group=replica)
            everyone = [x for row in rows for x in row]
        me = self.rank + (0 if replica is None else replica.rank() * self.size)
        msg = _first_difference(everyone, me, len(self.log) == self.log.maxlen)
        self.confirm()
        raise raised_on_every_rank(PlanMismatchError(msg))

    # ---- poison --------------------------------------------------------------------------------
    def poison(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = CollectiveError(reason)
        for key in self.keys:
            try:
                _store().set(key, reason)
            except Exception:  # noqa: BLE001 - best effort: the store may be gone with its host
                pass

    def read_poison(self) -> CollectiveError | None:
        """This ledger's failure, after looking in the store for a peer's poison now (the watcher
        looks every ``POLL_SECONDS``; a collective that a peer's abort broke looks at once)."""
        if self.failure is None:
            try:
                store = _store()
                for key in self.keys:
                    if store.check([key]):
                        reason = store.get(key).decode("utf-8", "replace")
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

        self._watcher = threading.Thread(target=watch, name=f"ragged-watch-{self.keys[0]}", daemon=True)
        self._watcher.start()

    def _abort(self) -> None:
        """Makes this process's collectives on the groups raise: ``ProcessGroup.abort()`` on NCCL.
        gloo's abort leaves an op in flight blocked (measured, torch 2.13), and the host's wait does
        not need it (it watches the ledger); a receive waited with a 1 ms timeout makes gloo close
        the group's pairs, which ends the op on gloo's thread too."""
        for group in self.groups:
            if group is None or group.size() == 1:
                continue
            try:
                if self.device.type == "cuda":
                    dist.distributed_c10d._abort_process_group(group)
                else:
                    probe = torch.empty(1, dtype=torch.uint8)
                    r = group.rank()
                    group.recv([probe], (r + 1) % group.size(), 0x5247FFFF).wait(datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - gloo raises the timeout it was asked for
                pass


def _first_difference(everyone, me: int, truncated: bool) -> str:
    """``everyone[r] = (since, [(seq, group index, key, text), ...])``: the first call where ranks differ."""
    logs = [dict((s, (i, k, t)) for s, i, k, t in recs) for _, recs in everyone]
    seqs = sorted(set().union(*[set(l) for l in logs]))
    for s in seqs:
        calls = [l.get(s) for l in logs]
        keys = [c[1] if c else None for c in calls]
        if len(set(keys)) > 1:
            other = next(r for r, k in enumerate(keys) if k != keys[me])
            fmt = lambda c: "no call" if c is None else f"{c[2] or c[1]} on the {GROUPS[c[0]]} group"  # noqa: E731
            return (f"collective #{s} differs between ranks: rank {me} called {fmt(calls[me])}, rank {other} called "
                    f"{fmt(calls[other])} (checked late: handshake='deferred'). Every rank must issue the same "
                    "collectives in the same order, on every group, with the same plans, dtypes and options.")
    counts = [len(l) for l in logs]
    return ("the collectives since the last agreement differ between ranks, but not within the "
            f"{'last ' if truncated else ''}records kept (calls per rank: {counts}); every rank must issue the same "
            "collectives in the same order.")
