"""Reusable multi-process gloo harness: spawn the workers ONCE per test module, run many tests.

API (for any test module under ``tests/``):

    from tests.distributed._harness import workers_fixture, comm, mesh, rank, world_size
    workers2 = workers_fixture(2)            # a module-scoped pytest fixture: a Workers of 2 ranks
    workers4 = workers_fixture(4)

    def _body(x):                            # MODULE-LEVEL (picklable) function run on every rank
        c = comm()                           # rg.collectives.from_torch() of the default group (cached)
        return x + c.rank                    # any picklable result (tensors are fine)

    def test_something(workers2):
        assert workers2.run(_body, 10) == [10, 11]      # results in rank order

``Workers.run(fn, *args, timeout=None, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank
and returns the list of results; if any rank raises, it raises :class:`WorkerError` holding each
failing rank's formatted traceback (``.tracebacks``, a dict rank -> str), and the workers are
restarted on the next ``run`` (so return expected errors as values rather than raising them). If the ranks do not all
answer within ``timeout`` seconds (default: the ``Workers``' own, 120 s), the workers are killed
and :class:`WorkerTimeout` is raised; the next ``run`` respawns them. The process group itself is
created with a gloo timeout (default 60 s) so a rank stuck in a mismatched collective fails
rather than hangs.

Inside a worker: ``rank()``, ``world_size()``, ``comm(**kw)`` (cached ``from_torch(**kw)``),
``mesh(shape)`` (cached ``init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))``
for 2-D shapes), and ``group(ranks)`` (cached ``dist.new_group(ranks)``; every rank must call it).
Workers run with ``OMP_NUM_THREADS=1``, gloo on 127.0.0.1 and a free port.

A ``Workers`` is also usable outside pytest as a context manager:
``with Workers(2) as w: w.run(fn)``.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

__all__ = ["Workers", "WorkerError", "WorkerTimeout", "workers_fixture", "workers_2_and_4", "both_transports", "TRANSPORTS",
           "comm", "mesh", "rank", "world_size", "group", "transport"]


class WorkerError(RuntimeError):
    """A test function raised on one or more ranks."""

    def __init__(self, tracebacks: dict[int, str]):
        self.tracebacks = tracebacks
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items()))
        super().__init__(f"function failed on ranks {sorted(tracebacks)}:\n{text}")


class WorkerTimeout(TimeoutError):
    """Not every rank answered in time (the workers were killed)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- worker side -----------------------------------------------------------------------------
_STATE: dict = {}


def rank() -> int:
    return _STATE["rank"]


def world_size() -> int:
    return _STATE["world_size"]


TRANSPORTS = {"gloo-default": {}, "nccl-shaped": {"handshake": "deferred"}}
"""The two transports every exactness test runs in: gloo's default (per-call headers over its
checked point-to-point channel) and the one NCCL uses (native collectives + the deferred
ledger), so CI runs every line a GPU runs except the CUDA calls."""


def _use_transport(kwargs: dict) -> None:
    _STATE["transport"] = dict(kwargs)


def transport() -> dict:
    """The ``from_torch`` options of the test's transport (for comms not made by :func:`comm`)."""
    return dict(_STATE.get("transport", {}))


def comm(**kwargs):
    """``rg.collectives.from_torch(**kwargs)`` on the default group, cached per kwargs; options
    not given come from the test's transport (see :func:`both_transports`)."""
    import ragged as rg

    kwargs = {**_STATE.get("transport", {}), **kwargs}
    key = ("comm", tuple(sorted(kwargs.items())))
    if key not in _STATE:
        _STATE[key] = rg.collectives.from_torch(**kwargs)
    return _STATE[key]


