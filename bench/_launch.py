"""Start ``world_size`` processes (torch.multiprocessing, spawn), one process group, run a function.

Backend: NCCL with one GPU per rank when CUDA has enough devices, gloo on CPU otherwise
(``backend=`` overrides). ``backend="fake"``: one process, rank ``fake_rank`` of a
``world_size``-rank torch fake process group (collectives return at once and move no data,
allocations are real: one rank's memory at any world size). Workers run with ``OMP_NUM_THREADS`` (default 1: the ranks share the
machine's cores). ``exact_rss=True`` also fixes ``MALLOC_MMAP_THRESHOLD_`` (glibc then returns
every freed large tensor to the OS at once, so RSS follows live tensors; but every new tensor
then costs fresh pages, which slows allocating code: leave it off when timing). The function's return value of every rank comes back to the parent, in rank order.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["launch", "pick_backend", "device_for"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(world_size: int, backend: str | None = None) -> str:
    if backend:
        return backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def device_for(backend: str, rank: int) -> torch.device:
    if backend == "fake":  # one process: its one GPU if there is one
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _worker(rank, world_size, port, backend, fn, args, queue, threads, pg_timeout, sys_path):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    torch.set_num_threads(threads)
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if backend == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        out = (True, fn(rank, world_size, backend, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = (False, traceback.format_exc())
    queue.put((rank, *out))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def launch(world_size: int, fn, *args, backend: str | None = None, threads: int = 1, timeout: float = 900.0,
           pg_timeout: float = 300.0, exact_rss: bool = False, fake_rank: int = 0):
    """Runs ``fn(rank, world_size, backend, *args)`` on ``world_size`` fresh processes (one process,
    rank ``fake_rank``, with ``backend="fake"``).

    Returns:
        The results in rank order (``backend="fake"``: a list of one).

    Raises:
        RuntimeError: a rank raised (with every failing rank's traceback) or did not answer in time.
    """
    import queue as queue_mod

    backend = pick_backend(world_size, backend)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if exact_rss:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    ranks = [fake_rank] if backend == "fake" else list(range(world_size))
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, threads, pg_timeout,
                                          list(sys.path)), daemon=False)
        for r in ranks
    ]
    for p in procs:
        p.start()
    got, errors = {}, {}
    try:
        while len(got) + len(errors) < len(ranks):
            try:
                r, ok, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                raise RuntimeError(f"ranks {sorted(set(ranks) - set(got) - set(errors))} did not "
                                   f"answer within {timeout} s") from None
            (got if ok else errors)[r] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 2)
            if p.is_alive():
                p.kill()
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"benchmark failed on ranks {sorted(errors)}:\n{text}")
    return [got[r] for r in ranks]
