"""Handles of collectives in flight: what ``async_op=True`` returns, and how it is asked whether
it is done (``is_completed``) and waited (``wait``).

* :class:`_Work`: torch works (NCCL's, gloo's under NCCL's rules, the fake process group's)
  plus a local finaliser (e.g. the division of a mean);
* :class:`_Pending`: one header-checked exchange of ``handshake="header"`` (see [Note:
  size-tagged messages and headers] in ``_channel.py``);
* :class:`_Guarded`: a handle whose failing ``wait()`` poisons the comm.
"""

from __future__ import annotations

import datetime
import time

from ragged._errors import CollectiveError
from ragged.collectives import _header as hd
from ragged.collectives._base import completed, poison_on_error

__all__ = ["_Work", "_Pending", "_Guarded", "future_of", "lost_connection"]


def lost_connection(e: RuntimeError) -> bool:
    """Whether a backend's error says a peer's connection is gone (a peer died or exited)."""
    text = str(e)
    return any(k in text for k in ("Connection", "connection", "Socket", "pair closure", "closed by peer"))


def _wait(work, seconds: float) -> None:
    work.wait(datetime.timedelta(seconds=max(seconds, 0.001)))


class _Work:
    """Waits on torch Work objects, then runs a local finaliser (e.g. the chunk sum).

    The works are NCCL's (``wait()`` orders the current stream after the collective; the host
    does not wait), the deferred transport's on gloo (:class:`~ragged.collectives._gloo_device.DeviceWork`:
    the host waits, untimed, under the ledger's watch) or the fake process group's (done on
    return). ``ledger``: a wait that fails because a peer poisoned the comm (its watcher aborted
    the group, see [Note: deferred agreement]) raises the poison's :class:`~ragged.CollectiveError`."""

    __slots__ = ("_works", "_finish", "_done", "_ledger")

    def __init__(self, works, finish=None, ledger=None):
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._ledger = ledger

    def wait(self) -> None:
        if self._done:
            return
        try:
            for w in self._works:
                w.wait()
        except CollectiveError:
            raise
        except RuntimeError as e:
            led = self._ledger
            if led is None:
                raise
            # a peer's abort may break this collective before this rank's watcher saw the poison
            failure = led.read_poison()
            if failure is not None:
                raise CollectiveError(f"{failure} (the collective was aborted)", peer=failure.peer) from e
            if lost_connection(e):  # a peer that died tells no one: this rank tells the others
                msg = (f"rank {led.rank} lost a peer in a collective: {str(e).splitlines()[0][:160]}. That rank "
                       "probably died or exited (see its log).")
                led.poison(msg)
                raise CollectiveError(msg) from e
            raise
        if self._finish is not None:
            self._finish()
        self._done = True

    def is_completed(self) -> bool:
        """Every op has finished on the device (the local finaliser, if any, still runs at
        ``wait()``): a question about the device's progress, not about ``wait()``, which on NCCL
        returns before the collective has run (see [Note: asking a torch work whether it is done])."""
        return all(type(w).__name__ == "FakeWork" or w.is_completed() for w in self._works)


def future_of(work):
    """What tells, without blocking and without ``Work.is_completed``, whether ``work`` is done:
    ``True`` (the fake process group's works are done on return: its collectives move no data,
    though they never say so), its future, or ``None`` (it cannot tell before ``wait()``: gloo's
    send / recv works and its native reduce-scatter).

    [Note: asking a torch work whether it is done]
    ``Work.is_completed`` is bound without releasing the GIL and takes the work's mutex. gloo
    finishes a collective on its own thread inside ``Work::finish``, which holds that mutex while
    it runs the profiler's end-of-op callback; that callback restores the thread-local state of
    the caller, saved-tensor hooks included, and a hook is a Python object, so it needs the GIL.
    Under ``torch.profiler`` a probe from a thread that holds the GIL while a collective issued
    under ``saved_tensors_hooks`` finishes (the step's backward, exactly) therefore deadlocks:
    the probe waits for the mutex, gloo's thread for the GIL (how it was found: docs/design.md,
    "Measurements behind the design"). A work's future is completed
    before ``Work::finish`` runs, and ``Future.done`` takes only the future's own lock, so
    ragged asks the future. Not on NCCL: there the future is completed when the work is queued
    on the device, while ``WorkNCCL::isCompleted`` queries its CUDA event (and runs no callback
    under the mutex), so NCCL works are asked directly."""
    if type(work).__name__ == "FakeWork":
        return True
    try:
        return work.get_future()
    except RuntimeError:  # send / recv works have none
        return None


class _Guarded:
    """A handle whose ``wait()`` poisons the comm if it raises (see [Note: poison] in ``_channel.py``)."""

    __slots__ = ("_work", "_comm")

    def __init__(self, work, comm):
        self._work, self._comm = work, comm

    def wait(self) -> None:
        with poison_on_error(self._comm):
            self._work.wait()

    def is_completed(self) -> bool:
        return completed(self._work)


class _Pending:
    """One exchange in flight; ``wait()`` checks the headers, then waits the data (see
    [Note: size-tagged messages and headers])."""

    __slots__ = ("channel", "seq", "call", "mine", "sends", "recvs", "finish", "timeout", "_done")

    def __init__(self, channel, seq, call, mine, sends, recvs, finish, timeout):
        self.channel, self.seq, self.call, self.mine = channel, seq, call, mine
        self.sends, self.recvs = sends, recvs  # {peer: [work, ...]}; tensors are kept by the channel until done
        self.finish, self.timeout = finish, timeout
        self._done = False

    def is_completed(self) -> bool:
        """Only once ``wait()`` has checked the headers and run the local part: the result is
        never called done before its call was verified (gloo's works also report completion
        only once waited)."""
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        ch = self.channel
        theirs = ch.take_headers(self.seq, self.call, self.timeout)
        bad = [(j, theirs[j], why) for j in sorted(theirs) if (why := hd.mismatch(self.mine[j], theirs[j])) is not None]
        if bad:
            self._done = True
            raise ch.mismatch(self, bad)
        ins = ch.inflight_recvs(self.seq)
        if ins is not None:
            for j, h in theirs.items():
                if h.payload:
                    hd.unpack(h, ins[j])
        deadline = time.monotonic() + self.timeout
        for kind, works in (("data", self.recvs), ("receipt of its data", self.sends)):
            for peer, ws in works.items():
                for w in ws:
                    try:
                        _wait(w, deadline - time.monotonic())
                    except RuntimeError as e:
                        raise ch.fail_in_call(self.seq, self.call, peer, e, f"its {kind}") from e
        self._done = True
        ch.settle(self.seq)
        ch.repost()
        if self.finish is not None:
            self.finish()
