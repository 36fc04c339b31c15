"""No hangs, no silent mismatch (issue 16): ranks that disagree, fail alone, stop early, sleep,
exit or are killed make every rank raise within 5 s, on real gloo groups of 2 and 4 ranks.

Each scenario runs on a fresh process group (``dist.new_group``), so what it breaks (a
poisoned or aborted group) does not leak into the next; scenarios that end a process run on
their own short-lived processes (``_spawn``). Every scenario returns, per rank, what it
raised (type, message) and when (``time.time()``), and the rank that causes the fault returns
when it did; no rank may return a result instead of an error.
"""

from __future__ import annotations

import copy
import datetime
import os
import pathlib
import signal
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ragged as rg
from ragged import spec
from tests.distributed._harness import TRANSPORTS, workers_2_and_4

pytestmark = pytest.mark.distributed

workers2, workers4, workers = workers_2_and_4()
PROMPT = 5.0  # seconds: every rank raises within this of the fault (issue 16)


# ---- shared pieces (module level: pickled to the workers) -----------------------------------
def _params(seed=0, dtype=torch.float32, rows=11):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(rows, 8, generator=g, dtype=dtype), "w": torch.randn(9, 8, generator=g, dtype=dtype),
            "b": torch.randn(9, generator=g, dtype=dtype)}


def _fresh_comm(**kw):
    """A comm on a new group of every rank (every rank calls it, in the same order). With a comm
    ``timeout``, the group's own timeout is a few seconds longer, so the collectives a scenario
    leaves blocked end (NCCL's watchdog would end them) and the workers stay usable."""
    m = dist.get_world_size()
    pg_timeout = {"timeout": datetime.timedelta(seconds=kw["timeout"] + 3)} if "timeout" in kw else {}
    return rg.collectives.from_torch(dist.new_group(list(range(m)), **pg_timeout), **kw)


def _outcome(fn, *args):
    """``("ok", repr(result), t)`` or ``(error type name, message, t)``, ``t`` when it returned/raised."""
    try:
        out = fn(*args)
        return ("ok", repr(out)[:200], time.time())
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        return (type(e).__name__, str(e), time.time())


def _loop(comm, plan, params, n=50):
    d = rg.shard(plan, params, comm)
    for _ in range(n):
        rg.gather(d, comm)
    return "finished"


def _report(what, delays):
    """One line per scenario (``pytest -s`` shows them; docs/engine.md lists the scenarios): the slowest rank."""
    print(f"\nfault latency: {what}: slowest rank raised {max(delays) * 1e3:.0f} ms after the fault")


def _check_all_raised(outcomes, t_fault, allowed=("PlanMismatchError", "CollectiveError", "RuntimeError",
                                                  "LayoutError", "RaggedValueError")):
    for r, (kind, msg, t) in outcomes.items():
        assert kind != "ok", f"rank {r} returned a result after the fault: {msg}"
        assert kind in allowed, f"rank {r} raised {kind}: {msg}"
        assert t - t_fault < PROMPT, f"rank {r} raised {t - t_fault:.1f} s after the fault: {msg}"
    return [t - t_fault for _, _, t in outcomes.values()]


def _tiny_training(comm, layers):
    """``(units, opt, state, local, task)``: a tiny GPT sharded for ``rg.fsdp``, its local copy
    (hooks go there) and a synthetic task."""
    from ragged import fsdp
    from ragged.examples.data import SyntheticLM
    from ragged.examples.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, dim=32, num_layers=layers, num_heads=4, ffn_dim=48, max_seq_len=16))
    model.reset_parameters(torch.Generator().manual_seed(0))
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = rg.optim.adamw(1e-2)
    state = fsdp.init(units, model, opt, comm)
    return units, opt, state, copy.deepcopy(model), SyntheticLM(64, 16, seed=1)


def _step_of(units, local, opt, comm):
    from ragged import fsdp
    from ragged.examples.gpt import loss_fn

    return fsdp.make_step(units, loss_fn(local), opt, comm)


# ---- mismatches (every rank raises PlanMismatchError naming both sides) ---------------------
def _setup(**kw):
    """A fresh comm, this rank, the world size, whether this is the odd (last) rank, params, plan, shard."""
    comm = _fresh_comm(**kw)
    r, m = comm.rank, comm.world_size
    params = _params()
    plan = rg.make_plan(params, world_size=m)
    return comm, r, m, r == m - 1, params, plan, rg.shard(plan, params, comm)


