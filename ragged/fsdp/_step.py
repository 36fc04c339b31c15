"""The functional FSDP training step: ``(shards, opt_state), batch -> (shards', opt_state'), metrics``.

[Note: how a unit is gathered, used and released without module hooks]
For every unit the step allocates one flat buffer of ``m * S`` elements (compute dtype) and
makes every parameter a *leaf tensor that is a view of it* (zero-copy: the all-gather writes
straight into the storage the parameters read). The buffer's storage is then released
(``untyped_storage().resize_(0)``, as FSDP2 does) and brought back only when needed:

* forward: the loss runs under a ``TorchFunctionMode`` that looks at the storage of every
  tensor argument of every torch call. The first call that touches a unit's storage gathers
  the unit (waiting on its prefetch), frees the unit used before it (reshard after forward),
  and starts the all-gather of the unit predicted to come next (prefetch) before computing.
* saved tensors: under ``torch.autograd.graph.saved_tensors_hooks``, a tensor saved for
  backward that lives in a unit's storage is packed as ``(unit, offset, size, stride)``, not
  kept alive; its unpack (in backward) re-gathers that unit on first use, frees the unit used
  before it, and prefetches the unit predicted to come next in backward. Nothing is recomputed.
* gradients: each parameter leaf has a ``register_post_accumulate_grad_hook`` that copies its
  gradient into the unit's flat gradient buffer (laid out like the plan, padding zero) and
  drops it: one copy per gradient, as FSDP2's copy-in (autograd allocates each gradient
  itself). When the last leaf of a unit is done, the unit's reduce-scatter starts at once
  (``rg.reduce_scatter_start`` on the flat buffer: nothing more to pack) and its parameters are freed,
  while backward continues with the units before it. At most ``max_inflight_reduce`` reduce-
  scatters are in flight; older ones are waited and accumulated into the fp32 gradient shard.

``spec.Replicate()`` leaves of a unit are views of a copy of the shard's replicated buffer (in
the compute dtype) made once per step call: never gathered, never freed. Their gradients go to a
small per-unit buffer that rides along the unit's reduce-scatter as its all-reduced part.

Per-leaf leaves (rather than one flat leaf with views) matter: autograd runs a leaf's
``AccumulateGrad`` as soon as its gradient is ready, whereas views of one flat leaf created
before the forward would funnel every gradient through nodes that autograd schedules last.

[Note: limits of gathering on use]
* Every rank must use units in the same order (as in FSDP2): collectives are issued in use order.
  For the same reason, which parameters get a gradient must not differ between ranks: a leaf
  the loss never reads is reduced as zero after backward, so if one rank skips it and another
  does not (data-dependent control flow), their reduce-scatters come in different orders.
  (A fused MoE expert tensor is one leaf: experts without tokens are fine.)
* The loss must read parameters through torch calls (any op, method or view property; only
  metadata such as ``.shape`` does not gather). Python code that autograd runs in backward
  (custom ``Function.backward``, recomputation) gathers too: tensors saved with
  ``ctx.save_for_backward`` through the saved-tensor hooks, parameters (or views of them) kept
  as plain ``ctx`` attributes on their first use in a torch call (tested).
* Activation checkpointing inside the model (``torch.utils.checkpoint`` in a module's forward)
  does not mix with ``functional_call``: the recomputation runs after the call has restored the
  module's own tensors. Checkpoint a function that takes the parameters as inputs instead
  (``ragged.examples.gpt.loss_fn(model, checkpoint=True)``): its recomputation reads the unit's
  leaves and gathers them like any other code run by backward.
* Backward runs with the mode active (the engine is called directly: ``loss.backward()`` under a
  ``TorchFunctionMode`` would run with the mode popped). The step's own code that runs inside it
  (gathers, gradient hooks) sets ``busy`` so that its copies do not count as uses.

[Note: when a unit's flat gradient buffer is allocated]
Normally at the unit's first leaf gradient: each leaf gradient is then copied in and dropped
at once, so a unit costs its flat buffer plus one leaf gradient. A unit whose gradients arrive
spread over backward (the default ``"rest"`` unit: the head's gradient comes first, the
embeddings' last) would hold a whole flat buffer through backward for one early leaf; when the
previous micro-batch showed that (another unit's reduce-scatter started between its first and
last leaf gradient), the unit instead keeps autograd's leaf gradients until it is complete and
then packs them, as FSDP2 keeps per-parameter gradients. Either way the result is the same.

[Note: the schedule hint]
Which unit comes next is predicted from the order observed in the previous micro-batch (the
first forward assumes the units' order, the first backward the reverse of the forward). The
hint only decides what to prefetch, never what is computed: a wrong guess costs a wasted or
a late all-gather, not a wrong result. Every rank must use units in the same order (as in
FSDP2), since all-gathers and reduce-scatters are issued in use order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ragged._dbuffer import DBuffer
from ragged._errors import RaggedKeyError, RaggedTypeError, RaggedValueError
from ragged._pytree import flatten_with_keystr, pytree
from ragged.fsdp._state import TrainState
from ragged.fsdp._units import Units, picked_leaves
from ragged.optim import apply_updates
from ragged.transforms import all_gather_flat, reduce_scatter_wait
from ragged.transforms._check import check_plans
from ragged.transforms._reduce_scatter import _reduce_scatter_start, all_reduce_leaves

__all__ = ["make_step", "Step"]


# ---------------------------------------------------------------------------------------
# the per-call runtime
# ---------------------------------------------------------------------------------------

_FREE, _PENDING, _READY = 0, 1, 2
_METADATA = frozenset(
    {"size", "dim", "stride", "storage_offset", "numel", "is_contiguous", "untyped_storage", "data_ptr", "__len__",
     "element_size", "__hash__", "__repr__", "__format__", "ndimension", "nelement", "requires_grad_",
     "register_hook", "register_post_accumulate_grad_hook"}
)
# properties that read metadata only (``.T``, ``.mT``, ``.data`` ... make views: they do gather)
_METADATA_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout", "is_cuda",
     "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "names", "_base", "_version", "output_nr",
     "itemsize", "nbytes", "_grad", "_grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks", "name"}
)


def _reads_data(func) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) not in _METADATA_PROPERTIES
    return name not in _METADATA


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Schedule:
    """Observed unit orders (forward, backward): the prefetch hint, see [Note: the schedule hint]."""

    def __init__(self, num_units: int):
        self.order = {"forward": list(range(num_units)), "backward": None}
        self.lazy_grads: set[int] = set()

    def predict(self, phase: str, observed: list[int]) -> int | None:
        pred = self.order[phase]
        if pred is None:
            return None
        n = len(observed)
        if n < len(pred) and pred[:n] == observed:
            return pred[n]
        return None


class _Run:
    """State of one step call: buffers, leaves, in-flight collectives, counters."""

    def __init__(self, units: Units, shards, comm, *, compute_dtype, reduce_dtype, prefetch, reshard, schedule,
                 max_inflight_reduce, trace):
        self.units, self.comm, self.shards = units, comm, shards
        self.reduce_dtype, self.prefetch, self.reshard = reduce_dtype, prefetch, reshard
        self.schedule, self.max_inflight = schedule, max_inflight_reduce
        self.trace = [] if trace else None
        self.n = len(units)
        self.dtype = [compute_dtype or u.plan.dtype for u in units]
        self.flat, self.leaves, self.leaf_ranges = [], [], []
        self.rflat, self.rep_ranges = [], []  # spec.Replicate() leaves: a persistent copy, never gathered
        self.key_to_unit = {}
        self.state = [_FREE] * self.n
        self.handles: list[Any] = [None] * self.n
        self.sources: list[Any] = [None] * self.n
        self.nbytes = [u.plan.buffer_numel * torch.empty((), dtype=d).element_size() for u, d in zip(units, self.dtype)]
        self.live_bytes = self.peak_bytes = 0
        self.grad_live = self.grad_peak = 0
        self.num_gathers = 0
        self.active = None
        self.busy = 0  # > 0 while the step's own code runs torch calls (see touch)
        self.phase = "forward"
        self.observed = {"forward": [], "backward": []}
        for i, u in enumerate(units):
            shard_data = shards[u.name].data
            flat = torch.empty(u.plan.buffer_numel, dtype=self.dtype[i], device=shard_data.device)
            leaves = {}
            ranges = []
            for leaf in u.plan.leaves:
                t = flat[leaf.offset : leaf.stop].view(leaf.shape).requires_grad_()
                leaves[u.paths[leaf.index]] = t
                ranges.append((leaf.offset, leaf.stop, t))
            flat.untyped_storage().resize_(0)
            rflat = shards[u.name].replicated.detach().to(self.dtype[i], copy=True)
            rranges = []
            for leaf in u.plan.replicated:
                t = rflat[leaf.offset : leaf.stop].view(leaf.shape).requires_grad_()
                leaves[u.paths[leaf.index]] = t
                rranges.append((leaf.offset, leaf.stop, t))
            self.flat.append(flat)
            self.rflat.append(rflat)
            self.leaves.append(leaves)
            self.leaf_ranges.append(ranges)
            self.rep_ranges.append(rranges)
            self.key_to_unit[_storage_key(flat)] = i
        self.params_tree = units.merge({u.name: self.leaves[i] for i, u in enumerate(units)})
        # gradient side
        self.gflat: list[Any] = [None] * self.n
        self.rgflat: list[Any] = [None] * self.n
        self.remaining = [0] * self.n
        self.rs_pending: list[tuple[int, Any, int]] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.rep_grads: dict[str, torch.Tensor] = {}
        self.hook_handles = [
            t.register_post_accumulate_grad_hook(self._make_grad_hook(i))
            for i in range(self.n)
            for _, _, t in self.leaf_ranges[i] + self.rep_ranges[i]
        ]

    def close(self):
        """Breaks the leaf -> hook -> run reference cycle (it runs through C++ hook storage the
        garbage collector cannot see) and drops every buffer of this call."""
        for h in self.hook_handles:
            h.remove()
        for i in range(self.n):
            if self.state[i] != _FREE:
                self.free(i)
        self.hook_handles = []
        # a leaf that outlives the call (kept by the loss, or by a traceback) must not point into
        # released storage: printing it would read freed memory
        for ranges in self.leaf_ranges:
            for _, _, t in ranges:
                t.data = t.data.new_empty((0,))
        self.flat = self.leaves = self.leaf_ranges = self.params_tree = None
        self.rflat = self.rep_ranges = self.rgflat = None
        self.gflat = self.sources = self.handles = None
        self.key_to_unit = {}

    # ---- tracing / accounting --------------------------------------------------------
    def _log(self, event: str, i: int):
        if self.trace is not None:
            self.trace.append((event, self.units[i].name, self.phase))

    # ---- parameters --------------------------------------------------------------------
    def _start(self, i: int):
        flat = self.flat[i]
        flat.untyped_storage().resize_(self.nbytes[i])
        data = self.shards[self.units[i].name].data
        src = data if data.dtype == self.dtype[i] else data.to(self.dtype[i])
        self.sources[i] = src
        self.handles[i] = all_gather_flat(self.units[i].plan, flat, src, self.comm, async_op=True)
        self.state[i] = _PENDING
        self.num_gathers += 1
        self.live_bytes += self.nbytes[i]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._log("gather_start", i)

    def _wait(self, i: int):
        if self.state[i] == _PENDING:
            self.handles[i].wait()
            self.handles[i] = self.sources[i] = None
            self.state[i] = _READY
            self._log("gather_done", i)

    def free(self, i: int):
        if self.state[i] == _FREE:
            return
        self._wait(i)
        self.flat[i].untyped_storage().resize_(0)
        self.state[i] = _FREE
        self.live_bytes -= self.nbytes[i]
        if self.active == i:
            self.active = None
        self._log("free", i)

    def activate(self, i: int):
        """Unit ``i`` is about to compute (forward) or be read by backward."""
        if self.active == i and self.state[i] == _READY:
            return
        self.busy += 1  # the torch calls made here (collectives, copies) are the step's own: no touch
        try:
            self._activate(i)
        finally:
            self.busy -= 1

    def _activate(self, i: int):
        prev = self.active
        if prev is not None and prev != i and (self.reshard or self.phase == "backward"):
            self.free(prev)
        if self.state[i] == _FREE:
            self._start(i)
        observed = self.observed[self.phase]
        if not observed or observed[-1] != i:
            observed.append(i)
        if self.prefetch:
            nxt = self.schedule.predict(self.phase, observed)
            if nxt is not None and nxt != i and self.state[nxt] == _FREE:
                self._start(nxt)
        self._wait(i)
        self.active = i
        self._log("compute", i)

    def touch(self, t: torch.Tensor):
        if self.busy:
            return
        i = self.key_to_unit.get(_storage_key(t))
        if i is not None and (i != self.active or self.state[i] != _READY):
            self.activate(i)

    # ---- saved tensors -------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        i = self.key_to_unit.get(_storage_key(t))
        if i is None:
            return t
        return (i, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        i, offset, size, stride = packed
        if self.active != i or self.state[i] != _READY:
            self.activate(i)
        return self.flat[i].as_strided(size, stride, offset)

    # ---- gradients -----------------------------------------------------------------------
    def _grad_buffer(self, i: int) -> torch.Tensor:
        g = self.gflat[i]
        if g is None:
            plan = self.units[i].plan
            g = torch.empty(plan.buffer_numel, dtype=self.dtype[i], device=self.flat[i].device)
            pos = 0
            for start, stop, _ in sorted(self.leaf_ranges[i], key=lambda r: r[0]):
                if start > pos:
                    g[pos:start].zero_()
                pos = stop
            g[pos:].zero_()
            self.gflat[i] = g
            self.grad_live += g.numel() * g.element_size()
            self.grad_peak = max(self.grad_peak, self.grad_live)
        return g

    def _rep_grad_buffer(self, i: int) -> torch.Tensor:
        """The unit's replicated leaves' gradients (small; all-reduced with the reduce-scatter)."""
        if self.rgflat[i] is None:
            self.rgflat[i] = torch.zeros_like(self.rflat[i])
        return self.rgflat[i]

    def _make_grad_hook(self, i: int):
        def hook(t: torch.Tensor):
            if t.grad is None:
                return
            self.busy += 1  # runs in backward under the mode: its copies and collectives must not touch
            try:
                self._store_grad(i, t)
            finally:
                self.busy -= 1
        return hook

    def _store_grad(self, i: int, t: torch.Tensor):
        """Leaf ``t`` of unit ``i`` has its whole gradient for this micro-batch (once per leaf).

        See [Note: when a unit's flat gradient buffer is allocated]."""
        self.done_leaves.add(id(t))
        if i in self.schedule.lazy_grads:
            self.held_grads[i].append(t)  # keep autograd's tensor until the unit is complete
        else:
            self._copy_grad(i, t)
        if self.grads_started[i] is None:
            self.grads_started[i] = self.num_reduces
        self.remaining[i] -= 1
        if self.remaining[i] == 0:
            for held in self.held_grads[i]:
                self._copy_grad(i, held)
            self.held_grads[i] = []
            self._reduce(i)

    def _copy_grad(self, i: int, t: torch.Tensor):
        if self.rep_ranges[i] and _storage_key(t) == _storage_key(self.rflat[i]):
            g, off = self._rep_grad_buffer(i), t.storage_offset() - self.rflat[i].storage_offset()
        else:
            g, off = self._grad_buffer(i), t.storage_offset() - self.flat[i].storage_offset()
        with torch.no_grad():
            g[off : off + t.numel()].view(t.shape).copy_(t.grad)
        t.grad = None

    def _reduce(self, i: int):
        unit = self.units[i]
        # a unit whose gradients arrive around other units' reduce-scatters (e.g. embeddings and
        # head in one unit) holds its leaf gradients until complete next time
        if self.num_reduces > self.grads_started[i]:
            self.schedule.lazy_grads.add(i)
        else:
            self.schedule.lazy_grads.discard(i)
        self.num_reduces += 1
        g = self.gflat[i]
        self.gflat[i] = None
        rep = self._rep_grad_buffer(i) if unit.plan.replicated else None
        self.rgflat[i] = None
        pending = _reduce_scatter_start(unit.plan, g, self.comm, "mean", self.reduce_dtype, replicated=rep, agreed=True)
        self.rs_pending.append((i, pending, g.numel() * g.element_size()))
        self._log("reduce_start", i)
        if self.phase == "backward" and self.state[i] != _FREE:
            self.free(i)  # backward is done with this unit
        while len(self.rs_pending) > self.max_inflight:
            self._finish_oldest_reduce()

    def _finish_oldest_reduce(self):
        i, pending, nbytes = self.rs_pending.pop(0)
        reduced = reduce_scatter_wait(pending)
        name = self.units[i].name
        for acc, part in ((self.grads, reduced.data), (self.rep_grads, reduced.replicated)):
            if name in acc:
                acc[name].add_(part)
            else:
                acc[name] = part
        self.grad_live -= nbytes
        self._log("reduce_done", i)

    # ---- one micro-batch -------------------------------------------------------------------
    def micro_batch(self, loss_fn, batch, scale: float) -> torch.Tensor:
        self.phase = "forward"
        self.observed = {"forward": [], "backward": []}
        self.remaining = [len(r) + len(rr) for r, rr in zip(self.leaf_ranges, self.rep_ranges)]
        self.done_leaves: set[int] = set()
        self.held_grads: list[list[torch.Tensor]] = [[] for _ in range(self.n)]
        self.grads_started: list[int | None] = [None] * self.n
        self.num_reduces = 0
        with _UseMode(self), torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            loss = loss_fn(self.params_tree, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise RaggedTypeError(
                "loss_fn(params, batch) must return a scalar tensor that depends on the params; got "
                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
            )
        forward_order = list(self.observed["forward"])
        if self.schedule.order["backward"] is None:
            self.schedule.order["backward"] = forward_order[::-1]
        self.phase = "backward"
        scaled = loss.float() * scale
        # Python code run by backward (recomputation, custom Functions) must gather too, so the
        # engine runs with the mode active. ``scaled.backward()`` (or ``torch.autograd.backward``)
        # under the mode would dispatch to the mode, which runs it with the mode popped: that code
        # would then read released storage (a segfault, seen with torch.utils.checkpoint).
        with _UseMode(self):
            torch.autograd.Variable._execution_engine.run_backward(
                (scaled,), (torch.ones_like(scaled),), False, False, (), allow_unreachable=True, accumulate_grad=True
            )
        # units some of whose leaves got no gradient (unused parameters): zeros, in unit order
        for i in range(self.n):
            for _, _, t in self.leaf_ranges[i] + self.rep_ranges[i]:
                if self.remaining[i] > 0 and id(t) not in self.done_leaves:
                    t.grad = torch.zeros_like(t)
                    self._store_grad(i, t)
        for i in range(self.n):
            self.free(i)
        self.active = None
        self.schedule.order["forward"] = forward_order
        self.schedule.order["backward"] = list(self.observed["backward"])
        return loss.detach()

    def finish_reduces(self):
        while self.rs_pending:
            self._finish_oldest_reduce()


class _UseMode(TorchFunctionMode):
    """Gathers a unit on the first torch call that reads its storage (see the module note)."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_data(func):
            touch = self.run.touch
            for a in itertools.chain(args, kwargs.values()):
                if isinstance(a, torch.Tensor):
                    touch(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, torch.Tensor):
                            touch(b)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------


def _split_batch(batch, k: int):
    if k == 1:
        return [batch]
    paths, leaves, treedef = flatten_with_keystr(batch)
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % k:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise RaggedValueError(
                f"batch{p} has shape {shape}; with micro_batches={k} every batch leaf needs a leading "
                f"dimension divisible by {k}. Fix: pick a per-rank batch size that is a multiple of micro_batches."
            )
    chunks = [x.chunk(k) for x in leaves]
    return [pytree.unflatten(treedef, [c[j] for c in chunks]) for j in range(k)]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """A compiled-once training step; call it as ``state, metrics = step(state, batch)``.

    Built by :func:`make_step`; see there for the arguments. The only things it carries
    between calls are scheduling hints: the unit order to prefetch in (see [Note: the schedule
    hint]) and which units hold leaf gradients until complete (see [Note: when a unit's flat
    gradient buffer is allocated]); results never depend on them.
    """

    units: Units
    loss_fn: Callable
    optimizer: Any
    comm: Any
    micro_batches: int = 1
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    prefetch: bool = True
    reshard_after_forward: bool = True
    max_inflight_reduce: int = 1
    donate: bool = False
    trace: bool = False
    data_axes: tuple = ()
    _schedule: _Schedule = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self._schedule is None:
            object.__setattr__(self, "_schedule", _Schedule(len(self.units)))

    def __call__(self, state: TrainState, batch):
        shards, opt_state = state
        missing = [u.name for u in self.units if u.name not in shards]
        if missing:
            raise RaggedKeyError(f"state.shards lacks units {missing}; build the state with rg.fsdp.init(units, ...).")
        for u in self.units:
            if shards[u.name].plan != u.plan:
                raise RaggedValueError(f"state.shards[{u.name!r}] was sharded with another plan than units[{u.name!r}].")
        micro = _split_batch(batch, self.micro_batches)  # local checks first, then the cross-rank one
        # one agreement for every unit, every step; the step's own collectives then skip it
        token = (f"fsdp_step:{self.compute_dtype}:{self.reduce_dtype}:{self.micro_batches}:{self.reshard_after_forward}:"
                 f"{[c.world_size for c, _ in self.data_axes]}")
        check_plans([u.plan for u in self.units], self.comm, token, every_call=True)
        run = _Run(self.units, shards, self.comm, compute_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
                   prefetch=self.prefetch, reshard=self.reshard_after_forward, schedule=self._schedule,
                   max_inflight_reduce=self.max_inflight_reduce, trace=self.trace)
        losses = []
        try:
            for mb in micro:
                losses.append(run.micro_batch(self.loss_fn, mb, 1.0 / self.micro_batches))
            run.finish_reduces()
        finally:
            run.close()
        grads = {}
        for u in self.units:
            g = run.grads[u.name]  # micro-batch losses were scaled by 1 / micro_batches
            rep = run.rep_grads[u.name]
            _reduce_data_axes(u, g, rep, self.comm.rank, self.data_axes)
            grads[u.name] = DBuffer(data=g, replicated=rep, plan=u.plan, rank=shards[u.name].rank)
        updates, opt_state = self.optimizer.update(grads, opt_state, shards)
        new_shards = apply_updates(shards, updates, donate=self.donate)
        loss = torch.stack([l.double() for l in losses]).mean().reshape(1)
        self.comm.all_reduce(loss, op="sum")
        replicas = getattr(self.comm, "num_replicas", 1)
        if replicas > 1:
            self.comm.all_reduce_replicas(loss, op="sum")
        for axis_comm, _ in self.data_axes:
            axis_comm.all_reduce(loss, op="sum")
            replicas *= axis_comm.world_size
        model_bytes = sum(run.nbytes)
        metrics = {
            "loss": float(loss) / (self.comm.world_size * replicas),
            "peak_gathered_bytes": run.peak_bytes,
            "peak_grad_bytes": run.grad_peak,
            "largest_unit_bytes": max(run.nbytes),
            "model_bytes": model_bytes,
            "num_gathers": run.num_gathers,
            "micro_batches": self.micro_batches,
        }
        if run.trace is not None:
            metrics["trace"] = run.trace
        return TrainState(new_shards, opt_state), metrics


def make_step(
    units: Units,
    loss_fn: Callable,
    optimizer,
    comm,
    *,
    micro_batches: int = 1,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
    max_inflight_reduce: int = 1,
    donate: bool = False,
    trace: bool = False,
    data_axes: Sequence[tuple[Any, Callable[[str], bool]]] = (),
) -> Step:
    """Builds the FSDP training step ``state, metrics = step(state, batch)``.

    See [Note: how a unit is gathered, used and released without module hooks].

    Args:
        units: from :func:`ragged.fsdp.make_units`.
        loss_fn: ``loss_fn(params, batch) -> scalar tensor``; ``params`` is the full parameter
            tree (``{name: tensor}`` for a module: use ``torch.func.functional_call``). Its
            leaves are gathered on first use, so the loss must only read them inside torch calls.
            ``functional_call`` swaps tensors on the module object: on the simulated backend
            (ranks are threads of one process) give each rank its own module (``copy.deepcopy``).
        optimizer: a ``rg.optim`` GradientTransformation over ``{unit name: DBuffer}``.
        comm: the shard group's collectives (``rg.collectives.from_torch()`` or simulated).
        micro_batches: gradient accumulation: ``batch`` (this rank's) is split into this many
            equal micro-batches along dim 0; gradients are averaged.
        compute_dtype: dtype of gathered parameters (e.g. ``torch.bfloat16`` from fp32 master
            shards: only the S-element shard is cast). Default: the plans' dtype.
        reduce_dtype: dtype gradients are reduce-scattered in (default: the compute dtype);
            the gradient shard is in the plan's dtype.
        prefetch: start the next unit's all-gather before the current unit computes.
        reshard_after_forward: free each unit's parameters after its forward (re-gather in
            backward); ``False`` keeps them from forward to backward (more memory, fewer gathers).
        max_inflight_reduce: reduce-scatters in flight before the oldest is waited (each
            holds its unit's flat gradient; 1 waits unit k's when unit k-1's starts).
        donate: like ``jax.jit(donate_argnums=...)``: the new shards are written into the
            input state's shard buffers (no allocation); the caller must not read the old
            state after the call. Pair with ``rg.optim.adamw(..., donate=True)``, whose update
            reuses the gradient buffers (which the step owns) and the moments.
        trace: record ``(event, unit, phase)`` tuples in ``metrics["trace"]``.
        data_axes: other mesh axes that split the batch (e.g. expert parallelism), as
            ``(comm, is_replicated)`` pairs: after the reduce-scatter over ``comm`` (the FSDP
            axis), the gradients of the parameters with ``is_replicated(path)`` (paths as in
            ``units``) are all-reduced over that axis's ``comm``, and every gradient is divided by
            its size (the loss is a mean over all data-parallel ranks). See [Note: data axes] in
            ``ragged/parallel/_transforms.py``; ``rg.parallel.step_data_axes(mplan, mcomm,
            ("ep",))`` builds them from a mesh plan. Global-norm clipping must then see the whole
            mesh: ``rg.optim.clip_by_global_norm(max_norm, comm=comm, norm=lambda g:
            rg.fsdp.global_norm(units, g, comm, data_axes=data_axes))`` (its default norm spans
            ``comm`` only, so EP ranks would clip by different factors).

    Returns:
        A :class:`Step`. Its metrics: ``loss`` (mean over micro-batches and ranks),
        ``peak_gathered_bytes`` (most bytes of gathered parameter buffers alive at once),
        ``peak_grad_bytes``, ``largest_unit_bytes``, ``model_bytes`` (all units gathered),
        ``num_gathers``.

    Examples:
        >>> import copy, torch, ragged as rg
        >>> from ragged import fsdp
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> units = fsdp.make_units(model, world_size=2, groups=["0", "2"])
        >>> def make_loss(module):
        ...     def loss_fn(params, batch):
        ...         x, y = batch
        ...         return ((torch.func.functional_call(module, params, (x,)) - y) ** 2).mean()
        ...     return loss_fn
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> def run(comm):  # one module object per simulated rank (ranks are threads)
        ...     opt = rg.optim.sgd(0.1)
        ...     state = fsdp.init(units, model.state_dict(), opt, comm)  # a module would be released
        ...     step = fsdp.make_step(units, make_loss(copy.deepcopy(model)), opt, comm)
        ...     rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        ...     state, metrics = step(state, (x[rows], y[rows]))
        ...     return metrics["loss"], fsdp.gather(units, state.shards, comm)["0.bias"]
        >>> (loss0, b0), (loss1, b1) = rg.collectives.simulate(2, run)
        >>> ref = torch.nn.functional.mse_loss(model(x), y)
        >>> ref.backward()
        >>> abs(loss0 - ref.item()) < 1e-6, torch.allclose(b0, model[0].bias - 0.1 * model[0].bias.grad)
        (True, True)
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise RaggedValueError(f"micro_batches must be a positive int, got {micro_batches!r}.")
    if max_inflight_reduce < 1:
        raise RaggedValueError(f"max_inflight_reduce must be >= 1, got {max_inflight_reduce!r}.")
    if units.world_size != comm.world_size:
        raise RaggedValueError(
            f"the units were planned for world_size={units.world_size} but comm has {comm.world_size} ranks. "
            "Fix: make_units(model, world_size=comm.world_size)."
        )
    data_axes = tuple((c, pred) for c, pred in data_axes)
    for c, pred in data_axes:
        if not callable(pred) or not hasattr(c, "all_reduce"):
            raise RaggedTypeError("make_step: data_axes entries are (comm, is_replicated(path) -> bool) pairs, got "
                            f"({type(c).__name__}, {type(pred).__name__}).")
    return Step(units=units, loss_fn=loss_fn, optimizer=optimizer, comm=comm, micro_batches=micro_batches,
                compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, prefetch=prefetch,
                reshard_after_forward=reshard_after_forward, max_inflight_reduce=max_inflight_reduce, donate=donate,
                trace=trace, data_axes=data_axes)


def _reduce_data_axes(unit, grad: torch.Tensor, rep: torch.Tensor, rank: int, data_axes) -> None:
    """See ``make_step(data_axes=...)``: in place on this unit's gradient shard and replicated part."""
    for axis_comm, is_replicated in data_axes:
        all_reduce_leaves(axis_comm, grad, rep, unit.plan, rank, picked_leaves(unit, is_replicated))
        grad.div_(axis_comm.world_size)
        rep.div_(axis_comm.world_size)
