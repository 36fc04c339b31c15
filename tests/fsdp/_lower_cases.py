"""What ``step.lower(...)`` is checked against: a real step's state, collectives and metrics.

``measured(comm, case, optimizer)`` trains the tiny GPT of ``tests/fsdp/_cases.py`` for two steps
(the first learns the collective schedule), counting every collective of the second step at the
``Collectives`` boundary (:class:`Counter`), and returns what it saw next to the lowering of the same
step: the comparison is the test's.
"""

from __future__ import annotations

import collections
import copy
import functools

import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.data import rank_slice
from ragged.examples.gpt import loss_fn
from ragged._pytree import flatten_with_keystr
from ragged.fsdp._lower import _category
from ragged.fsdp._schedule import CollectiveSchedule

# (method, kind, axis, bytes of the call): the full buffer, as bench/_measure.py's CommCounter counts
# (all-gather output, reduce-scatter input, all-reduce tensor), coalesced calls as one call
_METHODS = (
    ("all_gather_into", "all_gather", "shard", lambda out, inp, **k: _nb(out)),
    ("all_gather_into_coalesced", "all_gather", "shard", lambda outs, ins, **k: sum(map(_nb, outs))),
    ("reduce_scatter_into", "reduce_scatter", "shard", lambda out, inp, **k: _nb(inp)),
    ("reduce_scatter_into_coalesced", "reduce_scatter", "shard", lambda outs, ins, **k: sum(map(_nb, ins))),
    ("all_reduce", "all_reduce", "shard", lambda t, **k: _nb(t)),
    ("all_reduce_replicas", "all_reduce", "replica", lambda t, **k: _nb(t)),
    ("all_to_all", "all_to_all", "shard", lambda out, inp, *a, **k: _nb(inp)),
    ("all_gather_object", "object", "mesh", lambda obj, **k: 0),
)


def _nb(t) -> int:
    return t.numel() * t.element_size()


class Counter:
    """Counts a comm's collective calls and bytes per (kind, axis) while ``active``; ``axis`` names
    every call's axis (a data group's comm: ``"data0"``)."""

    def __init__(self, comm, axis: str | None = None):
        self.active, self.axis = False, axis
        self.calls, self.bytes = collections.Counter(), collections.Counter()
        for name, kind, axis, size in _METHODS:
            orig = getattr(comm, name, None)
            if orig is None:
                continue

            @functools.wraps(orig)
            def wrapped(*a, _orig=orig, _key=(kind, axis if self.axis is None else self.axis), _size=size, **k):
                if self.active:
                    self.calls[_key] += 1
                    self.bytes[_key] += _size(*a, **k)
                return _orig(*a, **k)

            setattr(comm, name, wrapped)

    def records(self) -> dict:
        return {key: (self.calls[key], self.bytes[key]) for key in self.calls if key[0] != "object"}


def storage_by_category(state) -> dict[str, int]:
    """Bytes of the unique storages of a real TrainState, by the lowering's categories."""
    shards, opt_state = state
    seen, out = set(), collections.Counter()

    def add(key, t):
        if not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            return
        seen.add(s.data_ptr())
        out[key] += s.nbytes()

    for d in shards.values():
        add("param_shards", d.data)
        add("replicated", d.replicated)
    paths, leaves, _ = flatten_with_keystr(opt_state)
    for path, leaf in zip(paths, leaves):
        add(_category(path), leaf)
    return dict(out)


def _optimizer(name: str, case, comm):
    """The optimizers lowered: the case's own, 8-bit AdamW, and the ones that communicate (Muon's
    owner exchange; a global norm clip and a finiteness agreement around AdamW)."""
    if name == "adamw8bit":
        return rg.optim.adamw_8bit(case.lr, min_size=256)
    if name == "muon":
        return rg.optim.muon(case.lr, comm=comm, num_waves=2)
    if name == "clip-finite":
        return rg.optim.apply_if_finite(rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=comm, error_if_nonfinite=True),
                                                       case.make_optimizer()), 2, comm=comm)
    return case.make_optimizer()


def measured(comm, case, optimizer: str = "adamw", *, steps: int = 2, first_call: bool = False):
    """Trains ``case`` for ``steps`` steps; counts the last. Returns a dict of what was seen and
    what the lowering predicts (plain values: picklable from gloo workers)."""
    model = case.model()
    def specs(path, t):  # 8-bit AdamW quantizes blocks: 16 x 16 tiles of the matrices
        if case.replicate_vectors and t.dim() == 1:
            return rg.spec.Replicate()
        return rg.spec.Blocks(16, 16) if optimizer == "adamw8bit" and t.dim() == 2 else None

    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs, max_buffers=case.max_buffers)
    opt = _optimizer(optimizer, case, comm)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm, micro_batches=case.micro_batches,
                          policy=fsdp.MixedPrecision(compute_dtype=case.compute_dtype, reduce_dtype=case.reduce_dtype),
                          prefetch=case.prefetch,
                          reshard_after_forward=case.reshard_after_forward,
                          max_inflight_reduce=case.max_inflight_reduce)
    counter = Counter(comm)
    task = case.task()
    replicas = getattr(comm, "num_replicas", 1)
    index, total = getattr(comm, "replica_rank", 0) * comm.world_size + comm.rank, comm.world_size * replicas
    for s in range(steps):
        counter.active = s == (0 if first_call else steps - 1)
        state, metrics = step(state, rank_slice(task.batch(s, case.batch), index, total))
    counter.active = False
    lowered = step.lower(schedule=CollectiveSchedule.initial(len(units)) if first_call else None)
    mem, cost = lowered.memory_analysis(), lowered.cost_analysis()
    return {
        "rank": comm.rank,
        "state": storage_by_category(state),
        "predicted_state": {k: v for k, v in lowered.state_bytes[comm.rank].items() if v},
        "given_state": {k: v for k, v in step.lower(state).state_bytes[comm.rank].items() if v},
        "calls": counter.records(),
        "objects": counter.calls[("object", "mesh")],
        "predicted_calls": {(c.kind, c.axis): (c.calls, c.bytes) for c in cost.collectives},
        "predicted_objects": cost.objects,
        "metrics": {k: metrics[k] for k in ("peak_gathered_bytes", "peak_grad_bytes", "num_gathers", "num_reduces")},
        "predicted": {"peak_gathered_bytes": mem.peak_gathered_bytes, "peak_grad_bytes": mem.peak_grad_bytes,
                      "peak_grad_bytes_low": mem.peak_grad_bytes_low,
                      "num_gathers": cost.get("all_gather").calls, "num_reduces": cost.get("reduce_scatter").calls},
        "frozen_units": [u.name for u in units if u.trainable_plan is None],
        "partly_frozen": [u.name for u in units if u.frozen and u.trainable_plan is not None],
        "buffers": max(u.plan.num_buffers for u in units),
    }