def _mismatch(kind, transport=()):
    comm, r, m, odd, params, plan, d = _setup(**dict(transport))
    grads = _params(seed=1 + r)
    other = rg.make_plan(params, {"emb": spec.Rows(1), "w": spec.Elements(1), "b": None}, world_size=m, strategy="naive")
    d_other = rg.shard(other, params, comm)
    rg.gather(d, comm)  # agreed once: what follows is caught by each call's own check
    rg.gather(d_other, comm)
    rg.reduce_scatter(plan, grads, comm, op="mean")
    t0 = time.time()

    def body():
        if kind == "other_collective":
            return rg.reduce_scatter(plan, grads, comm) if odd else rg.gather(d, comm)
        if kind == "skipped_call":  # the odd rank skips one gather, then goes on with the next call
            if not odd:
                rg.gather(d, comm)
            return rg.reduce_scatter(plan, grads, comm, op="mean")
        if kind == "op":  # "sum" vs "mean": the same bytes move, the result would be xW on one rank
            return rg.reduce_scatter(plan, grads, comm, op="sum" if odd else "mean")
        if kind == "dtype":  # bf16 vs fp32: a longer message than posted would abort gloo
            return rg.gather(d, comm, dtype=torch.bfloat16 if odd else None)
        if kind == "plan":  # both plans agreed, then one rank alone gathers the other
            return rg.gather(d_other if odd else d, comm)
        if kind == "buffers":  # one coalesced call, the same bytes, split into buffers another way
            n = plan.shard_size
            sizes = (n - 3, 3) if odd else (3, n - 3)
            outs = [torch.empty(m * k) for k in sizes]
            h = comm.all_gather_into_coalesced(outs, list(torch.split(d.data, sizes)), async_op=True)
            assert not h.is_completed()  # never done before its headers are checked
            return h.wait()
        if kind == "label":  # same plan and op, another unit (as the fsdp step would label it)
            out = torch.empty(plan.buffer_numel)
            return comm.all_gather_into(out, d.data, label=f"gather unit {'layers.4' if odd else 'layers.3'} forward")
        raise AssertionError(kind)

    def checked():  # NCCL's shape checks at the next agreement point
        out = body()
        comm.verify()
        return out

    return _outcome(checked) + (t0,)


# In NCCL's shape the same mismatches end as [Note: deferred agreement] says: equal-sized calls
# that differ in operation or label are named at the next agreement point (comm.verify()); a rank
# that skips a call or issues another collective leaves its peers waiting until the comm's timeout.
# Calls of different sizes are not here: gloo aborts the process on them (NCCL: a hang or wrong
# numbers until that check), which the Note lists as not guaranteed.
NCCL_SHAPED_MISMATCH = {"op": "PlanMismatchError", "label": "PlanMismatchError",
                        "other_collective": "CollectiveError", "skipped_call": "CollectiveError"}


@pytest.mark.parametrize("kind", list(NCCL_SHAPED_MISMATCH))
def test_mismatch_in_nccls_shape_ends_at_the_agreement_point_or_the_timeout(workers, kind):
    res = workers.run(_mismatch, kind, tuple({**TRANSPORTS["nccl-shaped"], "timeout": 2.0}.items()))
    m = len(res)
    for r, (err, msg, t, t0) in enumerate(res):
        assert err == NCCL_SHAPED_MISMATCH[kind], (r, err, msg)
        if err == "PlanMismatchError":
            assert "checked late" in msg and f"rank {r} called" in msg and f"rank {m - 1 if r < m - 1 else 0} called" in msg, msg
            assert t - t0 < PROMPT
        else:
            assert "waited 2 s for its peers" in msg or "a peer failed" in msg, msg
            assert t - t0 < 2.0 + PROMPT
    _report(f"mismatch {kind} (nccl-shaped) W={m}", [t - t0 for _, _, t, t0 in res])


