"""Faults during checkpointing on real gloo process groups: a rank killed at every step of the
save protocol, kills during save and load at W=2 and W=4, ranks in different checkpoint calls.

Done when: every surviving rank raises a ragged error within 5 s of the fault (never the group
timeout, 60 s here), and the path always holds a complete checkpoint: the old one before the
new one is published, the new one after (``export`` reads it, an interrupted overwrite's old
checkpoint included).

Each kill needs fresh processes (the group is broken afterwards): ``_launch`` forks them from a
forkserver that has torch and ragged imported, so a run costs well under a second of start-up.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
import warnings

import pytest
import torch

import ragged as rg
from ragged.checkpoint._save import SAVE_STEPS
from tests.distributed._harness import comm, rank, workers_fixture

pytestmark = pytest.mark.distributed

BOUND_S = 5.0  # every survivor raises within this long after the fault
PG_TIMEOUT_S = 60.0  # the group timeout a hang would wait for


# ---- a launcher that tolerates dead ranks -------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(r, m, port, fn, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=m,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        out = (True, fn(r, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = (False, traceback.format_exc())
    results.put((r, out))
    results.close()
    results.join_thread()  # flushed before the hard exit
    os._exit(0)  # no teardown: peers may be dead


def _launch(m: int, fn, *args, timeout: float = 40.0) -> dict[int, object]:
    """Runs ``fn(rank, *args)`` on ``m`` fresh gloo processes; ``{rank: result}`` of the ranks
    that answered (a killed rank does not). A rank that raised fails the test."""
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, m, port, fn, args, results), daemon=True) for r in range(m)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    while len(got) < m and time.monotonic() < deadline:
        try:
            r, out = results.get(timeout=0.2)
            got[r] = out
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    errors = {r: v for r, (ok, v) in got.items() if not ok}
    assert not errors, "\n".join(f"--- rank {r} ---\n{v}" for r, v in errors.items())
    return {r: v for r, (ok, v) in got.items()}


mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed.checkpoint", "ragged", __name__])


# ---- worker bodies --------------------------------------------------------------------------
def _state(c, step: int):
    from tests.checkpoint._util import full_trees, make_state, plan_for

    full = full_trees(step)
    return make_state(c.rank, plan_for(full["params"], c.world_size), full, step=step)


def _kill_at(when: str, victim: int, stamp: str):
    """A FAULT hook: the victim stops (os._exit, as a crash) on reaching step ``when``."""
    me = rg.collectives.from_torch().rank

    def fault(step: str) -> None:
        if step == when and me == victim:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os._exit(17)

    return fault


def _outcome(call):
    """``(error type, message, time)`` of ``call()``, or ``None`` if it returned."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        return type(exc).__name__, str(exc), time.time()
    return None


def _save_killed_at(r, path, when, victim, stamp, exchange):
    from ragged.checkpoint import _dcp, _save

    c = rg.collectives.from_torch()
    rg.checkpoint.save(path, _state(c, 1), c)  # the old checkpoint, complete
    if not exchange:  # the portable protocol: two renames (load finds the old one in between)
        _save._exchange_dirs = lambda a, b: False
    _dcp.FAULT = _kill_at(when, victim, stamp)
    return _outcome(lambda: rg.checkpoint.save(path, _state(c, 2), c, overwrite=True))


def _in_call_killed_at(r, path, op, when, victim, stamp):
    from ragged.checkpoint import _dcp

    c = rg.collectives.from_torch()
    if op == "load":
        rg.checkpoint.save(path, _state(c, 1), c)
    _dcp.FAULT = _kill_at(when, victim, stamp)
    if op == "save":
        return _outcome(lambda: rg.checkpoint.save(path, _state(c, 2), c))
    return _outcome(lambda: rg.checkpoint.load(path, _state(c, 0), c))


def _check_survivors(results, m, victim, stamp):
    killed_at = float(open(stamp).read())
    assert sorted(results) == [r for r in range(m) if r != victim]
    for r, out in results.items():
        assert out is not None, f"rank {r} returned normally although rank {victim} died"
        name, message, t = out
        assert name == "CheckpointError", (r, name, message)
        assert "a rank died, was killed, or is not in this checkpoint call" in message, message
        assert t - killed_at < BOUND_S, f"rank {r} raised {t - killed_at:.1f} s after the kill"
    slowest = max(t for _, _, t in results.values()) - killed_at
    print(f"slowest survivor raised {slowest * 1e3:.0f} ms after the fault")  # pytest -s shows it
    return slowest


def _published_step(path) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the old checkpoint found aside
        flat = rg.checkpoint.consolidate(path)
    from tests.checkpoint._util import full_trees

    want = full_trees(flat["step"])["params"]["emb"]
    assert torch.equal(flat["params.emb"], want) and torch.equal(flat["opt.0.nu.head"], full_trees(flat["step"])["nu"]["head"])
    return flat["step"]


# Which checkpoint the path holds after a kill at each step: the old one (step 1) until the new
# one is published (with the atomic swap "swapped" is "published"), the new one (step 2) after.
_RANK0_STEPS = ("manifest", "swapped", "published", "retired")
_CASES = [(s, 0, True) for s in SAVE_STEPS] + [(s, 1, True) for s in SAVE_STEPS[:3]] + [(s, 0, False) for s in _RANK0_STEPS[1:]]


