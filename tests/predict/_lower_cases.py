"""What ``step.lower(...)`` is checked against: a real step's state, collectives and metrics.

``measured(comm, case, optimizer)`` trains the tiny GPT of ``tests/fsdp/_cases.py`` for two steps
(the first learns the collective schedule), counting every collective of the second step at the
``Collectives`` boundary (``bench/_counts.CommCounter``) and the most scratch its quantized
collectives hold at once (:class:`ScratchMeter`: every buffer they take from the scratch pool until
they give it back), and returns what it saw next to the lowering of the same step: the comparison
is the test's.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import ragged as rg
from ragged import fsdp
from ragged.examples.data import rank_slice
from ragged.examples.gpt import loss_fn
from ragged.fsdp._schedule import CollectiveSchedule

from bench._counts import CommCounter, storage_by_category


def _optimizer(name: str, case, comm):
    """The optimizers lowered: the case's own, 8-bit AdamW, SOAP and Shampoo (per-block state), and the
    ones that communicate (Muon's owner exchange; a global norm clip and a finiteness agreement around AdamW)."""
    if name == "adamw8bit":
        return rg.optim.adamw_8bit(case.lr, min_size=256)
    if name == "muon":
        return rg.optim.muon(case.lr, comm=comm, num_waves=2)
    if name == "soap":
        return rg.optim.soap(case.lr, precondition_frequency=1)
    if name == "shampoo":
        return rg.optim.shampoo(case.lr, precondition_frequency=1)
    if name == "clip-finite":
        return rg.optim.apply_if_finite(rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=comm, error_if_nonfinite=True),
                                                       case.make_optimizer()), 2, comm=comm)
    return case.make_optimizer()


class ScratchMeter:
    """Stands between the quantized collectives (``ragged/transforms/_quantized.py``) and the real
    scratch pool: per thread (a simulated rank, or a gloo worker's), the bytes taken and not yet
    given back, and their most at once while ``active``."""

    _lock, _users, _real = threading.Lock(), 0, None
    _local = threading.local()

    def take(self, numel, dtype, device):
        buf = self._real.take(numel, dtype, device)
        here = self._local
        if getattr(here, "active", False):
            here.mine[id(buf)] = buf.numel() * buf.element_size()
            here.held += here.mine[id(buf)]
            here.peak = max(here.peak, here.held)
            here.taken[id(buf)] = buf
        return buf

    def give(self, buf):
        mine = getattr(self._local, "mine", {})
        if id(buf) in mine:
            self._local.held -= mine.pop(id(buf))
        self._real.give(buf)

    def start(self):
        """Counts this thread's takes from now on."""
        self._local.active, self._local.held, self._local.peak, self._local.mine = True, 0, 0, {}
        self._local.taken = {}

    def stop(self) -> tuple[int, int]:
        """Stops counting; the most bytes held at once since :meth:`start`, and the bytes of the
        buffers taken since that the pool keeps free now (one process's pool: meaningful where the
        ranks are processes, not threads sharing it)."""
        self._local.active = False
        taken = self._local.taken
        kept = sum(b.numel() * b.element_size() for free in self._real._free.values() for b in free if id(b) in taken)
        return self._local.peak, kept

    @classmethod
    @contextlib.contextmanager
    def installed(cls):
        """The meter in place of the quantized collectives' pool (shared by every rank's thread)."""
        from ragged.transforms import _flat, _quantized  # _flat: a chunked step's rows (its fixed tree)

        with cls._lock:
            if cls._users == 0:
                cls._real, _quantized.SCRATCH = _quantized.SCRATCH, cls()
                _flat.SCRATCH = _quantized.SCRATCH
            cls._users += 1
            meter = _quantized.SCRATCH
        try:
            yield meter
        finally:
            with cls._lock:
                cls._users -= 1
                if cls._users == 0:
                    _quantized.SCRATCH = _flat.SCRATCH = cls._real


