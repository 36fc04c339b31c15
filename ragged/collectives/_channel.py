"""The gloo header protocol: ragged's collectives as tagged point-to-point exchanges that
cannot receive a wrong size and check every call before its result is used.

[Note: size-tagged messages and headers]
On gloo a message longer than the receive posted for it aborts the receiving process (gloo
checks the length in its I/O thread: not catchable), a shorter one is accepted silently, and
a rank that never arrives leaves its peers waiting for the process group's timeout (30 min by
default). So on gloo every ragged collective is a :class:`Channel` exchange over gloo's
tagged ``send``/``recv`` (the all-to-all pattern that is also gloo's fastest path), in which

* every data message travels on the tag ``_DATA_TAG | nbytes``: a message can only ever
  match a receive of exactly its own size (gloo matches by tag), so no length check can fail,
  whatever the peer calls. Messages are at most ``_MAX_PART`` bytes (larger tensors go in
  parts); the own chunk is a local copy;
* every call sends each peer a fixed-size header (see [Note: collective headers] in
  ``_header.py``) on ``_HEADER_TAG``, right after its data to that peer (so a receiver that
  has its header has the data too: one wake-up, not two), received into one of ``_AHEAD``
  receives kept posted per peer, so it is written the moment it is sent. Data of at most
  ``INLINE_BYTES`` per peer rides inside the header. Receives are re-posted once a call's data
  has arrived: posting needs the pair's lock, which gloo's I/O thread holds while it moves a
  large message.

At the call, a rank posts, per peer as ``batch_isend_irecv`` does, its data send, its header
and its data receive (into the output: no staging), and returns: no waiting, so the exchange
costs what a bare ``batch_isend_irecv`` costs plus one 4 KiB message per peer (measured in
``bench/collectives.py``).
``wait()`` first takes every peer's header (ragged's timeout) and compares it with its own
(the peer's sends against its receives and the other way round, operation, dtype, identity);
only if all agree does it wait for the data and run the local part (e.g. the chunk sum).

If some ranks' calls differ, every rank raises :class:`~ragged.PlanMismatchError` naming both
sides (its own call and the first differing peer's) before the result is used. If only the
identity differs (same sizes), every message was matched and the comm stays usable; if sizes
differ, the unmatched messages stay posted, so the comm fails (refuses further calls).
Objects (``all_gather_object``), whose sizes the receiver cannot know, take the headers in the
call and then post receives of the announced sizes.

[Note: poison]
A rank whose call cannot go on sends every peer a *poison* header carrying the reason, in the
header slot of its next call: its own validation failed (``comm.poison(reason)``, called by the
transforms' entry points and by the step), a peer's header did not arrive in time, a
connection was lost, or a peer's poison arrived. A peer waiting for this rank's header, or
arriving at that call later, raises :class:`~ragged.CollectiveError` "rank k failed: <reason>"
and fails in turn (so a rank that learnt of a death tells the others). No rank can be blocked
on anything but a header: every data send is posted with (before) its header, and a rank
waits for its data only after every peer's header agreed, i.e. after that peer posted the
matching receives. So a failure anywhere reaches every rank within milliseconds. The reason
also goes to the c10d store (best effort), for peers that only see a closed connection. A
failed channel refuses further calls on that rank. A header that does not arrive within the
timeout makes gloo close the group's pairs (its behaviour on a timed-out wait), which the
peers see at once as a lost connection.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from ragged._errors import CollectiveError, PlanMismatchError
from ragged.collectives import _header as hd
from ragged.collectives._handles import _Pending, _wait, lost_connection
from ragged.collectives._rendezvous import incarnation, release

__all__ = ["Channel", "channel_for", "raised_on_every_rank"]

_HEADER_TAG = 0x20000001
_DATA_TAG = 0x40000000  # | nbytes
_MAX_PART = (1 << 30) - 1  # bytes per data message (the size fits the tag's low 30 bits)
_AHEAD = 2  # header receives posted per peer: the next call's header never waits for one


def raised_on_every_rank(exc: BaseException) -> BaseException:
    """Marks an error that every rank of the comm raises at the same call (no poison needed)."""
    exc._ragged_every_rank = True  # type: ignore[attr-defined]
    return exc


def _parts(tensors) -> list[torch.Tensor]:
    """The non-empty messages of ``tensors`` (flat, contiguous), each at most ``_MAX_PART`` bytes."""
    out = []
    for t in tensors:
        n = t.numel()
        if not n:
            continue
        step = max(_MAX_PART // t.element_size(), 1)
        if n <= step:
            out.append(t)
        else:
            out += [t[i : i + step] for i in range(0, n, step)]
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sizes(parts) -> tuple[int, ...]:
    return tuple(_nbytes(t) for t in parts)


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
        self._posted: dict[int, list] = {}  # peer -> [(buffer, recv)] of its next headers, in order
        self._received: dict[int, dict[int, hd.Header]] = {}  # peer -> {seq: header} taken, not yet used
        self._next: dict[int, int] = {}  # peer -> seq of the header its posted receive will get
        self._sent: list = []  # (work, message) of the latest header sends, oldest first
        self._inflight: dict[int, list] = {}  # seq -> tensors gloo may still read or write
        self._pairwise: set[int] = set()  # seqs of calls whose sizes differ pair by pair (all-to-all)
        self._graveyard: list = []  # what a failed call left posted: never freed under gloo
        self._lock = threading.RLock()
        self._incarnation = incarnation(group)  # see [Note: restarts and the rendezvous store]

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

    def peers(self, step: int):
        return [(self.rank + step * k) % self.size for k in range(1, self.size)]

    # ---- headers -----------------------------------------------------------------------------
    def _post_header_recv(self, j: int):
        buf = bytearray(hd.NBYTES)
        self._posted[j].append((buf, self.pg.recv([torch.frombuffer(buf, dtype=torch.uint8)], j, _HEADER_TAG)))

    def repost(self) -> None:
        """Keeps ``_AHEAD`` header receives posted per peer. Called once a call's data has
        arrived: posting needs the pair's lock, which gloo's I/O thread holds while it moves a
        large message on that pair."""
        with self._lock:
            if self.failure is None:
                for j, posted in self._posted.items():
                    while len(posted) < _AHEAD:
                        try:
                            self._post_header_recv(j)
                        except RuntimeError as e:
                            if not lost_connection(e):
                                raise
                            # that peer is gone (e.g. it exited after the call that just completed):
                            # that call stands, the next one raises
                            said = self._reason_of(j)
                            self.fail(f"rank {self.rank} lost {self.who(j)} after collective #{self.seq - 1} of "
                                      f"{self.name}: " + (f"that rank failed: {said}" if said else
                                      f"{str(e).splitlines()[0][:160]}. That rank probably died or exited (see its log)."),
                                      peer=j)
                            return

    def _send(self, j: int, message: torch.Tensor, timeout: float):
        self._sent.append((self.pg.send([message], j, _HEADER_TAG), message))
        # gloo marks a send complete only once it is waited: wait the old ones (written long
        # ago: every peer keeps receives posted), so that the list stays short
        while len(self._sent) > 2 * _AHEAD * self.size:
            work, _ = self._sent.pop(0)
            _wait(work, timeout)

    def take_headers(self, seq: int, call, timeout: float) -> dict[int, hd.Header]:
        """Every peer's header of call ``seq`` (headers arrive in order; earlier ones are kept)."""
        with self._lock:
            self.check_usable()
            deadline = time.monotonic() + timeout
            out = {}
            for j in self.peers(-1):
                got = self._received.setdefault(j, {})
                while seq not in got:
                    if not self._posted[j]:
                        self._post_header_recv(j)
                    buf, work = self._posted[j][0]
                    try:
                        _wait(work, deadline - time.monotonic())
                    except RuntimeError as e:
                        raise self.fail_in_call(seq, call, j, e, "its header") from e
                    self._posted[j].pop(0)
                    h = hd.decode(buf)
                    if h.kind == hd.POISON:
                        msg = (f"{self.who(j)} failed: {h.text} (rank {self.rank} learnt it in collective #{seq}, "
                               f"{call.describe()}, of {self.name}).")
                        self.fail(f"{self.who(j)} failed: {h.text}", peer=j)
                        raise CollectiveError(msg, peer=j)
                    got[self._next[j]] = h
                    self._next[j] += 1
                out[j] = got.pop(seq)
            release(self.pg)  # every peer has sent a header: all are connected
            return out

    # ---- the exchange ------------------------------------------------------------------------
    def check_usable(self):
        if self.failure is not None:
            raise CollectiveError(f"this comm no longer runs collectives: {self.failure}", peer=self.failure.peer)

    def exchange(self, call: hd.Call, sends, recvs, *, timeout: float, finish: Callable | None = None,
                 make_recv: Callable | None = None, all_pairs_see_mismatch: bool = True) -> _Pending:
        """Posts one call (see [Note: size-tagged messages and headers]); returns its pending part.

        Args:
            call: what this rank calls.
            sends: ``sends[j]``, the tensors (contiguous) sent to group rank ``j``, in order.
            recvs: ``recvs[j]``, the tensors received from ``j``; ``None`` for a call whose
                receive sizes come from the peers' headers (``make_recv(j, nbytes)`` then
                returns the uint8 tensor to receive into; the call then completes here).
            timeout: seconds to wait for each peer's header, then for the data.
            finish: run by ``wait()`` once every message has arrived.
            all_pairs_see_mismatch: ``False`` where sizes may differ pair by pair (all-to-all),
                so a rank may see a mismatch its peers do not: the channel then fails (poison),
                so that they raise at their next call.

        Raises (here or from ``wait()``):
            PlanMismatchError: (on every rank) some ranks' calls differ.
            CollectiveError: a peer failed, died or did not arrive in time (the channel fails).
        """
        with self._lock:
            self.check_usable()
            seq = self.seq
            self.seq += 1
            if self.size == 1:
                return _Pending(self, seq, call, {}, {}, {}, finish, timeout)
            if not self._posted:
                for j in self.peers(1):
                    self._posted[j] = []
                    self._next[j] = 0
            self.repost()
            self.check_usable()  # a peer lost while re-posting
            out_parts = {j: _parts(sends[j]) for j in self.peers(1)}
            in_parts = None if recvs is None else {j: _parts(recvs[j]) for j in self.peers(1)}
            recv_works: dict[int, list] = {}
            send_works: dict[int, list] = {}
            mine = {}
            peer = None
            try:
                last = None
                for peer in self.peers(1):  # per peer, as batch_isend_irecv: a send, (its header), a receive
                    outs = out_parts[peer]
                    ins = None if in_parts is None else in_parts[peer]
                    small = hd.inline(sum(_sizes(outs)))
                    key = (_sizes(outs), None if ins is None else _sizes(ins), tuple(id(t) for t in outs) if small else None)
                    if key != last:  # the same header for every peer of a uniform call: encode it once
                        buf, fields = hd.encode(call, seq, self.size, outs, ins, with_payload=small)
                        header, last = hd.decode(fields, with_payload=False), key
                    mine[peer] = header
                    if not small:
                        send_works[peer] = [self.pg.send([t], peer, _DATA_TAG | _nbytes(t)) for t in outs]
                    self._send(peer, buf, timeout)  # after its data: when the header is in, so is the data
                    if ins is not None and not hd.inline(sum(_sizes(ins))):
                        recv_works[peer] = [self.pg.recv([t], peer, _DATA_TAG | _nbytes(t)) for t in ins]
            except Exception as e:
                self._graveyard.append((out_parts, in_parts))
                if isinstance(e, RuntimeError) and lost_connection(e):  # gloo refused to post
                    raise self.fail_in_call(seq, call, peer, e, "the exchange") from e
                self.fail(f"rank {self.rank} raised inside collective #{seq} ({call.describe()}): {type(e).__name__}: {e}")
                raise
            self._inflight[seq] = [out_parts, in_parts]
            pending = _Pending(self, seq, call, mine, send_works, recv_works, finish, timeout)
            if not all_pairs_see_mismatch:
                self._pairwise.add(seq)
            if in_parts is None:  # sizes from the headers: take them now, then receive
                theirs = self.take_headers(seq, call, timeout)
                bad = [(j, theirs[j], why) for j in sorted(theirs) if (why := hd.mismatch(mine[j], theirs[j]))]
                if bad:
                    pending._done = True
                    raise self.mismatch(pending, bad)
                got = []
                for peer in self.peers(-1):
                    if theirs[peer].send_total > 0:
                        t = make_recv(peer, theirs[peer].send_total)
                        got.append(t)
                        if hd.inline(theirs[peer].send_total):
                            hd.unpack(theirs[peer], [t])
                        else:
                            recv_works[peer] = [self.pg.recv([t], peer, _DATA_TAG | theirs[peer].send_total)]
                self._inflight[seq].append(got)
                for j, h in theirs.items():  # back for wait(), which checks them again
                    self._received.setdefault(j, {})[seq] = h
            return pending

    def inflight_recvs(self, seq: int):
        """``{peer: [tensors]}`` a fixed-size call ``seq`` receives into (``None``: sized from headers)."""
        got = self._inflight.get(seq)
        return None if got is None else got[1]

    def settle(self, seq: int) -> None:
        self._inflight.pop(seq, None)
        self._pairwise.discard(seq)

    def mismatch(self, pending: _Pending, bad) -> Exception:
        """The error of a call whose headers differ (see [Note: size-tagged messages and headers])."""
        seq = pending.seq
        j, theirs, why = bad[0]
        others = [k for k, _, _ in bad[1:]]
        err = PlanMismatchError(
            f"collective #{seq} of {self.name} differs between ranks ({why}): rank {self.rank} called "
            f"{hd.describe(pending.mine[j])}, {self.who(j)} called {hd.describe(theirs)}"
            + (f"; ranks {others} also differ from rank {self.rank}" if others else "")
            + ". Every rank must issue the same ragged collectives in the same order, with the same plans, "
            "dtypes and options (a rank that skipped or added a call, or built another plan)."
        )
        # unmatched messages stay posted if sizes differ, or if receives wait for the headers
        # (objects); in an all-to-all, peers may not see the mismatch: then the channel fails
        sizes_differ = any(hd.sizes_differ(pending.mine[k], h) or h.expect_total < 0 for k, h, _ in bad)
        pairwise = seq in self._pairwise
        self._pairwise.discard(seq)
        if sizes_differ or pairwise:
            self._graveyard.append(self._inflight.pop(seq, None))
            self.fail(f"rank {self.rank}: {err}", peer=None)
            return err if pairwise else raised_on_every_rank(err)
        for works in (pending.recvs, pending.sends):  # same sizes: every message was matched; drain
            for ws in works.values():
                for w in ws:
                    try:
                        _wait(w, pending.timeout)
                    except RuntimeError:
                        pass
        self.settle(seq)
        return raised_on_every_rank(err)

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
        self.fail(msg, peer=peer)
        return CollectiveError(msg, peer=peer)

    def fail(self, reason: str, *, peer: int | None = None) -> None:
        """Fails the channel: poison every peer (see [Note: poison]). Idempotent."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = CollectiveError(reason, peer=peer)
            sends = []
            for j in self.peers(1):
                buf = hd.encode_poison(self.seq, self.size, reason)
                try:
                    sends.append((self.pg.send([torch.frombuffer(buf, dtype=torch.uint8)], j, _HEADER_TAG), buf))
                except RuntimeError:
                    pass
            self._graveyard.append((sends, self._sent, self._posted, self._inflight))
            self._tell_store(reason)

    # The reason also goes to the c10d store (best effort), for peers that only see a closed
    # connection (a killed process, or pairs closed by a timed-out wait).
    def _store_key(self, rank: int | None) -> str:
        return f"ragged/{self._incarnation}/failure/{self.name}/{self._global(rank)}"

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
