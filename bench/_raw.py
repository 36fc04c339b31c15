"""``RawCollectives``: ragged's verbs over raw torch calls with no per-call agreement, the baseline
``bench/collectives.py`` times ragged's checked transport against (the table "cost of the per-call
agreement").

It is not a transport of ragged's (those are two, both checked: [Note: two transports] in
``ragged/collectives/_torch.py``): it issues the fastest raw paths measured on gloo (all-gather:
one ``batch_isend_irecv`` straight into the output; reduce-scatter: ``all_to_all_single`` into a
buffer, then the rank-order sum ragged's header path uses), so the difference to ragged's default
is what the headers cost. The plan is still agreed on first use (``plan_check="first_use"``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged.collectives._p2p import reduce_rows

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
