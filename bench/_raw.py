"""``RawCollectives``: ragged's verbs over raw torch calls with no per-call agreement, the baseline
``bench/collectives.py`` times ragged's checked transport against (the table "cost of the per-call
agreement").

It is not a transport of ragged's (those are two, both checked: [Note: two transports] in
``ragged/collectives/_torch.py``): it issues the fastest raw paths measured on gloo (all-gather:
one ``batch_isend_irecv`` straight into the output; reduce-scatter: at 2 ranks the peer's chunk
received straight into the output and one add, else ``all_to_all_single`` into a buffer, then the
rank-order sum ragged's header path uses), so the difference to ragged's default
is what the headers cost. The plan is still agreed on first use (``plan_check="first_use"``).

``NativeAsP2P``: NCCL's shape (``handshake="deferred"``: the deferred ledger, its watched host waits,
the step's code as a GPU runs it) with gloo's native ``all_gather_single`` / ``reduce_scatter_single``
replaced by the header transport's algorithm (the all-gather received in place, the reduce-scatter's
peer chunk received into the output and summed with the own chunk where it is). ``bench/step.py
--nccl-shaped`` times it beside both transports: what NCCL's shape costs over gloo's default is then
split into what ragged's deferred path costs (this one / the default) and what gloo's native
collectives cost (NCCL's shape / this one), work a GPU runs in NCCL's kernels instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged.collectives._p2p import reduce_rows
from ragged.collectives._torch import TorchCollectives

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _Done:
    def __init__(self, works, finish):
        self.works, self.finish = works, finish

    def wait(self):
        for w in self.works:
            w.wait()
        if self.finish is not None:
            self.finish()


class RawCollectives:
    """One rank of the default gloo group, unchecked (see the module docstring)."""

    plan_check = "first_use"

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.num_replicas, self.replica_rank, self.device = 1, 0, torch.device("cpu")
        self.checked_plans: dict = {}
        self._recv: dict = {}  # reused receive buffers (a fresh one pays a first touch per page)

    @staticmethod
    def _issue(works, finish, async_op):
        done = _Done(works, finish)
        if async_op:
            return done
        done.wait()
        return None

    def all_gather_into(self, output, input, *, async_op=False, label=None):
        m, r, n = self.world_size, self.rank, input.numel()
        ops = [op for j in range(m) if j != r
               for op in (dist.P2POp(dist.isend, input, j), dist.P2POp(dist.irecv, output[j * n:(j + 1) * n], j))]
        works = dist.batch_isend_irecv(ops) if ops else []
        output[r * n:(r + 1) * n].copy_(input)
        return self._issue(works, None, async_op)

    def reduce_scatter_into(self, output, input, *, op="sum", async_op=False, label=None):
        m, n = self.world_size, output.numel()
        if m == 2 and op == "sum":  # one chunk each way, the peer's straight into the output, then one add
            done = _p2p_reduce_scatter(output, input)
            return self._issue(done.works, done.finish, async_op)
        recv = self._recv.get((m * n, input.dtype))
        if recv is None:
            recv = self._recv[(m * n, input.dtype)] = torch.empty(m * n, dtype=input.dtype)
        work = dist.all_to_all_single(recv, input, async_op=True)
        return self._issue([work], lambda: reduce_rows(recv.view(m, n), op, output), async_op)

    def all_reduce(self, tensor, *, op="sum", async_op=False, label=None):
        work = dist.all_reduce(tensor, op=_OPS[op], async_op=True)
        return self._issue([work], None, async_op)

    def all_reduce_replicas(self, tensor, *, op="sum", async_op=False, label=None):
        return self._issue([], None, async_op)


class _P2PWork:
    """gloo's send / receive works and a local finish, waited as one native work (no future: the
    deferred transport waits it on a thread, as gloo's native reduce-scatter)."""

    def __init__(self, works, finish=None):
        self.works, self.finish = works, finish

    def wait(self, timeout=None):
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def get_future(self):
        raise RuntimeError("point-to-point works have no future")


def _peer(group, j):
    return j if group is None else dist.get_global_rank(group, j)


def _p2p_all_gather(output, input, group=None, async_op=True):
    m, r, n = dist.get_world_size(group), dist.get_rank(group), input.numel()
    ops = [op for j in range(m) if j != r for op in (dist.P2POp(dist.isend, input, _peer(group, j), group),
                                                     dist.P2POp(dist.irecv, output[j * n:(j + 1) * n], _peer(group, j), group))]
    works = dist.batch_isend_irecv(ops) if ops else []
    output[r * n:(r + 1) * n].copy_(input)
    return _P2PWork(works)


