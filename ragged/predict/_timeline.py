"""A lowered step walked in the runtime's order (see [Note: lowering a step] in ``ragged/predict/_lower.py``):
:func:`walk` yields the program's actions, once for every consumer; :func:`timeline` turns them into
the transient memory, point by point (``_time.py`` into a step time)."""

from __future__ import annotations

__all__ = ["walk", "timeline"]


def walk(lowered):
    """The program's actions in the runtime's order, per micro-batch ``mb``: ``("gather", i)``,
    ``("free", i)``, ``("reduce", i, where)``, ``("grad_buffer", i)`` (unit ``i``'s first gradient
    takes its flat buffer), ``("forward", c, mb)`` (entry ``c`` computes), ``("backward", s, mb)``
    (segment ``s`` computes; what follows it up to the next event happens once the segment has
    started: the first gradients take their buffers, the loss's segment issues the start prefetch),
    ``("event", e)`` (backward event ``e`` is processed next) and ``("end",)``."""
    step, prog, sched = lowered.step, lowered.program, lowered.schedule
    n = len(sched.forward)
    lazy = {u for u in range(len(lowered.layouts)) if sched.forward.count(u) > 1}
    first_grad = {}
    for s in range(n - 1, -1, -1):
        for i in sorted({sched.forward[s]} | set(sched.needs[s])):
            first_grad.setdefault(i, s)
    trains = {lay.index for lay in lowered.layouts if lay.grad_plan is not None}
    for mb in range(step.micro_batches):
        tag = f" (micro-batch {mb})" if step.micro_batches > 1 else ""
        for c, (frees, gathers) in enumerate(prog.forward):
            yield from (("free", i) for i in frees)
            yield from (("gather", i) for i in gathers)
            yield ("forward", c, mb)
        for e in range(n, -1, -1):
            yield ("event", e)
            reduces, frees, gathers = prog.backward[e]
            yield from (("reduce", i, f"backward event {e}{tag}") for i in reduces)
            yield from (("free", i) for i in frees)
            yield from (("grad_buffer", i) for i in sorted(lazy & trains) if sched.reduce_at[i] + 1 == e)
            yield from (("gather", i) for i in gathers)
            if e >= 1:
                yield ("backward", e - 1, mb)
                yield from (("gather", i) for i in (prog.start_prefetch if e == n else ()))  # once backward reaches the model
                yield from (("grad_buffer", i) for i, s in first_grad.items() if s == e - 1 and i not in lazy and i in trains)
        yield from (("reduce", i, f"after backward{tag}") for i in prog.end)
        yield from (("free", i) for i in range(len(lowered.layouts)))
    yield ("end",)


def timeline(lowered, *, early: bool = False):
    """The step's transient memory, point by point: ``(points, peaks)``, ``points`` a list of
    ``(unit, phase, parts)`` where ``parts`` are the bytes alive by kind at that point (see
    [Note: lowering a step]): after a forward entry's gathers, while it computes; in a backward
    segment before and after the runtime first acts inside it; at a reduce-scatter
    (``activations``: the model's own bytes there, from ``lowered.activations``). ``early``: every reduce-scatter is done
    by the next point (the least memory the runtime can reach); default: waited only when
    ``max_inflight_reduce`` forces it (the most)."""
    step, sched, lays, act = lowered.step, lowered.schedule, lowered.layouts, lowered.activations
    inflight = step.value_and_grad.max_inflight_reduce
    live = {"gathered": 0, "grad_buffers": 0, "reduce_copies": 0, "grad_shards": 0, "activations": 0}
    alive, grads, pending, shards_done = set(), set(), [], set()
    out, peaks = [], {"gathered": 0, "grad_buffers": 0}

    def note(unit, phase, model=None):
        if model is not None:
            live["activations"] = model
        out.append((lays[unit].name if unit is not None else "-", phase, dict(live)))
        peaks["gathered"] = max(peaks["gathered"], live["gathered"])
        peaks["grad_buffers"] = max(peaks["grad_buffers"], live["grad_buffers"])

    def rcopy(i):  # the flat gradient (compute dtype) copied into the reduce dtype (the policy's, else the master's)
        dt = lays[i].reduce_dtype or lays[i].grad_plan.dtype
        return lays[i].grad_plan.buffer_numel * dt.itemsize if dt != lays[i].dtype else 0

    def finish_oldest():
        i = pending.pop(0)
        if rcopy(i):
            live["reduce_copies"] -= rcopy(i)
        else:
            live["grad_buffers"] -= lays[i].grad_nbytes

    def settle():
        while early and pending:
            finish_oldest()

    def take(i):
        if i not in grads:
            grads.add(i)
            live["grad_buffers"] += lays[i].grad_nbytes

    k, post = step.micro_batches, None
    for action, *args in walk(lowered):
        if post is not None and action not in ("grad_buffer", "gather"):  # the segment once those are in
            note(*post)
            post = None
        if action == "gather" and args[0] not in alive:
            alive.add(args[0])
            live["gathered"] += lays[args[0]].nbytes
        elif action == "free" and args[0] in alive:
            alive.discard(args[0])
            live["gathered"] -= lays[args[0]].nbytes
        elif action == "event":
            settle()
            if act:
                live["activations"] = act.events[args[0]]
        elif action == "reduce":
            i, where = args
            take(i)  # a unit whose gradients never reached a buffer: the runtime takes one now
            grads.discard(i)
            if rcopy(i):
                live["grad_buffers"] -= lays[i].grad_nbytes
                live["reduce_copies"] += rcopy(i)
            pending.append(i)
            if i not in shards_done:  # the reduce-scatter's output, from its start
                shards_done.add(i)
                gp = lays[i].grad_plan
                live["grad_shards"] += (gp.shard_size + gp.replicated_numel) * gp.dtype.itemsize
            note(i, where)
            while len(pending) > inflight:
                finish_oldest()
        elif action == "grad_buffer":
            settle()
            take(args[0])
        elif action in ("forward", "backward"):
            c, mb = args
            where = f"{action} {'entry' if action == 'forward' else 'segment'} {c}" + (f" (micro-batch {mb})" if k > 1 else "")
            model = (None, None) if act is None else (act.forward[c], None) if action == "forward" else act.backward[c]
            note(sched.forward[c], where, model[0])
            if action == "backward":
                post = (sched.forward[c], where + ", gradients in", model[1])
    while pending:
        finish_oldest()
    note(None, "end of backward")
    return out, peaks