def mesh(shape: tuple[int, ...]):
    """A cached CPU DeviceMesh of ``shape`` (2-D: dims named ``("replicate", "shard")``)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = ("mesh", tuple(shape))
    if key not in _STATE:
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        _STATE[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _STATE[key]


def group(ranks):
    """A cached ``dist.new_group(ranks)`` (collective: call it on every rank)."""
    import torch.distributed as dist

    key = ("group", tuple(ranks))
    if key not in _STATE:
        _STATE[key] = dist.new_group(list(ranks))
    return _STATE[key]


def _worker(r, m, port, tasks, results, pg_timeout, sys_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=m,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    _STATE.update(rank=r, world_size=m)
    results.put((r, -1, True, None))  # ready
    while True:
        task = tasks.get()
        if task is None:
            break
        tid, fn, args, kwargs = task
        try:
            out = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the parent
            out = (False, traceback.format_exc())
        try:
            results.put((r, tid, *out))
        except Exception:  # unpicklable result
            results.put((r, tid, False, traceback.format_exc()))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


# ---- parent side -----------------------------------------------------------------------------
class Workers:
    """``world_size`` gloo worker processes that run picklable functions on request."""

    def __init__(self, world_size: int, *, timeout: float = 120.0, pg_timeout: float = 60.0):
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self._procs = None
        self._tid = 0

    def _start(self):
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._tasks[r], self._results, self.pg_timeout, list(sys.path)),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(-1, self.timeout)

    def _collect(self, tid, timeout):
        deadline = time.monotonic() + timeout
        got: dict[int, tuple] = {}
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            try:
                r, t, ok, payload = self._results.get(timeout=max(left, 0.01))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if left <= 0 or dead:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    errs = {i: v for i, (ok_, v) in got.items() if not ok_}
                    self.close(kill=True)
                    raise WorkerTimeout(
                        f"ranks {missing} did not answer within {timeout}s (dead processes: {dead}); workers "
                        f"killed. Errors from the others: {errs}"
                    ) from None
                continue
            if t == tid:
                got[r] = (ok, payload)
        return got

    def run(self, fn, *args, timeout: float | None = None, **kwargs):
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        if self._procs is None:
            self._start()
        self._tid += 1
        for q in self._tasks:
            q.put((self._tid, fn, args, kwargs))
        got = self._collect(self._tid, self.timeout if timeout is None else timeout)
        errors = {r: v for r, (ok, v) in got.items() if not ok}
        if errors:
            # A rank that failed mid-protocol may leave the process group out of step: start
            # fresh workers on the next run rather than risk a hang or a confusing error.
            self.close(kill=True)
            raise WorkerError(errors)
        return [got[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False):
        if self._procs is None:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def workers_fixture(world_size: int, **kwargs):
    """A module-scoped pytest fixture yielding a started :class:`Workers` of ``world_size``."""

    @pytest.fixture(scope="module")
    def _fixture():
        w = Workers(world_size, **kwargs)
        try:
            yield w
        finally:
            w.close()

    return _fixture


def both_transports():
    """An autouse, parametrized fixture (ids ``gloo-default`` / ``nccl-shaped``): every test of the
    module runs once per :data:`TRANSPORTS` entry, its workers' :func:`comm` built with that
    transport's options. Assign it at module level: ``transport = both_transports()``."""

    @pytest.fixture(autouse=True, params=list(TRANSPORTS))
    def transport(request):
        for name in request.fixturenames:
            if name.startswith("workers"):
                request.getfixturevalue(name).run(_use_transport, TRANSPORTS[request.param])
        return request.param

    return transport


def workers_2_and_4():
    """``(workers2, workers4, workers)``: module-scoped pools of 2 and 4 workers and a fixture
    parametrized over both (ids ``w2`` / ``w4``). Assign all three at module level so pytest
    finds them by name::

        workers2, workers4, workers = workers_2_and_4()
    """

    @pytest.fixture(params=[2, 4], ids=["w2", "w4"])
    def workers(request):
        return request.getfixturevalue(f"workers{request.param}")

    return workers_fixture(2), workers_fixture(4), workers
