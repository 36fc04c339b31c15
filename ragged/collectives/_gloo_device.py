"""The GPU's rules on gloo: what a work of NCCL's shape (``handshake="deferred"``) does on gloo.

[Note: NCCL's rules on gloo]
No machine here has two GPUs, and NCCL refuses two ranks on one, so NCCL's shape on gloo is the
stand-in for a multi-GPU CI (docs/engine.md). Where NCCL and gloo differ in a way ragged's code
could depend on, every work of the deferred transport on gloo (a :class:`DeviceWork`) behaves
like NCCL's:

* **a timed wait fails the communicator.** ``WorkNCCL::wait(timeout)`` is a blocking wait that
  aborts the communicator when the work has not finished within the timeout, and whether it has
  depends on the device's progress, which the host does not control. So every timed wait of a
  :class:`DeviceWork` poisons the comm and raises :class:`~ragged.CollectiveError`, finished or
  not. ragged waits untimed: the host blocks on the work's future, watched by the comm's ledger
  (a peer's poison or the comm's ``timeout`` ends the wait, as NCCL's abort and watchdog end a
  device wait), never on a timed ``Work.wait``;
* **the device's progress is not the host's.** A CUDA event or ``WorkNCCL::isCompleted``
  reports completion whenever the device gets there, at times that differ between ranks. So
  ``is_completed()`` of a finished :class:`DeviceWork` still answers no to a random number of
  queries (0 to ``LAG - 1``, drawn per work from a generator seeded by the process's rank:
  different on every rank, the same from run to run). Code that issues or skips a collective on
  such an answer diverges between ranks, which the next rule catches;
* **the same collectives in the same order, on every group.** Not an emulation: the ledger
  records every rank's calls, interleaved across the shard and replica groups, and compares them
  at every agreement point (see [Note: deferred agreement] in ``_ledger.py``). On NCCL, two
  groups' calls issued in different orders deadlock; gloo, which runs each group on its own
  threads, would never show it.

What one process cannot stand in for: the kernels, streams and events themselves
(``scripts/gpu_check.sh`` runs them over a real single-rank NCCL communicator), and NCCL's
watchdog (the comm's ``timeout`` plays it).
"""

from __future__ import annotations

import random
import threading
import time

from ragged._errors import CollectiveError
from ragged.collectives._handles import future_of

__all__ = ["GlooDevice", "DeviceWork", "LAG"]

LAG = 4  # a finished work answers "not yet" to 0..LAG-1 queries
_WATCH_SLICE = 0.25  # seconds between two looks at the ledger while the host waits


class GlooDevice:
    """What a GPU is to the deferred transport, on gloo: the works of one comm, waited by the
    host under ``ledger``'s watch (its failure, its poison, its ``timeout``), and answering
    queries late (see [Note: NCCL's rules on gloo])."""

    def __init__(self, rank: int, ledger):
        self.ledger = ledger
        self._rng = random.Random(f"ragged.gloo-device.{rank}")

    def work(self, work) -> DeviceWork:
        return DeviceWork(work, self, self._rng.randrange(LAG))

    def timed_wait(self, timeout) -> None:
        msg = (f"rank {self.ledger.rank}: a timed wait ({timeout}) on a collective of NCCL's shape: ProcessGroupNCCL "
               "aborts the communicator when such a wait's work has not finished in time, which depends on the "
               "device's progress, so NCCL's shape never waits with a timeout (see [Note: NCCL's rules on gloo]).")
        self.ledger.poison(msg)
        raise CollectiveError(msg)

    def host_wait(self, dw: DeviceWork) -> None:
        """Blocks until ``dw``'s collective has finished, looking at the ledger every slice: a
        failed ledger (a peer's poison, seen by its watcher) ends the wait, and so does the comm's
        ``timeout``, which poisons the comm (see [Note: NCCL's rules on gloo])."""
        led = self.ledger
        deadline = time.monotonic() + led.timeout
        while not dw.finished.wait(_WATCH_SLICE):
            if led.failure is not None:
                raise RuntimeError("the ledger failed while this collective waited")
            if time.monotonic() > deadline:
                msg = (f"rank {led.rank}: a collective waited {led.timeout:g} s for its peers (timeout= of the comm; "
                       "handshake='deferred'): a peer stopped calling collectives, or issued other ones. Every "
                       "rank must issue the same collectives in the same order; raise timeout= for slow steps.")
                led.poison(msg)
                raise CollectiveError(msg)
        if dw.errors:
            raise dw.errors[0]
        if dw.waiter is None:
            dw.work.wait()  # its future is done: returns at once, or raises the collective's error


class DeviceWork:
    """One gloo work under NCCL's rules (see [Note: NCCL's rules on gloo]). ``finished`` is set
    when the collective has finished: by its future, or, for a work without one (gloo's
    reduce-scatter, point-to-point works), by its untimed wait on a thread of its own, the
    ``waiter`` (such a work is waited once only: gloo's receive work waits for another message
    when waited again)."""

    __slots__ = ("work", "device", "finished", "errors", "waiter", "_lag", "_waited")

    def __init__(self, work, device: GlooDevice, lag: int):
        self.work, self.device, self._lag = work, device, lag
        self.finished, self.errors, self._waited, self.waiter = threading.Event(), [], False, None
        future = future_of(work)
        if future is None:
            self.waiter = threading.Thread(target=self._wait_untimed, name="ragged-wait", daemon=True)
            self.waiter.start()
        else:
            future.add_done_callback(lambda _: self.finished.set())

    def _wait_untimed(self) -> None:
        try:
            self.work.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised by the host's wait
            self.errors.append(e)
        self.finished.set()

    def wait(self, timeout=None) -> None:
        if timeout is not None:
            self.device.timed_wait(timeout)
        if not self._waited:
            self.device.host_wait(self)
            self._waited = True

    def is_completed(self) -> bool:
        if not self.finished.is_set():
            return False
        if self._lag:
            self._lag -= 1
            return False
        return True

    def get_future(self):
        return self.work.get_future()