def measured(comm, case, optimizer: str = "adamw", *, steps: int = 2, first_call: bool = False,
             gather: str | None = None, reduce: str | None = None):
    """Trains ``case`` for ``steps`` steps; counts the last. Returns a dict of what was seen and
    what the lowering predicts (plain values: picklable from gloo workers). ``gather`` /
    ``reduce``: a format of ``tests/fsdp/_quant_cases.py`` for the gather / the reduce-scatter."""
    from tests.fsdp import _quant_cases as qc

    model = case.model()
    def specs(path, t):  # 8-bit AdamW, the quantized collectives, SOAP / Shampoo: 16 x 16 tiles of the matrices
        if case.replicate_vectors and t.dim() == 1:
            return rg.spec.Replicate()
        if gather or reduce:
            return qc.specs(path, t)
        blocks = optimizer == "adamw8bit" and t.dim() == 2 or optimizer in ("soap", "shampoo") and t.dim() >= 2
        return rg.spec.Blocks(16, 16) if blocks else None

    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs, max_buffers=case.max_buffers)
    opt = _optimizer(optimizer, case, comm)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm, chunks=case.chunks,
                          micro_batches=None if case.chunks else case.micro_batches,
                          policy=fsdp.MixedPrecision(compute_dtype=case.compute_dtype, reduce_dtype=case.reduce_dtype,
                                                     gather_format=gather and (lambda leaf: qc.chooser(gather)(leaf.shape)),
                                                     reduce_format=reduce and (lambda leaf: qc.chooser(reduce)(leaf.shape))),
                          prefetch=case.prefetch,
                          reshard_after_forward=case.reshard_after_forward,
                          max_inflight_reduce=case.max_inflight_reduce)
    counter = CommCounter()
    counter.install_comm(comm, "step")
    task = case.task()
    replicas = getattr(comm, "num_replicas", 1)
    index, total = getattr(comm, "replica_rank", 0) * comm.world_size + comm.rank, comm.world_size * replicas
    with ScratchMeter.installed() as meter:
        for s in range(steps):
            counted = s == (0 if first_call else steps - 1)
            counter.active = "step" if counted else None
            if counted:
                meter.start()
            batch = task.batch(s, case.batch)
            state, metrics = step(state, fsdp.local_chunks(batch, case.chunks, comm) if case.chunks
                                  else rank_slice(batch, index, total))
        scratch, kept = meter.stop()
    counter.active = None
    lowered = step.lower(schedule=CollectiveSchedule.initial(len(units)) if first_call else None)
    mem, cost = lowered.memory_analysis(), lowered.cost_analysis()
    return {
        "rank": comm.rank,
        "state": storage_by_category(state),
        "predicted_state": {k: v for k, v in lowered.state_bytes[comm.rank].items() if v},
        "given_state": {k: v for k, v in step.lower(state).state_bytes[comm.rank].items() if v},
        "calls": counter.records("step"),
        "objects": counter.calls[("step", "object", "mesh")],
        "predicted_calls": {(c.kind, c.axis): (c.calls, c.bytes) for c in cost.collectives},
        "predicted_objects": cost.objects,
        "metrics": {**{k: metrics[k] for k in ("peak_gathered_bytes", "peak_grad_bytes", "peak_shard_bytes", "num_gathers",
                                               "num_reduces")},
                    "peak_scratch_bytes": scratch, "retained_scratch_bytes": kept},
        "predicted": {"peak_gathered_bytes": mem.peak_gathered_bytes, "peak_grad_bytes": mem.peak_grad_bytes,
                      "peak_grad_bytes_low": mem.peak_grad_bytes_low, "peak_scratch_bytes": mem.peak_scratch_bytes,
                      "peak_scratch_bytes_low": mem.peak_scratch_bytes_low,
                      "retained_scratch_bytes": mem.retained_scratch_bytes, "peak_shard_bytes": mem.peak_shard_bytes,
                      "peak_shard_bytes_low": mem.peak_shard_bytes_low,
                      "num_gathers": sum(u["gathers"] for u in cost.per_unit.values()),
                      "num_reduces": sum(u["reduces"] for u in cost.per_unit.values())},
        "frozen_units": [u.name for u in units if u.trainable_plan is None],
        "partly_frozen": [u.name for u in units if u.frozen and u.trainable_plan is not None],
        "buffers": max(u.plan.num_buffers for u in units),
    }