@pytest.mark.parametrize("kind", ["other_collective", "skipped_call", "op", "dtype", "plan", "buffers", "label"])
def test_mismatch_raises_on_every_rank_naming_both_sides(workers, kind):
    res = workers.run(_mismatch, kind)
    m = len(res)
    for r, (err, msg, t, t0) in enumerate(res):
        assert err == "PlanMismatchError", (r, err, msg)
        assert t - t0 < PROMPT
        assert "differs between ranks" in msg and f"rank {r} called" in msg, msg
    _report(f"mismatch {kind} W={m}", [t - t0 for _, _, t, t0 in res])
    first, odd = res[0][1], res[-1][1]
    want = {
        "other_collective": ("called all_gather", "called reduce_scatter"),
        "skipped_call": ("called all_gather", "called reduce_scatter"),
        "op": ("reduce_scatter:mean", "reduce_scatter:sum"),
        "dtype": ("x float32", "x bfloat16"),
        "plan": ("on plan ",),
        "buffers": ("the split of the", "called all_gather"),
        "label": ("gather unit layers.3 forward", "gather unit layers.4 forward"),
    }[kind]
    for text in want:
        assert text in first and text in odd, (first, odd)
    assert f"rank {m - 1}" in first and "rank 0" in odd


def _skipped_checkpoint(verb, path, transport=()):
    """One rank skips ``save`` / ``load`` and goes on with a gather; the others are in the call."""
    comm, r, m, odd, params, plan, d = _setup(**dict(transport))
    state = {"params": d, "step": 7}
    if verb == "load":
        rg.checkpoint.save(path, state, comm)
    t0 = time.time()

    def body():
        if odd:
            return rg.gather(d, comm)
        if verb == "save":
            return rg.checkpoint.save(path + "-new", state, comm)
        return rg.checkpoint.load(path, state, comm)

    def checked():  # NCCL's shape checks at the next agreement point
        out = body()
        comm.verify()
        return out

    return _outcome(checked) + (t0,)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("verb", ["save", "load"])
def test_rank_that_skips_save_or_load_makes_every_rank_raise(workers, tmp_path, verb, transport):
    """gloo's default: every rank raises at once. NCCL's shape: at the comm's timeout at the latest
    (the skipper's gather and the others' first checkpoint collective wait for each other)."""
    path = str(tmp_path / f"ckpt-{len(workers.run(dist.get_world_size))}-{transport}")
    options = TRANSPORTS[transport] | ({"timeout": 2.0} if transport == "nccl-shaped" else {})
    res = workers.run(_skipped_checkpoint, verb, path, tuple(options.items()))
    for r, (err, msg, t, t0) in enumerate(res):
        if transport == "nccl-shaped":  # as a skipped call: the comm's timeout, then the poison
            assert err in ("CheckpointError", "CollectiveError") and ("waited 2 s for its peers" in msg or
                                                                      "a peer failed" in msg), (r, err, msg)
        else:
            assert err in ("PlanMismatchError", "CheckpointError", "CollectiveError"), (r, err, msg)
        assert t - t0 < PROMPT + options.get("timeout", 0.0), (r, t - t0, msg)
    assert not os.path.exists(path + "-new")
    _report(f"skipped {verb} W={len(res)} ({transport})", [t - t0 for _, _, t, t0 in res])


# ---- a lone failure before the collective ---------------------------------------------------
def _lone_failure(kind, transport=()):
    comm, r, m, odd, params, plan, d = _setup(**dict(transport))
    rg.gather(d, comm)
    t0 = time.time()

    def body():
        if kind == "bad_grads":
            grads = _params(seed=r)
            if odd:
                grads["w"] = grads["w"][:, :4]
            return rg.reduce_scatter(plan, grads, comm)
        if kind == "plan_world_size":  # one rank plans over more ranks than the comm has
            p = rg.make_plan(params, world_size=m + 1) if odd else plan
            return rg.gather(rg.shard(p, params, comm), comm)
        if kind == "gather_out":
            out = torch.empty(plan.buffer_numel - (1 if odd else 0))
            return rg.gather(d, comm, out=out)
        if kind == "step_error":  # a user error between collectives, under poison_on_error
            with rg.collectives.poison_on_error(comm):
                if odd:
                    raise RuntimeError("bad batch: NaN in the inputs")
            return rg.gather(d, comm)
        raise AssertionError(kind)

    return _outcome(body) + (t0,)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("kind", ["bad_grads", "plan_world_size", "gather_out", "step_error"])
