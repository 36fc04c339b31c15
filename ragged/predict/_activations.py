"""The model's own bytes at every point of a step, measured once on one device, for ``step.lower``.

[Note: measuring activations on one device]
What a lowered step cannot derive from shapes is what the model itself allocates: activations
saved for backward, the temporaries inside each unit's forward and backward (the loss's logits
and their gradients, a recomputed block under checkpointing, MoE routing and the full-size
gradient ``select`` makes of a fused expert weight), and the leaves' gradients before the runtime
copies them into its flat buffer. None of it depends on the world size: every rank computes on
the full, gathered parameters and its own batch. :func:`profile_activations` runs the step's
forward and backward once (any world size, one device is enough: ``world_size=1``) and counts
every storage a torch op creates while the runtime is not running its own calls (its gathered
units, gradient buffers, casts and shards are left out: the lowering derives them, per world
size), from its creation until it is freed (a ``TorchDispatchMode``; nothing is asked of the
allocator, so it reads the same on CPU and CUDA; memory a kernel allocates and frees inside
itself is not seen). A dispatch mode changes one thing it measures: autograd then sums a
leaf's gradient contributions (a fused expert weight read once per expert) out of place instead
of in place; such a sum is counted as the in-place one it replaces. It keeps, at the program's
points (per forward entry; per backward segment, split where the runtime first acts inside it;
per event), the most of those bytes alive at once. The lowering places them next to the
runtime's buffers of the same point at any world size.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ragged.fsdp._schedule import CollectiveSchedule

__all__ = ["Activations", "profile_activations"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Activations:
    """The model's own bytes of one micro-batch at the points of ``schedule`` (see [Note: measuring
    activations on one device]); :func:`profile_activations` measures them.

    Attributes:
        schedule: the collective schedule they were measured with (the lowering uses it).
        forward: per forward entry, the most bytes alive while it is current.
        backward: per backward segment, ``(most before the runtime first acts inside it, most after)``:
            the split is where its first gradients take their buffers (the loss's segment: where
            backward reaches the model and the start prefetch is issued).
        events: per backward event (``0 .. len(forward)``), the bytes alive when it is processed.
        saved: bytes alive at the end of forward (what backward keeps: saved tensors, the loss).

    Examples:
        >>> import ragged as rg
        >>> from ragged.fsdp._schedule import CollectiveSchedule
        >>> one = CollectiveSchedule(forward=(0,), needs=(frozenset({0}),), reduce_at=(0,), learning=False)
        >>> rg.predict.Activations(schedule=one, forward=(300,), backward=((500, 200),), events=(0, 300), saved=300).peak
        500
    """

    schedule: CollectiveSchedule
    forward: tuple[int, ...]
    backward: tuple[tuple[int, int], ...]
    events: tuple[int, ...]
    saved: int

    @property
    def peak(self) -> int:
        return max(self.forward + tuple(b for pair in self.backward for b in pair))


class _Counter(TorchDispatchMode):
    """Bytes of the storages torch ops create outside the runtime's own calls, alive now and at most."""

    def __init__(self):
        super().__init__()
        self.cursor, self.live, self.peak, self.allocs, self.keys = None, 0, 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.cursor is None or self.cursor.busy:
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        # autograd sums a leaf's gradient contributions out of place while any dispatch mode is on
        # (``isTensorSubclassLike``), in place without one: that sum is counted as if in place
        summed = (func is torch.ops.aten.add.Tensor and self.cursor.phase == "backward" and len(tensors) == 2
                  and tensors[0].shape == tensors[1].shape)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes and ptr not in inputs and ptr not in self.keys:  # a new storage (not a view, not in place)
                self.keys.add(ptr)
                self.allocs += 1
                self.live += nbytes
                self.peak = max(self.peak, self.live - (nbytes if summed else 0))
                weakref.finalize(st, self._freed, ptr, nbytes)
        return out

    def _freed(self, ptr, nbytes):
        self.keys.discard(ptr)
        self.live -= nbytes


def profile_activations(step, state, batch) -> Activations:
    """Measures the model's own bytes at every point of ``step``'s program on ``batch`` (see
    [Note: measuring activations on one device]); pass the result to ``step.lower(activations=...)``.

    Runs ``step``'s forward and backward (no optimizer update: ``state`` is left as it is), twice
    when the step has not learnt its schedule yet. Build ``step`` like the one to lower but on one
    device (``make_units(model, world_size=1)``, the same per-rank batch, loss, policy and
    checkpointing): the world size does not change what the model allocates.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        >>> units = fsdp.make_units(model, world_size=1, groups=["0", "2"])
        >>> loss = lambda p, x: torch.func.functional_call(model, p, (x,)).square().mean()
        >>> def run(comm):
        ...     opt = rg.optim.sgd(0.1)
        ...     step = fsdp.make_step(units, loss, opt, comm)
        ...     return rg.predict.profile_activations(step, fsdp.init(units, model, opt, comm), torch.ones(32, 16))
        >>> (act,) = rg.collectives.simulate(1, run)
        >>> act.saved >= 32 * 64 * 4, len(act.forward) == len(act.schedule.forward)   # tanh's output is saved
        (True, True)
    """
    vg = step.value_and_grad
    if vg.memo.schedule.learning:
        vg.compute(state.shards, batch)
    sched = vg.memo.schedule
    n = len(sched.forward)
    fwd, bwd, events = [0] * n, [[0, -1] for _ in range(n)], [0] * (n + 1)  # -1: no buffer taken
    counter = _Counter()
    at = {"span": None, "event": n + 1, "saved": 0, "allocs": 0}

    def close():
        span = at["span"]
        if span is not None:
            if span[0] == "forward":
                fwd[span[1]] = max(fwd[span[1]], counter.peak)
            else:
                bwd[span[1]][span[2]] = max(bwd[span[1]][span[2]], counter.peak)
        counter.peak, at["allocs"] = counter.live, counter.allocs

    def probe(event, unit, cursor):
        counter.cursor = cursor
        if event == "enter":
            if at["event"] <= n:  # a new micro-batch
                at["event"] = n + 1
            c = at["span"][1] + 1 if at["span"] is not None and at["span"][0] == "forward" else 0
            close()
            at["span"] = ("forward", c)
        elif event == "event":
            close()
            if at["event"] == n + 1:
                at["saved"] = max(at["saved"], counter.live)
            at["event"] -= 1
            e = at["event"]
            events[e] = max(events[e], counter.live)
            at["span"] = ("backward", e - 1, 0) if e >= 1 else None
        elif event in ("grad_buffer", "gather_start") and at["span"] is not None and at["span"][0] == "backward" and (
                at["span"][2] == 0 and counter.allocs > at["allocs"]):  # the first runtime action inside the segment
            close()
            at["span"] = ("backward", at["span"][1], 1)

    traced = dataclasses.replace(vg, trace=probe)
    with counter:
        traced.compute(state.shards, batch)
    close()
    backward = tuple((a, b if b >= 0 else a) for a, b in bwd)
    return Activations(schedule=sched, forward=tuple(fwd), backward=backward, events=tuple(events), saved=at["saved"])