@pytest.mark.parametrize("when, victim, exchange", _CASES, ids=[f"{s}-rank{v}{'' if e else '-renames'}" for s, v, e in _CASES])
def test_kill_at_every_save_step(tmp_path, when, victim, exchange):
    path, stamp = str(tmp_path / "ckpt"), str(tmp_path / "killed")
    results = _launch(2, _save_killed_at, path, when, victim, stamp, exchange)
    _check_survivors(results, 2, victim, stamp)
    # rank 0 publishes once every rank's files are checksummed, whoever dies after that
    published_from = "checksummed" if victim else ("swapped" if exchange else "published")
    expect = 2 if SAVE_STEPS.index(when) >= SAVE_STEPS.index(published_from) else 1
    assert _published_step(path) == expect
    if not exchange and when == "swapped":  # between the renames: found aside, with a warning
        with pytest.warns(RuntimeWarning, match="an overwrite of it did not finish"):
            rg.checkpoint.read_manifest(path)


def test_every_save_step_is_covered():
    assert {c[0] for c in _CASES} == set(SAVE_STEPS)


@pytest.mark.parametrize(
    "m, op, when, victim",
    [(2, "save", "written", 1), (4, "save", "written", 2), (4, "save", "agreed", 0),
     (2, "load", "opened", 0), (4, "load", "read", 2), (4, "load", "agreed", 3)],
    ids=lambda v: str(v),
)
def test_kill_during_save_or_load(tmp_path, m, op, when, victim):
    """A rank dies mid-call: every survivor raises promptly (the exchange connects every pair)."""
    stamp = str(tmp_path / "killed")
    results = _launch(m, _in_call_killed_at, str(tmp_path / "ckpt"), op, when, victim, stamp)
    _check_survivors(results, m, victim, stamp)


def _killed_in_a_background_save(r, path, stamp, handshake):
    from ragged.checkpoint import _dcp

    c = rg.collectives.from_torch(handshake=handshake)
    rg.checkpoint.save(path + "-1", _state(c, 1), c)  # the previous checkpoint
    _dcp.FAULT = _kill_at("written", 1, stamp)  # in rank 1's writing thread, its files written
    handle = rg.checkpoint.save(path + "-2", _state(c, 2), c, blocking=False)
    return _outcome(handle.result)


@pytest.mark.parametrize("handshake", ["header", "deferred"], ids=["gloo-default", "nccl-shaped"])
def test_kill_during_a_background_save(tmp_path, handshake):
    """Rank 1 dies while its thread writes: the others raise at ``result()``, and the previous
    checkpoint is all the path holds (see [Note: a save in the background])."""
    path, stamp = str(tmp_path / "ckpt"), str(tmp_path / "killed")
    results = _launch(2, _killed_in_a_background_save, path, stamp, handshake)
    _check_survivors(results, 2, 1, stamp)
    assert _published_step(path + "-1") == 1 and not os.path.exists(path + "-2")


def _exit_instead_of(r, path, op, stamp):
    """Rank 1 skips the call and exits (its program ended early); the others are in it."""
    c = rg.collectives.from_torch()
    rg.checkpoint.save(path + "-old", _state(c, 1), c)
    if r == 1:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os._exit(0)
    if op == "save":
        return _outcome(lambda: rg.checkpoint.save(path, _state(c, 2), c))
    return _outcome(lambda: rg.checkpoint.load(path + "-old", _state(c, 0), c))


@pytest.mark.parametrize("m, op", [(2, "save"), (4, "load")])
def test_rank_exiting_instead_of_the_call(tmp_path, m, op):
    stamp = str(tmp_path / "exited")
    results = _launch(m, _exit_instead_of, str(tmp_path / "ckpt"), op, stamp)
    _check_survivors(results, m, 1, stamp)


# ---- ranks in different calls (no kill: one pool of workers serves them) ------------------------
workers2 = workers_fixture(2, pg_timeout=PG_TIMEOUT_S)
workers4 = workers_fixture(4, pg_timeout=PG_TIMEOUT_S)


def _different_calls(path, case):
    c = comm()
    r = rank()
    rg.checkpoint.save(path + "-old", _state(c, 1), c, overwrite=True)
    calls = {
        # rank 1 skips the save and goes on to load the previous checkpoint
        "skip save, load": lambda: (rg.checkpoint.load(path + "-old", _state(c, 0), c) if r == 1
                                    else rg.checkpoint.save(path, _state(c, 2), c)),
        # rank 1 saves another step (another path)
        "another step": lambda: rg.checkpoint.save(f"{path}-{2 + (r == 1)}", _state(c, 2), c),
        # rank 1 skips the load and saves
        "skip load, save": lambda: (rg.checkpoint.save(path, _state(c, 2), c) if r == 1
                                    else rg.checkpoint.load(path + "-old", _state(c, 0), c)),
    }
    start = time.time()
    out = _outcome(calls[case])
    return None if out is None else (out[0], out[1], out[2] - start)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("case", ["skip save, load", "another step", "skip load, save"])
def test_ranks_in_different_calls_all_raise(request, tmp_path, m, case):
    workers = request.getfixturevalue(f"workers{m}")
    results = workers.run(_different_calls, str(tmp_path / "ckpt"), case, timeout=PG_TIMEOUT_S + 30)
    for r, out in enumerate(results):
        assert out is not None, f"rank {r} finished its call"
        name, message, seconds = out
        assert name == "CheckpointError" and "the ranks are not in the same checkpoint call" in message, message
        assert seconds < BOUND_S
    assert sorted(os.listdir(tmp_path)) == ["ckpt-old"]  # nothing published, nothing left behind