def test_lone_failure_makes_every_peer_raise_promptly(workers, kind, transport):
    res = workers.run(_lone_failure, kind, tuple(TRANSPORTS[transport].items()))
    m = len(res)
    odd_err, odd_msg = res[-1][0], res[-1][1]
    assert odd_err in ("LayoutError", "RaggedValueError", "RuntimeError"), (odd_err, odd_msg)
    # gloo's headers carry the poison in the next call's exchange; in NCCL's shape the poison goes
    # through the store, the ledger's watcher fails the ledger and aborts the group, and the peer's
    # wait ends ([Note: deferred agreement] in ragged/collectives/_ledger.py)
    head = f"rank {m - 1} failed: {odd_err}: " if transport == "gloo-default" else f"a peer failed: rank {m - 1}: {odd_err}: "
    for r, (err, msg, t, t0) in enumerate(res[:-1]):
        assert err == "CollectiveError", (r, err, msg)
        assert msg.startswith(head), msg
        assert transport == "gloo-default" or msg.endswith("(the collective was aborted)"), msg
        assert odd_msg[:40] in msg
        assert t - t0 < PROMPT
    _report(f"lone failure {kind} ({transport}) W={m}", [t - t0 for _, _, t, t0 in res[:-1]])


def _fsdp_step_raises(phase, transport=()):
    """One rank's loss raises (a Python error in its forward or backward) in the second step."""
    from ragged.examples.data import rank_slice

    comm = _fresh_comm(**dict(transport))
    r, m = comm.rank, comm.world_size
    units, opt, state, local, task = _tiny_training(comm, layers=2)
    armed = {"on": False}

    def bad(grad):
        raise RuntimeError("bad batch in backward")

    def hook(mod, args, out):
        if not armed["on"]:
            return out
        if phase == "forward":
            raise RuntimeError("bad batch in forward")
        out.register_hook(bad)
        return out

    if r == m - 1:
        local.blocks[1].register_forward_hook(hook)
    step = _step_of(units, local, opt, comm)
    state, _ = step(state, rank_slice(task.batch(0, 8), r, m))
    armed["on"] = True
    t0 = time.time()
    return _outcome(step, state, rank_slice(task.batch(1, 8), r, m)) + (t0,)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_error_inside_fsdp_step_makes_every_peer_raise(workers, phase, transport):
    """In both transports: the failing rank still issues the schedule's collectives (on zeros), so
    the step's end-of-call agreement (an all-reduce every rank reaches) makes every peer raise
    RaggedError naming the error; with gloo's headers the poison may reach a peer first
    (CollectiveError)."""
    res = workers.run(_fsdp_step_raises, phase, tuple(TRANSPORTS[transport].items()))
    m = len(res)
    assert res[-1][0] == "RuntimeError" and f"bad batch in {phase}" in res[-1][1], res[-1]
    for r, (err, msg, t, t0) in enumerate(res[:-1]):
        # the step's own verdict round ("loss_fn failed on another rank", RaggedError) or the poison
        allowed = ("RaggedError", "CollectiveError") if transport == "gloo-default" else ("RaggedError",)
        assert err in allowed and f"bad batch in {phase}" in msg, (r, err, msg)
        assert t - t0 < PROMPT
    _report(f"error inside the fsdp step ({phase}, {transport}) W={m}", [t - t0 for _, _, t, t0 in res[:-1]])


# ---- a rank that stops calling collectives --------------------------------------------------
def _sleeper(timeout, sleep, transport=()):
    comm, r, m, _, params, plan, d = _setup(timeout=timeout, **dict(transport))
    rg.gather(d, comm)
    t0 = time.time()
    if r == m - 1:
        time.sleep(sleep)  # stops early: neither exits nor calls
        woke = time.time()
        kind, msg, t = _outcome(rg.gather, d, comm)
        return kind, msg, t, woke
    return _outcome(_loop, comm, plan, params) + (t0,)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_rank_that_sleeps_hits_ragged_timeout_not_torch(workers, transport):
    timeout = 2.0
    res = workers.run(_sleeper, timeout, 4.0, tuple(TRANSPORTS[transport].items()))
    for r, (err, msg, t, t0) in enumerate(res[:-1]):
        assert err == "CollectiveError", (r, err, msg)
        assert timeout * 0.9 < t - t0 < timeout + PROMPT / 2, (r, t - t0, msg)
    m = len(res)
    # gloo's default names the peer whose header it waited for; in NCCL's shape the host wait of a
    # native collective ends at the comm's timeout, as NCCL's watchdog would end it, and poisons the group
    want = "timed out waiting for its header from rank" if transport == "gloo-default" else "waited 2 s for its peers"
    assert any(want in res[r][1] for r in range(m - 1)), res
    err, msg, t, woke = res[-1]
    assert err == "CollectiveError" and t - woke < 1.0, (err, msg, t - woke)


