"""The gloo header protocol: ragged's collectives as point-to-point exchanges that agree first.

[Note: agree before the data moves]
On gloo a message longer than the receive posted for it aborts the receiving process (gloo
checks the length in its I/O thread: not catchable), a shorter one is accepted silently, and
a rank that never arrives leaves its peers waiting for the process group's timeout (30 min by
default). So on gloo every ragged collective is a :class:`Channel` exchange over
``send``/``recv`` with tags (the all-to-all pattern that is also gloo's fastest path):

1. post the data receives whose size this rank knows (into the output: no staging);
2. send every peer a header (see [Note: collective headers] in ``_header.py``);
3. for each peer: wait for its header (ragged's timeout), decode it, post the receive of the
   next call's header, compare; if the two calls agree send the data, if not send as many
   empty messages as the peer posted receives (a shorter message is accepted), so both sides
   complete and the channel stays in step;
4. ``wait()`` waits the data (ragged's timeout) and runs the local part (e.g. the chunk sum).

A receive is only ever posted at the size the sender announced, so a wrong size is never
received. Headers are received into receives posted one call ahead, so a peer's header
is written to the socket the moment it is sent, and a rank's data send goes out as soon as
that peer's header has arrived: the exchange costs about one small message per peer more
than a bare ``batch_isend_irecv`` (measured in ``bench/collectives.py``). If any pair
disagrees, every rank raises :class:`~ragged.PlanMismatchError` naming both sides (its own
call and the first differing peer's); the data was drained, so the comm stays usable.

[Note: poison and abort]
A channel fails when a rank raises while a collective cannot complete: its own validation
failed (``comm.poison(reason)``, called by the transforms' entry points and by the step), a
peer's header did not arrive in time, a connection was lost, or a peer's poison arrived. It
then (a) sends every peer a *poison* header carrying the reason; a peer waiting for this rank's
header (or arriving at its next call: the header receive is posted ahead) raises
:class:`~ragged.CollectiveError` "rank k failed: <reason>"; (b) if the failure happened
inside a collective, after a short grace (so the poison is read first) it *aborts* its gloo
context (a receive waited with a 1 ms timeout: gloo then closes every pair of the group), so a
peer blocked on this rank's data (or on this rank's receive of its data) fails at once
("connection closed") instead of waiting; that peer fails and aborts in turn. So a failure
anywhere reaches every rank within milliseconds, and every rank raises. A failed channel
refuses further calls on that rank. Aborting leaves the group's pairs closed: torch's own
collectives on that group fail too (the job is failing); other groups are untouched.
Validation failures outside a collective only poison: every earlier exchange is complete, so
no peer can be blocked on this rank's data and the group stays usable for torch's own calls.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from ragged._errors import CollectiveError, PlanMismatchError
from ragged.collectives import _header as hd

__all__ = ["Channel", "channel_for", "raised_on_every_rank"]

_HEADER_TAG = 0x52470001
_DATA_TAG = 0x52480000  # + seq % 2**16: a stale message can never land in another call's buffer
_ABORT_TAG = 0x5247FFFF  # never sent: waiting on it with a tiny timeout closes gloo's pairs
_POISON_GRACE = 0.05  # seconds the poison gets to reach peers before an abort closes the pairs


def raised_on_every_rank(exc: BaseException) -> BaseException:
    """Marks an error that every rank of the comm raises at the same call (no poison needed)."""
    exc._ragged_every_rank = True  # type: ignore[attr-defined]
    return exc


def _wait(work, seconds: float) -> None:
    work.wait(datetime.timedelta(seconds=max(seconds, 0.001)))


class _Pending:
    """Data of one exchange in flight; ``wait()`` completes it (see [Note: agree before the data moves])."""

    __slots__ = ("channel", "seq", "call", "works", "finish", "timeout", "_done")

    def __init__(self, channel, seq, call, works, finish, timeout):
        self.channel, self.seq, self.call = channel, seq, call
        self.works, self.finish, self.timeout = works, finish, timeout
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        ch = self.channel
        deadline = time.monotonic() + self.timeout
        for peer, kind, work, _ in self.works:
            try:
                _wait(work, deadline - time.monotonic())
            except RuntimeError as e:
                raise ch.fail_in_call(self.seq, self.call, peer, e, f"its {kind} of the data") from e
        self.works = ()
        self._done = True
        if self.finish is not None:
            self.finish()


class Channel:
    """One process's end of the header protocol on one gloo process group.

    Shared by every comm on that group (see :func:`channel_for`): calls are numbered in issue
    order, and that order must be the same on every rank.
    """

    def __init__(self, group, name: str):
        self.pg = group
        self.rank, self.size = group.rank(), group.size()
        self.name = name
        self.seq = 0
        self.failure: CollectiveError | None = None
        self._headers: dict[int, tuple[bytearray, object]] = {}  # peer -> (buffer, posted recv) for self.seq
        self._sent: list = []  # (work, buffer) of header sends not known complete
        self._graveyard: list = []  # works (and their tensors) of a failed channel: never freed under gloo
        self._lock = threading.RLock()

    # ---- naming ------------------------------------------------------------------------------
    def who(self, j: int | None) -> str:
        if j is None:
            return "a peer"
        g = self._global(j)
        return f"rank {j}" + (f" (global rank {g})" if g != j else "")

    def _global(self, j: int) -> int:
        try:
            return dist.get_global_rank(self.pg, j)
        except (RuntimeError, ValueError):
            return j

    def _peers(self, step: int):
        return [(self.rank + step * k) % self.size for k in range(1, self.size)]

    # ---- headers -----------------------------------------------------------------------------
    def _post_header_recv(self, j: int):
        buf = bytearray(hd.NBYTES)
        self._headers[j] = (buf, self.pg.recv([torch.frombuffer(buf, dtype=torch.uint8)], j, _HEADER_TAG))

    def _send_header(self, j: int, buf: bytearray):
        self._sent.append((self.pg.send([torch.frombuffer(buf, dtype=torch.uint8)], j, _HEADER_TAG), buf))

    def _prune_sent(self):
        if len(self._sent) > 4 * self.size:
            self._sent = [(w, b) for w, b in self._sent if not w.is_completed()]

    def _take_header(self, j: int, seq: int, call, deadline: float) -> hd.Header:
        buf, work = self._headers[j]
        try:
            _wait(work, deadline - time.monotonic())
        except RuntimeError as e:
            raise self.fail_in_call(seq, call, j, e, "its header") from e
        h = hd.decode(buf)
        if h.kind == hd.POISON:
            err = CollectiveError(
                f"{self.who(j)} failed: {h.text} (rank {self.rank} learnt it in collective #{seq}, "
                f"{call.describe()}, of {self.name}).", peer=j)
            self.fail(f"rank {self.rank} stopped: {self.who(j)} failed: {h.text}", abort=True)
            raise err
        self._post_header_recv(j)
        return h

    # ---- the exchange ------------------------------------------------------------------------
    def check_usable(self):
        if self.failure is not None:
            raise CollectiveError(f"this comm no longer runs collectives: {self.failure}", peer=self.failure.peer)

    def exchange(self, call: hd.Call, sends, recvs, *, timeout: float, finish: Callable | None = None,
                 make_recv: Callable | None = None, all_pairs_see_mismatch: bool = True) -> _Pending:
        """Runs steps 1-3 of [Note: agree before the data moves]; returns the pending data.

        Args:
            call: what this rank calls.
            sends: ``sends[j]``, the tensors (contiguous) sent to group rank ``j``, in order.
            recvs: ``recvs[j]``, the tensors received from ``j``; ``None`` for a call whose
                receive sizes come from the peers' headers (``make_recv(j, nbytes)`` then
                returns the uint8 tensor to receive into).
            timeout: seconds to wait for each peer's header, then for the data.
            finish: run by ``wait()`` once every message has arrived.
            all_pairs_see_mismatch: ``False`` where sizes may differ pair by pair (all-to-all), so a
                rank may see a mismatch its peers do not: the channel then fails (poison), so that
                they raise at their next call.

        Raises:
            PlanMismatchError: (on every rank) some ranks' calls differ; nothing was received.
            CollectiveError: a peer failed, died or did not arrive in time (the channel fails).
        """
        with self._lock:
            self.check_usable()
            seq = self.seq
            self.seq += 1
            tag = _DATA_TAG + seq % 65536
            works: list = []
            bad: list = []
            peer = None
            try:
                if not self._headers:
                    for peer in self._peers(1):
                        self._post_header_recv(peer)
                if recvs is not None:
                    for peer in self._peers(-1):
                        for t in recvs[peer]:
                            if t.numel():
                                works.append((peer, "receive", self.pg.recv([t], peer, tag), t))
                mine = {}
                for peer in self._peers(1):
                    buf = hd.encode(call, seq, self.size, sends[peer], None if recvs is None else recvs[peer])
                    mine[peer] = hd.decode(buf)
                    self._send_header(peer, buf)
                deadline = time.monotonic() + timeout
                for peer in self._peers(1):
                    theirs = self._take_header(peer, seq, call, deadline)
                    why = hd.mismatch(mine[peer], theirs)
                    if why is not None:
                        bad.append((peer, theirs, why))
                        for _ in range(max(theirs.expect_count, 0)):
                            empty = torch.empty(0, dtype=torch.uint8)
                            works.append((peer, "send", self.pg.send([empty], peer, tag), empty))
                        continue
                    for t in sends[peer]:
                        if t.numel():
                            works.append((peer, "send", self.pg.send([t], peer, tag), t))
                    if recvs is None and theirs.send_total > 0:
                        t = make_recv(peer, theirs.send_total)
                        works.append((peer, "receive", self.pg.recv([t], peer, tag), t))
                self._prune_sent()
            except CollectiveError:
                self._graveyard.append(works)
                raise
            except RuntimeError as e:  # gloo refused to post: a connection is gone
                self._graveyard.append(works)
                raise self.fail_in_call(seq, call, peer, e, "the exchange") from e
            except BaseException as e:
                self._graveyard.append(works)
                self.fail(f"rank {self.rank} raised inside collective #{seq} ({call.describe()}): "
                          f"{type(e).__name__}: {e}", abort=True)
                raise
            pending = _Pending(self, seq, call, works, None if bad else finish, timeout)
            if bad:
                pending.wait()  # the drained exchange completes: the channel stays in step
                err = PlanMismatchError(self._explain(seq, call, mine, bad))
                if not all_pairs_see_mismatch:
                    self.fail(f"rank {self.rank}: {err}", abort=False)
                    raise err
                raise raised_on_every_rank(err)
            return pending

    def _explain(self, seq, call, mine, bad) -> str:
        j, theirs, why = bad[0]
        others = [k for k, _, _ in bad[1:]]
        return (
            f"collective #{seq} of {self.name} differs between ranks ({why}): rank {self.rank} called "
            f"{hd.describe(mine[j])}, {self.who(j)} called {hd.describe(theirs)}"
            + (f"; ranks {others} also differ from rank {self.rank}" if others else "")
            + ". Every rank must issue the same ragged collectives in the same order, with the same plans, "
            "dtypes and options (a rank that skipped or added a call, or built another plan)."
        )

    # ---- failure -----------------------------------------------------------------------------
    def fail_in_call(self, seq, call, peer, exc: BaseException, waited_for: str) -> CollectiveError:
        """The channel fails while waiting for ``peer``: returns the error to raise."""
        if self.failure is not None:
            return CollectiveError(f"this comm no longer runs collectives: {self.failure}", peer=self.failure.peer)
        text = str(exc)
        what = f"collective #{seq} ({call.describe()}) of {self.name}"
        if "Timed out" in text:
            msg = (f"rank {self.rank} timed out waiting for {waited_for} from {self.who(peer)} in {what}: that rank "
                   "is slow, stuck, stopped early, or called other collectives. Every rank must issue the same "
                   "ragged collectives; the timeout is from_torch(timeout=...).")
        else:
            said = self._reason_of(peer)
            msg = (f"rank {self.rank} lost {self.who(peer)} while waiting for {waited_for} in {what}: "
                   + (f"that rank failed: {said}" if said else
                      f"{text.splitlines()[0][:160]}. That rank probably died or exited (see its log)."))
        self.fail(msg, abort=True, peer=peer)
        return CollectiveError(msg, peer=peer)

    def fail(self, reason: str, *, abort: bool, peer: int | None = None) -> None:
        """Fails the channel: poison every peer, then (``abort``) close the group's pairs.

        See [Note: poison and abort]. Idempotent: only the first failure is sent.
        """
        with self._lock:
            if self.failure is not None:
                return
            self.failure = CollectiveError(reason, peer=peer)
            sends = []
            for j in self._peers(1):
                buf = hd.encode_poison(self.seq, self.size, reason)
                try:
                    sends.append((self.pg.send([torch.frombuffer(buf, dtype=torch.uint8)], j, _HEADER_TAG), buf))
                except RuntimeError:
                    pass
            self._graveyard.append((sends, self._sent, self._headers))
            self._tell_store(reason)
            if not abort:
                return
            deadline = time.monotonic() + _POISON_GRACE
            try:
                for w, _ in sends:
                    _wait(w, deadline - time.monotonic())
                time.sleep(max(0.0, deadline - time.monotonic()))
            except RuntimeError:
                return  # a wait expired: gloo has closed the pairs already
            if self.size > 1:
                probe = torch.empty(1, dtype=torch.uint8)
                try:
                    _wait(self.pg.recv([probe], self._peers(1)[0], _ABORT_TAG), 0.001)
                except RuntimeError:
                    pass
                self._graveyard.append(probe)

    # The reason also goes to the c10d store (best effort), for peers that only see a closed
    # connection (the poison may be lost when the pairs close right after it).
    def _store_key(self, rank: int | None) -> str:
        return f"ragged/failure/{self.name}/{self._global(rank)}"

    def _tell_store(self, reason: str) -> None:
        try:
            dist.distributed_c10d._get_default_store().set(self._store_key(self.rank), reason)
        except Exception:  # noqa: BLE001 - best effort: the store may be gone with its host
            pass

    def _reason_of(self, peer: int | None, wait: float = 0.1) -> str | None:
        if peer is None:
            return None
        end = time.monotonic() + wait
        try:
            store = dist.distributed_c10d._get_default_store()
            key = self._store_key(peer)
            while True:  # check() polls without blocking (a blocking wait logs a warning when it expires)
                if store.check([key]):
                    return store.get(key).decode("utf-8", "replace")
                if time.monotonic() > end:
                    return None
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - no reason recorded (e.g. the process was killed)
            return None


_CHANNELS: dict[int, tuple[object, Channel]] = {}
_CHANNELS_LOCK = threading.Lock()


def channel_for(group) -> Channel:
    """The channel of ``group`` (a ``ProcessGroup``), created on first use and shared."""
    with _CHANNELS_LOCK:
        hit = _CHANNELS.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        try:
            name = f"process group {group.group_name!r}"
        except (AttributeError, RuntimeError):
            name = "the process group"
        ch = Channel(group, f"{name} ({group.size()} ranks)")
        _CHANNELS[id(group)] = (group, ch)
        return ch
