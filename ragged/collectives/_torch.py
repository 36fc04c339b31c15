"""The ``torch.distributed`` backend (gloo, NCCL; 1-D groups and 2-D HSDP meshes).

[Note: gloo all-gather and reduce-scatter paths]
On gloo the native ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are slow (gloo's
reduce-scatter is a clone + a full all-reduce + a copy of the own chunk) and warn in torch
2.13. Measured on this machine (``bench/collectives.py`` and torch-notes), faster paths with the
same result are:

* all-gather ("p2p"): one ``batch_isend_irecv``: the S-element input is sent to every peer and
  each peer's chunk is received directly into its slot of the output; the own chunk is one
  S-element local copy. No staging buffer. (``all_to_all_single`` would need the input
  materialised m times: it rejects a stride-0 ``expand`` view with "Tensors must be
  contiguous", so that path costs an extra m*S copy.)
* reduce-scatter ("all_to_all"): ``all_to_all_single`` of the m*S input into an m*S scratch
  buffer (chunk j goes to rank j), then one ``torch.sum`` over the m received chunks into the
  S-element output. Cost: the scratch buffer (m*S, reused across calls of equal size) and one
  local reduction kernel reading m*S elements. It also works inside a backward under
  ``torch.func.grad`` where gloo's ``reduce_scatter_single`` does not (torch-notes).

NCCL (and any other backend) uses the native ``all_gather_into_tensor`` and
``reduce_scatter_tensor``. ``algorithm=`` on :func:`from_torch` overrides the choice (the
benchmark uses it to compare paths).

[Note: coalesced collectives of several buffers]
``all_gather_into_coalesced`` / ``reduce_scatter_into_coalesced`` move several buffers (the
buffers of one multi-buffer plan, see [Note: buffers of a plan] in ragged/spec/_plan.py) in ONE
launch: on gloo ("p2p" and "all_to_all") one ``batch_isend_irecv`` over every (peer, buffer)
pair, received straight into the outputs (all-gather) or into a rank-major scratch that one
local sum per buffer reduces (reduce-scatter); on NCCL ("native") the per-buffer native ops
inside ``torch.distributed._coalescing_manager`` (one NCCL group: one launch; written, not run
here: no GPU). gloo has no coalescing group, so ``algorithm="native"`` on gloo issues one
native op per buffer.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from ragged.collectives._base import PLAN_CHECKS, check_coalesced, check_op, completed
from ragged._errors import RaggedValueError

__all__ = ["TorchCollectives", "from_torch"]

_AG_ALGOS = ("native", "p2p", "all_to_all")
_RS_ALGOS = ("native", "all_to_all", "p2p")


class _Work:
    """Waits on torch Work objects, then runs a local finaliser (e.g. the chunk sum)."""

    __slots__ = ("_works", "_finish", "_done")

    def __init__(self, works, finish=None):
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for w in self._works:
            w.wait()
        if self._finish is not None:
            self._finish()
        self._done = True

    def is_completed(self) -> bool:
        """Every op has finished (the local finaliser, if any, still runs at ``wait()``). The
        fake process group's works are done on return (its collectives move no data), though
        they never say so."""
        return self._done or all(type(w).__name__ == "FakeWork" or completed(w) for w in self._works)


def _result(work: _Work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


class _Scratch:
    """A per-(dtype, numel, device) scratch buffer reused across calls (first touch of fresh
    memory is ~5x slower than a warm copy on CPU). A buffer in use by a pending op is not
    handed out twice."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (numel, dtype, str(device))
        with self._lock:
            pool = self._free.get(key)
            if pool:
                return pool.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        key = (t.numel(), t.dtype, str(t.device))
        with self._lock:
            pool = self._free.setdefault(key, [])
            if len(pool) < 2:
                pool.append(t)


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TorchCollectives:
    """:class:`~ragged.collectives.Collectives` over ``torch.distributed`` process groups.

    Build one with :func:`from_torch`. See [Note: gloo all-gather and reduce-scatter paths].
    """

    def __init__(self, shard_group=None, replica_group=None, *, algorithm: str | None = None, plan_check: str | None = None):
        self.group = shard_group
        self.replica_group = replica_group
        self.backend = str(dist.get_backend(shard_group)).lower()
        self._rank = dist.get_rank(shard_group)
        self._world = dist.get_world_size(shard_group)
        if replica_group is not None:
            self._replica_rank = dist.get_rank(replica_group)
            self._replicas = dist.get_world_size(replica_group)
        else:
            self._replica_rank, self._replicas = 0, 1
        gloo = "gloo" in self.backend
        ag, rs = ("p2p", "all_to_all") if gloo else ("native", "native")
        if algorithm is not None:
            if algorithm not in _AG_ALGOS or algorithm not in _RS_ALGOS:
                raise RaggedValueError(f"algorithm must be one of {sorted(set(_AG_ALGOS) & set(_RS_ALGOS))}, got {algorithm!r}.")
            ag = rs = algorithm
        self.ag_algorithm, self.rs_algorithm = ag, rs
        # NCCL, and torch's fake process group on a machine with a GPU (one process measuring one rank's
        # memory at any world size: its collectives move no data, its allocations are the device's)
        on_gpu = "nccl" in self.backend or (self.backend == "fake" and torch.cuda.is_available())
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self._scratch = _Scratch()
        if plan_check is None:  # like torch's own per-call collective checks: a debug mode
            plan_check = "every_call" if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" else "first_use"
        if plan_check not in PLAN_CHECKS:
            raise RaggedValueError(f"plan_check must be one of {PLAN_CHECKS}, got {plan_check!r}.")
        self.plan_check = plan_check
        self.checked_plans: dict = {}  # see [Note: plan check before collectives] (ragged/transforms/_check.py)

    def __repr__(self) -> str:
        return (
            f"TorchCollectives(rank={self._rank}, world_size={self._world}, replicas={self._replicas}, "
            f"backend={self.backend!r}, all_gather={self.ag_algorithm!r}, reduce_scatter={self.rs_algorithm!r}, "
            f"plan_check={self.plan_check!r})"
        )

    # ---- identity -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def num_replicas(self) -> int:
        return self._replicas

    @property
    def replica_rank(self) -> int:
        return self._replica_rank

    @property
    def device(self) -> torch.device:
        return self._device

    def _peer(self, j: int) -> int:
        return j if self.group is None else dist.get_global_rank(self.group, j)

    # ---- collectives ----------------------------------------------------------------------
    def all_gather_into(self, output, input, *, async_op=False):
        m, n = self._world, input.numel()
        if output.numel() != m * n:
            raise RaggedValueError(f"all_gather_into: output has {output.numel()} elements, needs world_size * {n} = {m * n}.")
        if m == 1:
            output.copy_(input)
            return _result(_Work([]), async_op)
        algo = self.ag_algorithm
        if algo == "native":
            w = dist.all_gather_into_tensor(output, input, group=self.group, async_op=True)
            return _result(_Work([w]), async_op)
        if algo == "all_to_all":
            staged = self._scratch.take(m * n, input.dtype, input.device)
            staged.view(m, n).copy_(input.reshape(1, n).expand(m, n))
            w = dist.all_to_all_single(output, staged, group=self.group, async_op=True)
            return _result(_Work([w], lambda: self._scratch.give(staged)), async_op)
        # p2p
        ops = []
        for j in range(m):
            if j == self._rank:
                continue
            peer = self._peer(j)
            ops.append(dist.P2POp(dist.isend, input, peer, self.group))
            ops.append(dist.P2POp(dist.irecv, output[j * n : (j + 1) * n], peer, self.group))
        works = dist.batch_isend_irecv(ops)
        output[self._rank * n : (self._rank + 1) * n].copy_(input)
        return _result(_Work(works), async_op)

    def reduce_scatter_into(self, output, input, *, op="sum", async_op=False):
        check_op(op)
        m, n = self._world, output.numel()
        if input.numel() != m * n:
            raise RaggedValueError(f"reduce_scatter_into: input has {input.numel()} elements, needs world_size * {n} = {m * n}.")
        if m == 1:
            output.copy_(input)
            return _result(_Work([]), async_op)
        algo = self.rs_algorithm
        if algo == "native":
            torch_op = dist.ReduceOp.AVG if (op == "mean" and "nccl" in self.backend) else _TORCH_OPS.get(op, dist.ReduceOp.SUM)
            w = dist.reduce_scatter_tensor(output, input, op=torch_op, group=self.group, async_op=True)
            finish = (lambda: output.div_(m)) if (op == "mean" and torch_op != dist.ReduceOp.AVG) else None
            return _result(_Work([w], finish), async_op)
        recv = self._scratch.take(m * n, input.dtype, input.device)
        chunks = recv.view(m, n)
        if algo == "all_to_all":
            works = [dist.all_to_all_single(recv, input, group=self.group, async_op=True)]
        else:  # p2p
            ops = []
            for j in range(m):
                if j == self._rank:
                    continue
                peer = self._peer(j)
                ops.append(dist.P2POp(dist.isend, input[j * n : (j + 1) * n], peer, self.group))
                ops.append(dist.P2POp(dist.irecv, chunks[j], peer, self.group))
            works = dist.batch_isend_irecv(ops)
            chunks[self._rank].copy_(input[self._rank * n : (self._rank + 1) * n])

        def finish():
            if op == "max":
                torch.amax(chunks, dim=0, out=output)
            else:
                # on CPU a chain of adds is ~2x faster than sum(dim=0) for 2 chunks and ~1.15x for 3, but
                # sum reads each chunk once and wins from 4 chunks on (1.3x at 4, 1.8x at 8; one thread)
                if m <= 3:
                    torch.add(chunks[0], chunks[1], out=output)
                    for j in range(2, m):
                        output.add_(chunks[j])
                else:
                    torch.sum(chunks, 0, out=output)
                if op == "mean":
                    output.div_(m)
            self._scratch.give(recv)

        return _result(_Work(works, finish), async_op)

    # ---- several buffers in one launch (see [Note: coalesced collectives of several buffers]) ----
    def all_gather_into_coalesced(self, outputs, inputs, *, async_op=False):
        m = self._world
        check_coalesced(outputs, inputs, m, "all_gather_into_coalesced", gather=True)
        if m == 1:
            for out, inp in zip(outputs, inputs):
                out.copy_(inp)
            return _result(_Work([]), async_op)
        if self.ag_algorithm == "native":
            if "nccl" not in self.backend:  # gloo has no coalescing group: one native op per buffer
                return _result(_Work([self.all_gather_into(o, i, async_op=True) for o, i in zip(outputs, inputs)]),
                               async_op)
            with dist._coalescing_manager(group=self.group, device=self._device, async_ops=True) as cm:
                for out, inp in zip(outputs, inputs):
                    dist.all_gather_single(out, inp, group=self.group)
            return _result(_Work([cm]), async_op)
        ops = []
        for j in range(m):
            if j == self._rank:
                continue
            peer = self._peer(j)
            for out, inp in zip(outputs, inputs):
                n = inp.numel()
                ops.append(dist.P2POp(dist.isend, inp, peer, self.group))
                ops.append(dist.P2POp(dist.irecv, out[j * n : (j + 1) * n], peer, self.group))
        works = dist.batch_isend_irecv(ops)
        for out, inp in zip(outputs, inputs):
            n = inp.numel()
            out[self._rank * n : (self._rank + 1) * n].copy_(inp)
        return _result(_Work(works), async_op)

    def reduce_scatter_into_coalesced(self, outputs, inputs, *, op="sum", async_op=False):
        check_op(op)
        m = self._world
        check_coalesced(outputs, inputs, m, "reduce_scatter_into_coalesced", gather=False)
        if m == 1:
            for out, inp in zip(outputs, inputs):
                out.copy_(inp)
            return _result(_Work([]), async_op)
        if self.rs_algorithm == "native":
            if "nccl" not in self.backend:  # gloo has no coalescing group: one native op per buffer
                works = [self.reduce_scatter_into(o, i, op=op, async_op=True) for o, i in zip(outputs, inputs)]
                return _result(_Work(works), async_op)
            avg = op == "mean" and "nccl" in self.backend
            torch_op = dist.ReduceOp.AVG if avg else _TORCH_OPS.get(op, dist.ReduceOp.SUM)
            with dist._coalescing_manager(group=self.group, device=self._device, async_ops=True) as cm:
                for out, inp in zip(outputs, inputs):
                    dist.reduce_scatter_single(out, inp, op=torch_op, group=self.group)

            def finish_native():
                if op == "mean" and not avg:
                    for out in outputs:
                        out.div_(m)

            return _result(_Work([cm], finish_native), async_op)
        sizes = [out.numel() for out in outputs]
        total = sum(sizes)
        recv = self._scratch.take(m * total, inputs[0].dtype, inputs[0].device)
        chunks = recv.view(m, total)
        bases = [sum(sizes[:b]) for b in range(len(sizes))]
        ops = []
        for j in range(m):
            if j == self._rank:
                continue
            peer = self._peer(j)
            for inp, base, n in zip(inputs, bases, sizes):
                ops.append(dist.P2POp(dist.isend, inp[j * n : (j + 1) * n], peer, self.group))
                ops.append(dist.P2POp(dist.irecv, chunks[j, base : base + n], peer, self.group))
        works = dist.batch_isend_irecv(ops)
        for inp, base, n in zip(inputs, bases, sizes):
            chunks[self._rank, base : base + n].copy_(inp[self._rank * n : (self._rank + 1) * n])

        def finish():
            for out, base, n in zip(outputs, bases, sizes):
                part = chunks[:, base : base + n]
                if op == "max":
                    torch.amax(part, dim=0, out=out)
                elif m <= 3:  # see reduce_scatter_into
                    torch.add(part[0], part[1], out=out)
                    for j in range(2, m):
                        out.add_(part[j])
                else:
                    torch.sum(part, 0, out=out)
                if op == "mean":
                    out.div_(m)
            self._scratch.give(recv)

        return _result(_Work(works, finish), async_op)

    def _all_reduce(self, tensor, op, async_op, group, size):
        check_op(op)
        if size == 1:
            return _result(_Work([]), async_op)
        w = dist.all_reduce(tensor, op=_TORCH_OPS.get(op, dist.ReduceOp.SUM), group=group, async_op=True)
        finish = (lambda: tensor.div_(size)) if op == "mean" else None
        return _result(_Work([w], finish), async_op)

    def all_reduce(self, tensor, *, op="sum", async_op=False):
        return self._all_reduce(tensor, op, async_op, self.group, self._world)

    def all_reduce_replicas(self, tensor, *, op="sum", async_op=False):
        return self._all_reduce(tensor, op, async_op, self.replica_group, self._replicas)

    def all_to_all(self, output, input, output_splits, input_splits, *, async_op=False):
        if self._world == 1:
            output.copy_(input)
            return _result(_Work([]), async_op)
        w = dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=self.group, async_op=True
        )
        return _result(_Work([w]), async_op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        shard = [None] * self._world
        dist.all_gather_object(shard, obj, group=self.group)
        if self._replicas == 1:
            return shard
        everything = [None] * self._replicas
        dist.all_gather_object(everything, shard, group=self.replica_group)
        return [o for row in everything for o in row]

    def barrier(self) -> None:
        dist.barrier(group=self.group)
        if self._replicas > 1:
            dist.barrier(group=self.replica_group)


def from_torch(group=None, *, algorithm: str | None = None, plan_check: str | None = None) -> TorchCollectives:
    """Collectives over ``torch.distributed``.

    Args:
        group: ``None`` (the default process group), a ``ProcessGroup`` (the shard group), or
            a ``DeviceMesh``: 1-D (shard group) or 2-D ``(replicate, shard)`` for HSDP.
        algorithm: force one path for all-gather and reduce-scatter (``"native"``, ``"p2p"``,
            ``"all_to_all"``); default: the fastest measured path for the backend (see
            [Note: gloo all-gather and reduce-scatter paths]).
        plan_check: when the transforms make the ranks agree on their plans:
            ``"first_use"`` (default: once per plan and comm) or ``"every_call"`` (one small
            all-reduce per transform call; the default when ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
            as torch's own per-call collective checks); see [Note: plan check before
            collectives] in ``ragged/transforms/_check.py``.

    Returns:
        A :class:`TorchCollectives`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a mesh with more than 2 dimensions.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "rg.collectives.from_torch() needs an initialised torch.distributed process group. Fix: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets the env), or "
            "use rg.collectives.simulate(world_size, fn) for an in-process simulation."
        )
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        if group.ndim == 1:
            return TorchCollectives(group.get_group(0), algorithm=algorithm, plan_check=plan_check)
        if group.ndim == 2:
            return TorchCollectives(group.get_group(1), group.get_group(0), algorithm=algorithm, plan_check=plan_check)
        raise RaggedValueError(
            f"from_torch takes a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got a mesh with "
            f"{group.ndim} dims {tuple(group.shape)}. Fix: slice the mesh, e.g. mesh['dp_replicate', 'dp_shard']."
        )
    return TorchCollectives(group, algorithm=algorithm, plan_check=plan_check)
