"""Non-finite gradients on one rank, shared by the simulated and the gloo tests: every rank takes
the same decision, skipped steps change nothing (bit for bit), applied steps equal
``torch.optim.AdamW`` on the unsharded parameters in float64."""

from __future__ import annotations

import torch

import ragged as rg
from ragged import spec

SPECS = {"w": spec.Rows(1), "b": spec.Elements(1), "g": spec.Replicate()}
LR, WD = 0.05, 0.1
# Schedules: per step, where a non-finite value goes ("shard": an element rank 1 holds,
# "replicated": the replicated leaf on rank 1 only) or None, and max_consecutive_errors.
# "skip": every non-finite step is skipped (two in a row, within the limit of 2); "through": the
# second non-finite step in a row exceeds the limit of 1 and is applied anyway (optax's rule).
SCHEDULES = {
    "skip": ([None, "shard", None, "replicated", "shard", None], 2),
    "through": ([None, "shard", "replicated"], 1),
}


def params():
    g = torch.Generator().manual_seed(0)
    p = {
        "w": torch.randn(6, 4, generator=g, dtype=torch.float64),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "g": torch.randn(3, generator=g, dtype=torch.float64),
    }
    p["w"][0, 0] = -0.0  # a skipped update must keep the sign of zero
    return p


def grads(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in params().items()}


def poisoned_rank(world_size: int) -> int:
    return min(1, world_size - 1)


def _poison(plan, local: rg.DBuffer, where, value=float("nan")) -> rg.DBuffer:
    """``local`` with one non-finite value on rank 1 (rank 0 of one rank) (a copy)."""
    data, rep = local.data.clone(), local.replicated.clone()
    if local.rank == poisoned_rank(plan.world_size):
        if where == "shard":
            piece = plan.local_pieces(local.rank)[0]
            data[piece.local_offset] = value
        else:
            leaf = plan.replicated[0]
            rep[leaf.offset] = value
    return local.replace(data=data, replicated=rep)


def run_apply_if_finite(comm, schedule: str):
    """Runs a schedule with apply_if_finite(adamw); returns per step the decision, the
    state counters and whether a skipped step left params and inner state bit-identical, and
    the final gathered params (padding checked zero)."""
    plan = rg.make_plan(params(), SPECS, world_size=comm.world_size)
    local = rg.shard(plan, params(), comm)
    poison, limit = SCHEDULES[schedule]
    opt = rg.optim.apply_if_finite(rg.optim.adamw(LR, weight_decay=WD), limit, comm=comm)
    state = opt.init(local)
    steps = []
    for t, where in enumerate(poison):
        g = rg.shard(plan, grads(t), comm)
        if where:
            g = _poison(plan, g, where, float("nan") if t % 2 else float("inf"))
        before = (local.data.clone(), local.replicated.clone(), [x.clone() for x in rg.pytree.leaves(state.inner_state)])
        updates, state = opt.update(g, state, local)
        local = rg.apply_updates(local, updates)
        unchanged = (
            torch.equal(local.data, before[0]) and torch.equal(local.replicated, before[1])
            and torch.equal(torch.signbit(local.data), torch.signbit(before[0]))
            and all(torch.equal(a, b) for a, b in zip(rg.pytree.leaves(state.inner_state), before[2]))
        )
        steps.append((bool(state.last_finite), int(state.notfinite_count), int(state.total_notfinite), unchanged))
    full = rg.pytree.map(lambda t: t.detach().clone(), rg.gather(local, comm))
    return {"steps": steps, "params": full, "finite": bool(torch.isfinite(local.data).all() and torch.isfinite(local.replicated).all())}


def reference_apply_if_finite(schedule: str):
    """torch.optim.AdamW on the unsharded params, taking exactly the steps apply_if_finite applies
    with finite gradients; ``None`` once a non-finite step was applied (NaN everywhere)."""
    p = {k: v.clone().requires_grad_(True) for k, v in params().items()}
    opt = torch.optim.AdamW(list(p.values()), lr=LR, weight_decay=WD, eps=1e-8)
    poison, limit = SCHEDULES[schedule]
    consecutive = 0
    for t, where in enumerate(poison):
        consecutive = consecutive + 1 if where else 0
        if where and consecutive <= limit:
            continue
        if where:
            return None
        for k, v in p.items():
            v.grad = grads(t)[k]
        opt.step()
    return {k: v.detach() for k, v in p.items()}


def expected_counters(schedule: str):
    """optax's ApplyIfFiniteState counters ``(last_finite, notfinite_count, total_notfinite)``
    after each step, and whether the step was skipped."""
    poison, limit = SCHEDULES[schedule]
    out, consecutive, total = [], 0, 0
    for where in poison:
        consecutive = consecutive + 1 if where else 0
        total += bool(where)
        out.append((where is None, consecutive, total, bool(where) and consecutive <= limit))
    return out


def run_clip_nonfinite(comm, where):
    """clip_by_global_norm(error_if_nonfinite=True) then adamw with a NaN on rank 1 only
    (``where``: "shard" / "replicated" / None); returns ``(error type, message or None, params
    unchanged)`` on this rank, or the clipped update's norm when nothing is raised."""
    plan = rg.make_plan(params(), SPECS, world_size=comm.world_size)
    local = rg.shard(plan, params(), comm)
    opt = rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=comm, error_if_nonfinite=True), rg.optim.adamw(LR))
    state = opt.init(local)
    g = rg.shard(plan, grads(0), comm)
    if where:
        g = _poison(plan, g, where)
    before = local.data.clone()
    try:
        updates, state = opt.update(g, state, local)
        local = rg.apply_updates(local, updates)
    except rg.RaggedError as exc:
        return type(exc).__name__, str(exc), torch.equal(local.data, before)
    return None, float(rg.optim.tree_norm(local, comm=comm)), False


def check_apply_if_finite(results, schedule):
    """Every rank took the reference's decisions; skipped steps changed nothing."""
    expected = expected_counters(schedule)
    for r in results:
        assert [s[:3] for s in r["steps"]] == [e[:3] for e in expected]
        for (_, _, _, unchanged), (_, _, _, skipped) in zip(r["steps"], expected):
            assert unchanged == skipped
    ref = reference_apply_if_finite(schedule)
    if ref is None:  # a step past the limit was applied: the NaN reached the params, as in optax
        assert not results[poisoned_rank(len(results))]["finite"]
        return
    for r in results:
        assert r["finite"]
        for k in ref:
            torch.testing.assert_close(r["params"][k], ref[k], rtol=1e-12, atol=1e-12)


def check_clip_nonfinite(results, where):
    if where is None:
        assert all(r[0] is None for r in results)
        assert len({r[1] for r in results}) == 1  # the same parameters on every rank
        return
    for rank, (name, message, unchanged) in enumerate(results):
        assert name == "NonFiniteError" and unchanged
        assert "the global norm of the gradients is not finite" in message
        if rank == 1:
            leaf = "['w']" if where == "shard" else "['g']"
            assert f"non-finite on this rank: {leaf}" in message, message
        else:
            assert "this rank's gradients are finite (another rank's are not)" in message
