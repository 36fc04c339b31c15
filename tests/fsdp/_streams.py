"""CUDA's stream semantics on the CPU, for the step's runtime (see [Note: streams and lifetimes]
in ragged/fsdp/_device.py).

:class:`FakeCudaApi` stands in for the ``torch.cuda`` calls of the real
:class:`~ragged.fsdp._device.CudaStreams` (streams, events, the current-stream context), so the
runtime runs the very code it runs on a GPU while its tensors stay on the CPU and every kernel
runs inline. Each stream keeps a vector clock; ``record_event`` snapshots it and ``wait_event``
merges a snapshot in, so "work X on stream A is ordered before work Y on stream B" is a clock
comparison. :class:`RecordingStreams` (that ``CudaStreams`` with the fake api) also receives the
runtime's ``alloc`` / ``free`` / ``access`` reports and models the caching allocator (a freed block
is handed to the next allocation of its size on the stream that allocated it). Every access to
a memory block is checked against the block's earlier accesses, its previous tenants' included:
two accesses on different streams, one of them a write, must be ordered by events, or a race
is recorded. Also checked: an access on a side stream happens inside that stream's context (and
one on compute outside any), a collective is issued inside its stream's context, and at the end
of a call compute is ordered after every side stream.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

from ragged.fsdp._device import COMPUTE, GATHER, REDUCE, CudaStreams

STREAMS = (COMPUTE, GATHER, REDUCE)


class FakeEvent:
    __slots__ = ("stream", "clock", "api")

    def __init__(self, stream: str, clock: dict, api):
        self.stream, self.clock, self.api = stream, clock, api

    def query(self) -> bool:
        """The device's progress: every event has completed, unless the api says the device lags
        (``FakeCudaApi.device_lags``: no event completes within the call)."""
        return not self.api.device_lags


class FakeStream:
    def __init__(self, api, name: str):
        self.api, self.name = api, name
        self.clock = {s: 0 for s in STREAMS}

    def tick(self) -> int:
        self.clock[self.name] += 1
        return self.clock[self.name]

    def record_event(self) -> FakeEvent:
        self.tick()
        return FakeEvent(self.name, dict(self.clock), self.api)

    def wait_event(self, event: FakeEvent) -> None:
        for s, c in event.clock.items():
            if c > self.clock[s]:
                self.clock[s] = c


class FakeCudaApi:
    """The ``CudaApi`` of ``ragged/fsdp/_device.py`` with :class:`FakeStream` objects (one api
    per simulated rank: its streams and their clocks)."""

    device_lags = False  # see FakeEvent.query

    def __init__(self):
        self.compute = FakeStream(self, COMPUTE)
        self._made = iter((GATHER, REDUCE))
        self.by_name = {COMPUTE: self.compute}
        self.current = threading.local()

    def current_device(self):
        return 0

    def current_stream(self, index):
        return self.by_name[self.current_name()]

    def new_stream(self, index):
        s = FakeStream(self, next(self._made))
        self.by_name[s.name] = s
        return s

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        stack = self.stack()
        stack.append(s.name)
        try:
            yield
        finally:
            stack.pop()

    def stack(self) -> list:
        if not hasattr(self.current, "stack"):
            self.current.stack = []
        return self.current.stack

    def current_name(self) -> str:
        stack = self.stack()
        return stack[-1] if stack else COMPUTE


class _Memory:
    """One block of device memory and its accesses: the last write and the reads since."""

    __slots__ = ("owner", "nbytes", "write", "reads")

    def __init__(self, owner: str, nbytes: int, write):
        self.owner, self.nbytes, self.write, self.reads = owner, nbytes, write, []


class RecordingStreams(CudaStreams):
    """The real ``CudaStreams`` over :class:`FakeCudaApi`, plus the allocator model and the
    race detector (see the module docstring). ``problems`` lists what went wrong."""

    def __init__(self, api: FakeCudaApi):
        super().__init__(_cpu0, api=api)
        self.fake = api
        self.memory: dict = {}  # buffer key -> _Memory
        self.free_lists: dict = {}  # (stream, nbytes) -> [_Memory]
        self.problems: list[str] = []
        self.issues: list[tuple[int, str, int]] = []  # (host order, stream, its clock after the collective)
        self.compute_accesses: list[tuple[int, dict]] = []  # (host order, compute's clock at the access)
        self.seq = itertools.count()
        self.before = None

    # ---- the runtime's calls ---------------------------------------------------------------
    def begin_call(self):
        self.before = (COMPUTE, self._s(COMPUTE).tick())  # what compute did before the call (the optimizer)
        super().begin_call()

    def end_call(self):
        super().end_call()
        c = self._s(COMPUTE).clock
        for s in (GATHER, REDUCE):
            if c[s] < self._s(s).clock[s]:
                self.problems.append(f"end of call: compute is not ordered after the {s} stream")

    def issued(self, stream, work):
        if self.fake.current_name() != stream:
            self.problems.append(f"a collective for the {stream} stream issued on {self.fake.current_name()}")
        ev = super().issued(stream, work)
        self.issues.append((next(self.seq), stream, ev.clock[stream]))
        return ev

    def alloc(self, stream, key, nbytes):
        self._check_scope(stream, f"alloc {key}")
        reuse = self.free_lists.get((stream, nbytes))
        mem = reuse.pop() if reuse else _Memory(stream, nbytes, None)
        self.memory[key] = mem
        self.access(stream, key, write=True)

    def free(self, key):
        mem = self.memory.pop(key, None)
        if mem is None:
            self.problems.append(f"free of unknown buffer {key}")
            return
        self.free_lists.setdefault((mem.owner, mem.nbytes), []).append(mem)

    def access(self, stream, key, write=False):
        self._check_scope(stream, f"{'write' if write else 'read'} {key}")
        mem = self.memory.get(key)
        if mem is None:  # a buffer from before the call (a shard): last written on compute before it
            mem = self.memory[key] = _Memory(COMPUTE, 0, self.before)
        s = self._s(stream)
        for prior in ([mem.write] if mem.write else []) + (mem.reads if write else []):
            other, count = prior
            if other != stream and s.clock[other] < count:
                kind = "write" if prior is mem.write else "read"
                self.problems.append(f"race on {key}: {'write' if write else 'read'} on {stream} not ordered after "
                                     f"the {kind} on {other} (event {count}, {stream} has seen {s.clock[other]})")
        count = s.tick()
        if write:
            mem.write, mem.reads = (stream, count), []
        else:
            mem.reads.append((stream, count))
        if stream == COMPUTE:
            self.compute_accesses.append((next(self.seq), dict(s.clock)))

    # ---- queries for tests -----------------------------------------------------------------
    def overlapped(self, stream: str) -> tuple[int, int]:
        """``(overlapped, issued)``: of the collectives issued on ``stream``, how many some compute
        work queued after them does not wait for (so it may run while they do)."""
        mine = [(seq, count) for seq, name, count in self.issues if name == stream]
        n = sum(any(a > seq and vc[stream] < count for a, vc in self.compute_accesses) for seq, count in mine)
        return n, len(mine)

    def _s(self, name) -> FakeStream:
        return self.fake.by_name[name]

    def _check_scope(self, stream, what):
        cur = self.fake.current_name()
        if cur != stream:
            self.problems.append(f"{what} on the {stream} stream made while {cur} is current")


class _Cpu0:
    type, index = "cuda", 0


_cpu0 = _Cpu0()
