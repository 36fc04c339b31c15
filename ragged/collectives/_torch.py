"""The ``torch.distributed`` backend (gloo, NCCL; 1-D groups and 2-D HSDP meshes).

[Note: two transports]
Every call carries what [Note: what a collective call carries] (``_base.py``) says. A comm runs
one of two transports, ``handshake`` of :func:`from_torch`, which decides both how the bytes
move and when the call is checked:

* **gloo's default**, ``"header"`` (gloo only): every call is a checked point-to-point exchange
  (see [Note: the data paths of the header protocol] in ``_p2p.py``): its messages are tagged
  with their sizes and preceded by a header, checked before the result is used (see [Note:
  size-tagged messages and headers] in ``_channel.py``): a mismatch raises
  :class:`~ragged.PlanMismatchError` on every rank at that call (no size can abort gloo), a
  failed, dead or absent rank makes every rank raise :class:`~ragged.CollectiveError` within
  milliseconds (or the timeout), never gloo's 30 minutes.
* **NCCL's shape**, ``"deferred"`` (default on NCCL and every other backend; on gloo it runs
  the code a GPU runs, minus the CUDA calls, which is why every exactness test runs in it too):
  the native collectives (``all_gather_single`` / ``reduce_scatter_single``, called through
  ``ragged/_compat.py``; ``ReduceOp.AVG`` for a mean on NCCL). The buffers of a coalesced call
  (a multi-buffer plan) go into one ``_coalescing_manager`` group on NCCL (one launch); gloo has
  no coalescing group, so there it is one native op per buffer, and torch's fake process group
  moves no data at all. Each call is recorded on the host and verified later without a
  device-to-host sync on the hot path (see [Note: deferred agreement] in ``_ledger.py``). NCCL
  cannot check sizes before a collective runs: a mismatch of sizes can hang until NCCL's own
  watchdog, and a mismatch of sizes or of the plan can compute wrong numbers until it is
  detected: at the next agreement point (``check_plans`` rounds, which ``rg.fsdp``'s step makes
  once per step, or ``comm.verify()``), or by the periodic device-side check, ``verify_every``
  calls later. ``comm.poison`` goes through the c10d store and a watcher aborts the peers' groups.

A coalesced call is one call under either transport: one header per peer describing every
buffer, or one ledger entry. There is no unchecked transport: the baseline that
``bench/collectives.py`` times ragged against is raw torch calls of its own (``bench/_raw.py``).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from ragged import _compat
from ragged._errors import RaggedValueError
from ragged.collectives import _p2p
from ragged.collectives._base import (DEFAULT_TIMEOUT, HANDSHAKES, BufferOps, PLAN_CHECKS, check_coalesced, check_op, poison_on_error, scoped_label)
from ragged.collectives._channel import channel_for
from ragged.collectives._handles import _Guarded, _Work
from ragged.collectives._header import identity_of
from ragged.collectives._ledger import Ledger

__all__ = ["TorchCollectives", "from_torch"]

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _pg(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


class TorchCollectives(BufferOps):
    """:class:`~ragged.collectives.Collectives` over ``torch.distributed`` process groups.

    Build one with :func:`from_torch`. See [Note: two transports].
    """

    def __init__(self, shard_group=None, replica_group=None, *, plan_check: str | None = None,
                 handshake: str | None = None, timeout: float | None = None, verify_every: int = 64):
        self.group = shard_group
        self.replica_group = replica_group
        self.backend = str(dist.get_backend(shard_group)).lower()
        self._rank = dist.get_rank(shard_group)
        self._world = dist.get_world_size(shard_group)
        gloo = "gloo" in self.backend
        if handshake is None:
            handshake = "header" if gloo else "deferred"
        if handshake not in HANDSHAKES:
            raise RaggedValueError(f"handshake must be one of {HANDSHAKES}, got {handshake!r}.")
        if handshake == "header" and not gloo:
            raise RaggedValueError(f"handshake='header' needs gloo (tagged send/recv); the backend is {self.backend!r}. "
                                   "Use handshake='deferred'.")
        self.handshake = handshake
        # NCCL, and torch's fake process group on a machine with a GPU (one process measuring one rank's
        # memory at any world size: its collectives move no data, its allocations are the device's)
        on_gpu = "nccl" in self.backend or (self.backend == "fake" and torch.cuda.is_available())
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        if not timeout > 0:
            raise RaggedValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        self.timeout = float(timeout)
        if plan_check is None:  # like torch's own per-call collective checks: a debug mode
            plan_check = "every_call" if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" else "first_use"
        if plan_check not in PLAN_CHECKS:
            raise RaggedValueError(f"plan_check must be one of {PLAN_CHECKS}, got {plan_check!r}.")
        self.plan_check = plan_check
        self.checked_plans: dict = {}  # see [Note: plan check before collectives] (ragged/transforms/_check.py)
        self.scope = None  # a CallScope: see [Note: what a collective call carries] (_base.py)
        self._channels = self._ledger = None
        if handshake == "header":
            self._channels = (channel_for(_pg(shard_group)),
                              channel_for(replica_group) if replica_group is not None else None)
        else:
            self._ledger = Ledger(_pg(shard_group), replica_group, self._device, every=verify_every,
                                  timeout=self.timeout)

    def __repr__(self) -> str:
        return (
            f"TorchCollectives(rank={self._rank}, world_size={self._world}, replicas={self.num_replicas}, "
            f"backend={self.backend!r}, handshake={self.handshake!r}, plan_check={self.plan_check!r}, "
            f"timeout={self.timeout})"
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
        return 1 if self.replica_group is None else dist.get_world_size(self.replica_group)

    @property
    def replica_rank(self) -> int:
        return 0 if self.replica_group is None else dist.get_rank(self.replica_group)

    @property
    def device(self) -> torch.device:
        return self._device

    def _peer(self, j: int) -> int:
        return j if self.group is None else dist.get_global_rank(self.group, j)

    def _call_args(self, label):
        scope = self.scope
        return identity_of(scope.identity if scope is not None else 0, label), scoped_label(scope, label)

    # ---- failure --------------------------------------------------------------------------
    def poison(self, reason: str) -> None:
        """See :meth:`ragged.collectives.Collectives.poison` and [Note: poison] in ``_channel.py``."""
        if self._channels is not None:
            for ch in self._channels:
                if ch is not None:
                    ch.fail(reason)
        else:
            self._ledger.poison(f"rank {self._rank}: {reason}")

    def verify(self) -> None:
        """Checks now that every call since the last check agreed (``"deferred"``; one small
        all-reduce and a host sync); a no-op under ``"header"`` (every call was checked). Raises :class:`~ragged.PlanMismatchError` on every rank, naming both sides."""
        if self._ledger is not None:
            with poison_on_error(self):
                self._ledger.verify()

    def ledger_digest(self) -> int | None:
        """The running hash of the unverified calls, both groups' in issue order (``"deferred"``),
        which ``check_plans`` folds into its agreement round over the mesh; ``None`` otherwise.
        After the round: :meth:`confirm_ledger` if every rank had the same, else
        :meth:`explain_ledger` (every rank takes the same branch)."""
        if self._ledger is None:
            return None
        self._ledger.check_alive()
        return self._ledger.digest

    def confirm_ledger(self) -> None:
        self._ledger.confirm()

    def explain_ledger(self) -> None:
        with poison_on_error(self):
            self._ledger.explain()

    # ---- collectives ----------------------------------------------------------------------
    def _all_gather(self, outs, ins, async_op, label, where):
        with poison_on_error(self):
            check_coalesced(outs, ins, self._world, where, gather=True)
            if self._channels is not None:
                return self._handle(_p2p.all_gather(self._channels[0], outs, ins, self._call_args(label), self.timeout),
                                    async_op)
            return self._native(_compat.all_gather_single, "all_gather", None, outs, ins, ins, async_op, label)

    def _reduce_scatter(self, outs, ins, op, async_op, label, where):
        with poison_on_error(self):
            check_op(op)
            check_coalesced(outs, ins, self._world, where, gather=False)
            if self._channels is not None:
                return self._handle(
                    _p2p.reduce_scatter(self._channels[0], outs, ins, op, self._call_args(label), self.timeout), async_op)
            torch_op, divide = self._torch_op(op)
            finish = (lambda: [o.div_(self._world) for o in outs]) if divide else None
            return self._native(_compat.reduce_scatter_single, "reduce_scatter", op, outs, ins, outs, async_op, label,
                                finish, op=torch_op)

    def _native(self, fn, kind, reduce, outs, ins, recorded, async_op, label, finish=None, **kw):
        """One native collective ``fn`` per buffer, recorded once: coalesced into one launch on
        NCCL when there are several (the coalescing manager records ``fn``, the function this
        torch expects); one op per buffer elsewhere (see [Note: two transports]). A single rank
        issues it too: on a one-GPU machine that is what runs NCCL's kernels, streams and waits."""
        self._record(0, kind, reduce, recorded, label)
        if len(outs) == 1 or "nccl" not in self.backend:
            works = [fn(o, i, group=self.group, async_op=True, **kw) for o, i in zip(outs, ins)]
        else:
            with dist._coalescing_manager(group=self.group, device=self._device, async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    fn(o, i, group=self.group, **kw)
            works = [cm]
        return self._works(works, finish, async_op)

    def _torch_op(self, op):
        """torch's reduction for ``op``, and whether the result still needs dividing by the group
        size (a mean off NCCL, which has no ``AVG``)."""
        if op == "mean":
            return (dist.ReduceOp.AVG, False) if "nccl" in self.backend else (dist.ReduceOp.SUM, True)
        return _TORCH_OPS[op], False

    def _all_reduce(self, tensor, op, async_op, index, size, label):
        check_op(op)
        if self._channels is not None:
            ch = self._channels[index]
            if ch is None:
                return self._result(_Work([]), async_op)
            return self._handle(_p2p.all_reduce(ch, tensor, op, self._call_args(label), self.timeout), async_op)
        if index == 1 and self.replica_group is None:
            return self._result(_Work([]), async_op)
        self._record(index, "all_reduce", op, [tensor], label)
        group = self.group if index == 0 else self.replica_group
        torch_op, divide = self._torch_op(op)
        w = dist.all_reduce(tensor, op=torch_op, group=group, async_op=True)
        return self._works([w], (lambda: tensor.div_(size)) if divide else None, async_op)

    def all_reduce(self, tensor, *, op="sum", async_op=False, label=None):
        with poison_on_error(self):
            return self._all_reduce(tensor, op, async_op, 0, self._world, label)

    def all_reduce_replicas(self, tensor, *, op="sum", async_op=False, label=None):
        with poison_on_error(self):
            return self._all_reduce(tensor, op, async_op, 1, self.num_replicas, label)

    def all_to_all(self, output, input, output_splits, input_splits, *, async_op=False, label=None):
        with poison_on_error(self):
            if self._channels is not None:
                return self._handle(_p2p.all_to_all(self._channels[0], output, input, list(output_splits),
                                                    list(input_splits), self._call_args(label), self.timeout), async_op)
            self._record(0, "all_to_all", None, [input], label, numel=-1)
            w = dist.all_to_all_single(output, input, list(output_splits), list(input_splits), group=self.group,
                                       async_op=True)
            return self._works([w], None, async_op)

    def all_gather_object(self, obj: Any, *, label=None) -> list[Any]:
        with poison_on_error(self):
            if self._channels is not None:
                args = self._call_args(label)
                shard = _p2p.all_gather_object(self._channels[0], obj, args, self.timeout)
                if self.num_replicas == 1:
                    return shard
                rows = _p2p.all_gather_object(self._channels[1], shard, args, self.timeout)
                return [o for row in rows for o in row]
            self.verify()  # objects are compared on the host: check what came before first
            shard = self._objects(obj, self.group, self._world)
            if self.num_replicas == 1:
                return shard
            return [o for row in self._objects(shard, self.replica_group, self.num_replicas) for o in row]

    def _objects(self, obj, group, size):
        """Every rank's ``obj`` over ``group``: two native all-gathers (the pickled sizes, then the
        bytes padded to the largest), waited like every other call of NCCL's shape (a dead or
        absent peer fails it at the comm's timeout or its poison, not at gloo's ring timeout);
        not recorded: ``verify()`` just agreed what came before, and these calls are the same on
        every rank that reaches them."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.empty(size, dtype=torch.int64, device=self._device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=self._device)
        self._works([_compat.all_gather_single(sizes, mine, group=group, async_op=True)], None, False)
        counts = sizes.tolist()
        padded = torch.zeros(max(counts), dtype=torch.uint8)
        padded[: data.numel()] = data
        out = torch.empty(size * padded.numel(), dtype=torch.uint8, device=self._device)
        self._works([_compat.all_gather_single(out, padded.to(self._device), group=group, async_op=True)], None, False)
        raw = out.cpu().numpy().tobytes()
        return [pickle.loads(raw[r * padded.numel(): r * padded.numel() + n]) for r, n in enumerate(counts)]

    def barrier(self, *, label=None) -> None:
        with poison_on_error(self):
            if self._channels is not None:
                args = self._call_args(label)
                for ch in self._channels:
                    if ch is not None:
                        _p2p.barrier(ch, args, self.timeout)
                return
            # an all-reduce of a tensor of our own, not dist.barrier: torch 2.11 keeps a group's last
            # barrier tensor alive for good (one byte that no state of ragged's accounts for)
            for index in range(2):
                self._all_reduce(torch.zeros(1, device=self._device), "sum", False, index, 0, label or "barrier")

    # ---- helpers ----------------------------------------------------------------------------
    def _works(self, works, finish, async_op):
        """The works of one call as a handle (or waited, for a blocking call): see [Note: NCCL's
        rules on gloo] in ``_gloo_device.py`` for what waiting and asking them means."""
        return self._result(_Work([self._ledger.issued(w) for w in works], finish, self._ledger), async_op)

    def _result(self, work, async_op):
        if async_op:
            return _Guarded(work, self)
        work.wait()
        return None

    def _handle(self, pending, async_op):
        if pending is None:  # completed inside the call (the large all-reduce)
            return _Work([]) if async_op else None
        if async_op:
            return _Guarded(pending, self)
        pending.wait()
        return None

    def _record(self, index, op, reduce, tensors, label, *, numel=None):
        identity, text = self._call_args(label)
        if numel is None:  # a coalesced call records each buffer's size: one split must not pass for another
            numel = "+".join(str(t.numel()) for t in tensors) if len(tensors) > 1 else tensors[0].numel()
        self._ledger.record(index, op, reduce, tensors[0].dtype, numel, identity, text)


def from_torch(group=None, *, plan_check: str | None = None, handshake: str | None = None,
               timeout: float | None = None, verify_every: int = 64) -> TorchCollectives:
    """Collectives over ``torch.distributed``.

    Args:
        group: ``None`` (the default process group), a ``ProcessGroup`` (the shard group), or
            a ``DeviceMesh``: 1-D (shard group) or 2-D ``(replicate, shard)`` for HSDP.
        plan_check: when the transforms run an explicit agreement round on their plans (whose
            mismatch message lists the differing leaves): ``"first_use"`` (default: once per
            plan and comm) or ``"every_call"`` (the default when ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
            as torch's own per-call checks); see [Note: plan check before collectives] in
            ``ragged/transforms/_check.py``. Independent of it, every call carries its
            identity (see ``handshake``).
        handshake: the transport (see [Note: two transports]): ``"header"`` (gloo's default:
            point-to-point exchanges, each call checked before its data moves) or ``"deferred"``
            (NCCL's shape, the default elsewhere: native collectives, each call checked without
            a device sync at the next agreement point or within ``verify_every`` calls).
        timeout: seconds a collective waits for a peer before this comm fails on every rank
            (default ``DEFAULT_TIMEOUT`` = 300 s; on gloo it replaces the process group's own
            timeout for ragged's collectives).
        verify_every: under ``"deferred"``, calls between two device-side checks.

    Returns:
        A :class:`TorchCollectives`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a mesh with more than 2 dimensions, or an unknown option.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "rg.collectives.from_torch() needs an initialised torch.distributed process group. Fix: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets the env), or "
            "use rg.collectives.simulate(world_size, fn) for an in-process simulation."
        )
    kw = dict(plan_check=plan_check, handshake=handshake, timeout=timeout, verify_every=verify_every)
    try:
        # a torch built without distributed support has no device_mesh: looked up only when a comm is made
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        if group.ndim == 1:
            return TorchCollectives(group.get_group(0), **kw)
        if group.ndim == 2:
            return TorchCollectives(group.get_group(1), group.get_group(0), **kw)
        raise RaggedValueError(
            f"from_torch takes a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got a mesh with "
            f"{group.ndim} dims {tuple(group.shape)}. Fix: slice the mesh, e.g. mesh['dp_replicate', 'dp_shard']."
        )
    return TorchCollectives(group, **kw)