def _p2p_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=True):
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"NativeAsP2P reduce-scatters with SUM only (what NCCL's shape issues on gloo), got {op}")
    m, r, n = dist.get_world_size(group), dist.get_rank(group), output.numel()
    if m != 2:  # every chunk into an (m, n) buffer, summed in rank order
        rows = torch.empty(m, n, dtype=input.dtype)
        return _P2PWork([dist.all_to_all_single(rows.view(-1), input, group=group, async_op=True)],
                        lambda: reduce_rows(rows, "sum", output))
    j, own = 1 - r, input[r * n:(r + 1) * n]  # the peer's chunk straight into the output, then one add
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, input[j * n:(j + 1) * n], _peer(group, j), group),
                                    dist.P2POp(dist.irecv, output, _peer(group, j), group)])
    return _P2PWork(works, lambda: reduce_rows([own, output] if r == 0 else [output, own], "sum", output))


class NativeAsP2P(TorchCollectives):
    """NCCL's shape with gloo's native all-gather and reduce-scatter replaced (see the module docstring)."""

    _REPLACED = {"all_gather": _p2p_all_gather, "reduce_scatter": _p2p_reduce_scatter}

    def __init__(self):
        super().__init__(handshake="deferred")

    def _native(self, fn, kind, *args, **kw):
        return super()._native(self._REPLACED.get(kind, fn), kind, *args, **kw)


class ReplayMethod:
    """The collectives of one ragged step, raw, beside the unsharded step: a method of ``bench/step.py``
    (``--floor``). Every all-gather, reduce-scatter and all-reduce the watched comm issued in
    ragged's latest step, in that order and with those sizes, goes through :class:`RawCollectives`
    (the fastest raw paths, no check, buffers allocated once), each waited before the next, on a
    thread of its own while ``beside.step(batch)`` (an unsharded step, ``LocalMethod``) computes on
    this one. It is a floor under ragged on a machine whose cores all compute: the unsharded step
    plus only the host work of moving the step's bytes, with no copy, page fault, schedule or
    Python of ragged's (though it runs the whole optimizer, which ragged shards)."""

    name = "local+collectives"
    _WATCHED = ("all_gather_into", "all_gather_into_coalesced", "reduce_scatter_into", "reduce_scatter_into_coalesced",
                "all_reduce")

    def __init__(self, comm, recording: str, counter, beside):
        self.counter, self.recording, self.beside = counter, recording, beside  # record while counter.active == recording
        self.calls, self._next, self._buffers = [], [], {}
        self.raw, self.metrics = RawCollectives(), {}
        for name in self._WATCHED:
            orig = getattr(comm, name)

            def watched(*a, _orig=orig, _name=name, **k):
                if self.counter.active == self.recording:
                    many = _name.endswith("_coalesced")
                    ts = [list(a[0]), list(a[1])] if many else [[x] for x in a[:2 if _name != "all_reduce" else 1]]
                    self._next.append((_name.replace("_coalesced", "").replace("_into", ""),
                                       [[(t.numel(), t.dtype) for t in g] for g in ts], k.get("op", "sum")))
                return _orig(*a, **k)

            setattr(comm, name, watched)

    def recorded(self):
        """Ragged's step just ended: its calls are the ones to replay."""
        self.calls, self._next = self._next, []

    def _tensors(self, role: int, sizes: tuple):
        out = self._buffers.get((role, sizes))
        if out is None:
            out = self._buffers[(role, sizes)] = [torch.zeros(n, dtype=dt) for n, dt in sizes]
        return out

    def replay(self):
        """The recorded calls, counted as ragged's are (``bench/_counts.py``: an all-gather's output
        bytes, a reduce-scatter's input bytes) under the counter's active method."""
        for name, groups, op in self.calls:
            ts = [self._tensors(role, tuple(g)) for role, g in enumerate(groups)]  # outputs, inputs
            counted = ts[1] if name == "reduce_scatter" else ts[0]
            self.counter.add(name, "shard", sum(t.numel() * t.element_size() for t in counted), len(counted))
            if name == "all_reduce":
                self.raw.all_reduce(ts[0][0], op=op)
            else:
                for out, inp in zip(*ts):
                    getattr(self.raw, f"{name}_into")(out, inp)

    def step(self, batch):
        import threading

        errors = []

        def run():
            try:
                self.replay()
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                errors.append(e)

        thread = threading.Thread(target=run, name="replay")
        thread.start()
        try:
            loss = self.beside.step(batch)
        finally:
            thread.join()
        if errors:
            raise errors[0]
        return loss

    def state_tensors(self):
        return self.beside.state_tensors()

    def optimizer_state_bytes(self):
        return self.beside.optimizer_state_bytes()