# ---- scenarios that end a process: their own processes --------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_main(rank, m, port, scenario, args, queue, sys_path):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=m,
                                timeout=datetime.timedelta(seconds=60))
        out = scenario(rank, m, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = ("harness", traceback.format_exc(), time.time())
    if out is not None:
        queue.put((rank, out))
    queue.close()
    queue.join_thread()
    os._exit(0)


def _spawn(m, scenario, *args, deadline=60.0):
    """Runs ``scenario(rank, m, *args)`` on ``m`` fresh processes; ``{rank: outcome}`` of the
    ranks that reported (a rank that exited or was killed reports nothing)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_proc_main, args=(r, m, port, scenario, args, queue, list(sys.path)), daemon=True)
             for r in range(m)]
    for p in procs:
        p.start()
    got = {}
    end = time.monotonic() + deadline
    try:
        while time.monotonic() < end and len(got) < m:
            try:
                r, out = queue.get(timeout=0.5)
                got[r] = out
            except Exception:  # noqa: BLE001 - queue.Empty: check who is still alive
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    harness = {r: o for r, o in got.items() if o[0] == "harness"}
    assert not harness, harness
    return got


def _fault_time(path: str) -> float:
    return float(pathlib.Path(path).read_text())


def _die(path: str, how: str):
    pathlib.Path(path).write_text(repr(time.time()))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # "exit": the process ends normally, without telling anyone


def _collective_loop(rank, m, op, how, when, path, transport=()):
    comm = rg.collectives.from_torch(**dict(transport))
    params = _params()
    plan = rg.make_plan(params, world_size=m)
    d = rg.shard(plan, params, comm)
    grads = _params(seed=rank)

    def loop():
        for i in range(1000):
            if rank == m - 1 and i == when:
                _die(path, how)
            if op == "gather":
                rg.gather(d, comm)
            else:
                rg.reduce_scatter(plan, grads, comm)

    return _outcome(loop)


@pytest.mark.slow
@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("m", [2, 4], ids=["w2", "w4"])
@pytest.mark.parametrize("op, how", [("gather", "exit"), ("gather", "kill"), ("reduce_scatter", "kill")])
def test_rank_that_exits_or_dies_in_a_loop(tmp_path, m, op, how, transport):
    path = str(tmp_path / "fault")
    got = _spawn(m, _collective_loop, op, how, 5, path, tuple(TRANSPORTS[transport].items()))
    assert sorted(got) == list(range(m - 1)), got
    # ragged's error, never gloo's raw one (a peer lost between two calls fails the next call)
    _report(f"{op} loop, one rank {how}s, W={m} ({transport})", _check_all_raised(got, _fault_time(path), allowed=("CollectiveError",)))


class _Die(torch.autograd.Function):
    """Identity; kills the process in forward or in backward (the fault of the step tests)."""

    @staticmethod
    def forward(x, path, phase):
        if phase == "forward":
            _die(path, "kill")
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.path, ctx.phase = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        if ctx.phase == "backward":
            _die(ctx.path, "kill")
        return grad, None, None


def _fsdp_step_kill(rank, m, phase, path, transport=()):
    from ragged.examples.data import rank_slice

    comm = rg.collectives.from_torch(**dict(transport))
    units, opt, state, local, task = _tiny_training(comm, layers=3)
    armed = {"on": False}
    if rank == m - 1:  # the victim dies in its third step, inside block 1
        local.blocks[1].register_forward_hook(lambda mod, args, out: _Die.apply(out, path, phase) if armed["on"] else out)
    step = _step_of(units, local, opt, comm)

    def train():
        nonlocal state
        for s in range(6):
            armed["on"] = s == 2
            state, _ = step(state, rank_slice(task.batch(s, 8), rank, m))

    return _outcome(train)


@pytest.mark.slow
@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("m", [2, 4], ids=["w2", "w4"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_kill_during_fsdp_step(tmp_path, m, phase, transport):
    path = str(tmp_path / "fault")
    got = _spawn(m, _fsdp_step_kill, phase, path, tuple(TRANSPORTS[transport].items()))
    assert sorted(got) == list(range(m - 1)), got
    _report(f"fsdp step, one rank killed in {phase}, W={m} ({transport})",
            _check_all_raised(got, _fault_time(path), allowed=("CollectiveError",)))


# ---- handshake="deferred" (NCCL's mode), exercised on gloo with calls of equal sizes ---------
def _deferred(kind, verify_every):
    comm = _fresh_comm(handshake="deferred", verify_every=verify_every)
    r, m = comm.rank, comm.world_size
    odd = r == m - 1
    params = _params()
    plan = rg.make_plan(params, world_size=m)
    grads = _params(seed=1 + r)
    rg.reduce_scatter(plan, grads, comm, op="mean")  # agreed (first use)
    t0 = time.time()

    def body():
        if kind == "verify":  # "sum" on one rank: the same bytes move; comm.verify() names both sides
            rg.reduce_scatter(plan, grads, comm, op="sum" if odd else "mean")
            comm.verify()
        elif kind == "next_round":  # the next agreement round (the first use of another plan) finds it
            rg.reduce_scatter(plan, grads, comm, op="sum" if odd else "mean")
            rg.shard(rg.make_plan(params, world_size=m, strategy="naive"), params, comm)
        elif kind == "periodic":  # no agreement point at all: the device-side check finds it
            x = torch.ones(4)
            for i in range(10 * verify_every):
                comm.all_reduce(x, label=f"unit {'b' if odd else 'a'}")
        elif kind == "poison":
            if odd:
                comm.poison("bad batch")
                return "poisoned"
            x = torch.ones(4)
            for i in range(100):
                comm.all_reduce(x)
        return "no error"

    return _outcome(body) + (t0,)


@pytest.mark.parametrize("kind", ["verify", "next_round"])
def test_deferred_mismatch_raises_on_every_rank_naming_both_sides(workers, kind):
    for r, (err, msg, t, t0) in enumerate(workers.run(_deferred, kind, 64)):
        assert err == "PlanMismatchError", (r, err, msg)
        assert "checked late" in msg and "reduce_scatter:sum" in msg and "reduce_scatter:mean" in msg, msg
        assert t - t0 < PROMPT


def test_deferred_periodic_check_needs_no_agreement_point(workers2):
    res = workers2.run(_deferred, "periodic", 4)
    assert any(err == "PlanMismatchError" and "periodic check" in msg for err, msg, _, _ in res), res
    for err, msg, t, t0 in res:
        assert err in ("PlanMismatchError", "CollectiveError"), (err, msg)
        assert t - t0 < PROMPT


def test_deferred_poison_reaches_a_peer_blocked_in_a_native_collective(workers2):
    (err, msg, t, t0), (odd_err, *_) = workers2.run(_deferred, "poison", 64)
    assert odd_err == "ok"
    assert err == "CollectiveError" and "bad batch" in msg, (err, msg)
    assert t - t0 < PROMPT


def _deferred_coalesced_split():
    """A coalesced call whose buffers split the same elements differently on one rank (on a
    group of one rank each, so the data moves nowhere): its ledger digest differs."""
    m, r = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([j]) for j in range(m)]
    comm = rg.collectives.from_torch(groups[r], handshake="deferred")
    x = torch.arange(6.0)
    sizes = (2, 4) if r == m - 1 else (4, 2)
    outs = [torch.empty(k) for k in sizes]
    comm.all_gather_into_coalesced(outs, list(torch.split(x, sizes)))
    comm.reduce_scatter_into_coalesced(outs, list(torch.split(x, sizes)))
    return comm.ledger_digest()


def test_deferred_ledger_records_each_buffer_of_a_coalesced_call(workers):
    digests = workers.run(_deferred_coalesced_split)
    assert len(set(digests[:-1])) == 1 and digests[-1] != digests[0], digests
