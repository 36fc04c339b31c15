"""The transient memory of a lowered step, point by point (see [Note: lowering a step] in
``ragged/fsdp/_lower.py``): the program's gathers, frees and reduce-scatters walked in the
runtime's order."""

from __future__ import annotations

from ragged.fsdp._lower import _itemsize

__all__ = ["timeline"]


def timeline(lowered, *, early: bool = False):
    """The step's transient memory, point by point: ``(points, peaks)``, ``points`` a list of
    ``(unit, phase, parts)`` where ``parts`` are the bytes alive by kind right after that
    point's actions (see [Note: lowering a step]). ``early``: every reduce-scatter is done by
    the next point (the least memory the runtime can reach); default: waited only when
    ``max_inflight_reduce`` forces it (the most)."""
    step, prog, sched, lays = lowered.step, lowered.program, lowered.schedule, lowered.layouts
    n, k, inflight = len(sched.forward), step.micro_batches, step.value_and_grad.max_inflight_reduce
    act = lowered.activation_bytes or 0
    lazy = {u for u in range(len(lays)) if sched.forward.count(u) > 1}
    live = {"gathered": 0, "grad_buffers": 0, "reduce_copies": 0, "grad_shards": 0, "activations": 0}
    alive, grads, pending, shards_done = set(), set(), [], set()
    out, peaks = [], {"gathered": 0, "grad_buffers": 0}

    def note(unit, phase):
        out.append((lays[unit].name if unit is not None else "-", phase, dict(live)))
        peaks["gathered"] = max(peaks["gathered"], live["gathered"])
        peaks["grad_buffers"] = max(peaks["grad_buffers"], live["grad_buffers"])

    def rdtype(i):  # the reduce-scatter's dtype: the policy's, else the plan's (master) dtype
        return lays[i].reduce_dtype or lays[i].grad_plan.dtype

    def cast(i):  # the flat gradient (compute dtype) is copied into the reduce dtype
        return rdtype(i) != lays[i].dtype

    def rcopy(i):
        return lays[i].grad_plan.buffer_numel * _itemsize(rdtype(i)) if cast(i) else 0

    def gather(i):
        if i not in alive:
            alive.add(i)
            live["gathered"] += lays[i].nbytes

    def free(i):
        if i in alive:
            alive.discard(i)
            live["gathered"] -= lays[i].nbytes

    def finish_oldest():
        i = pending.pop(0)
        if cast(i):
            live["reduce_copies"] -= rcopy(i)
        else:
            live["grad_buffers"] -= lays[i].grad_nbytes
        if i not in shards_done:
            shards_done.add(i)
            gp = lays[i].grad_plan
            live["grad_shards"] += (gp.shard_size + gp.replicated_numel) * _itemsize(gp.dtype)

    def reduce(i, phase):
        if i not in grads:  # a unit whose gradients never reached a buffer: the runtime takes one now
            grads.add(i)
            live["grad_buffers"] += lays[i].grad_nbytes
        grads.discard(i)
        if cast(i):
            live["grad_buffers"] -= lays[i].grad_nbytes
            live["reduce_copies"] += rcopy(i)
        pending.append(i)
        note(i, phase)
        while len(pending) > inflight:
            finish_oldest()

    def settle():
        while early and pending:
            finish_oldest()

    def grad_buffer(i):
        settle()
        if lays[i].grad_plan is not None and i not in grads:
            grads.add(i)
            live["grad_buffers"] += lays[i].grad_nbytes

    for mb in range(k):
        tag = f" (micro-batch {mb})" if k > 1 else ""
        for c, (frees, gathers) in enumerate(prog.forward):
            for i in frees:
                free(i)
            for i in gathers:
                gather(i)
            live["activations"] += act / n if n else 0
            note(sched.forward[c], f"forward entry {c}{tag}")
        first_grad = {}
        for s in range(n - 1, -1, -1):
            for i in sorted({sched.forward[s]} | set(sched.needs[s])):
                first_grad.setdefault(i, s)
        for e in range(n, -1, -1):
            settle()
            reduces, frees, gathers = prog.backward[e]
            for i in reduces:
                reduce(i, f"backward event {e}{tag}")
            for i in frees:
                free(i)
            for i in lazy:
                if sched.reduce_at[i] + 1 == e:
                    grad_buffer(i)
            for i in gathers:
                gather(i)
            if e == n:
                for i in prog.start_prefetch:
                    gather(i)
            if e >= 1:  # segment e - 1 computes: its units' first gradients take their buffers
                for i, s in first_grad.items():
                    if s == e - 1 and i not in lazy:
                        grad_buffer(i)
                note(sched.forward[e - 1], f"backward segment {e - 1}{tag}")
                live["activations"] -= act / n
        for i in prog.end:
            reduce(i, f"after backward{tag}")
        for i in list(alive):
            free(i)
    while pending:
        finish_oldest()
    note(None, "end of backward")
    return out, peaks
