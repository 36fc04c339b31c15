"""FSDP x TP / EP with multi-buffer FSDP plans (simulated 2x2 and 2x2x2 meshes, float64): the
same training as single-process, layouts round trip, norms count each element once, and
checkpoints go through multi-buffer global plans."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import parallel, spec
from tests.parallel._cases import STEPS, batches_per_step, init_params, init_specs, mesh_names, mesh_train, reference_train

TOL = dict(rtol=1e-10, atol=1e-12)


def _close(got, want, **tol):
    for a, b in zip(rg.pytree.leaves(got), rg.pytree.leaves(want), strict=True):
        torch.testing.assert_close(a, b.detach(), **(tol or TOL))


def _split(mplan):
    """The mesh plan with its FSDP plan in one buffer per leaf (reversed): several buffers."""
    plan = rg.testing.with_buffers(mplan.plan, [[l.path] for l in reversed(mplan.plan.leaves)])
    assert plan.num_buffers > 1
    return mplan.replace(plan=plan)


def _train(mc, kind, mplan):
    shards, _, losses = mesh_train(kind, mc, mplan, STEPS)
    return parallel.full_params(mplan, shards, mc), losses


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_training_on_multi_buffer_mesh_plans_equals_single_process(kind):
    mplan = _split(spec.make_mesh_plan(init_params(kind), init_specs(kind), mesh=spec.Mesh((2, 2), mesh_names(kind))))
    out = parallel.simulate_mesh(mplan.mesh, _train, kind, mplan)
    ref, _, ref_losses = reference_train(kind, STEPS, n_batches=batches_per_step(kind, mplan.mesh))
    for full, losses in out:
        _close(full, ref)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)


def _mixed():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    params = {"qkv": r(3 * 16, 8), "o": r(8, 16), "experts": r(4, 8, 8), "bias": r(16), "norm": r(8)}
    specs = {
        "qkv": {"dp": spec.Blocks(4, 8), "tp": spec.Shard(0, groups=3)},
        "o": {"dp": spec.Rows(2), "tp": spec.Shard(1)},
        "experts": {"dp": spec.Blocks(4, 4), "tp": spec.Shard(2), "ep": spec.Shard(0)},
        "bias": {"tp": spec.Shard(0), "ep": spec.Shard(0)},
        "norm": {"dp": spec.Replicate()},
    }
    return params, specs


def _roundtrip(mc, mplan, params, gplan):
    d = rg.shard(mplan, params, mc)
    local = rg.gather(mplan, d, mc)
    same_local = all(torch.equal(a, b) for a, b in zip(rg.pytree.leaves(local),
                                                       rg.pytree.leaves(parallel.parts(mplan, params, mc.coords))))
    g = parallel.to_global(mplan, d, mc, plan=gplan)
    same_global = torch.equal(g.data, rg.shard(gplan, params, rank=mc.world.rank).data)
    back = parallel.from_global(mplan, g, mc)
    norm = rg.global_norm(mplan, d, mc)
    return (parallel.full_params(mplan, d, mc), same_local, same_global,
            torch.equal(back.data, d.data) and torch.equal(back.replicated, d.replicated), norm)


@pytest.mark.parametrize("global_buffers", [1, "leaf"])
def test_layouts_round_trip_through_multi_buffer_plans_2x2x2(global_buffers):
    params, specs = _mixed()
    mesh = spec.Mesh((2, 2, 2), ("dp", "tp", "ep"))
    mplan = _split(spec.make_mesh_plan(params, specs, mesh=mesh))
    gplan = parallel.global_plan(mplan)
    if global_buffers == "leaf":
        gplan = rg.testing.with_buffers(gplan, [[l.path] for l in gplan.leaves])
    want = torch.sqrt(sum(torch.sum(t ** 2) for t in rg.pytree.leaves(params)))
    for full, same_local, same_global, back, norm in parallel.simulate_mesh(mesh, _roundtrip, mplan, params, gplan):
        _close(full, params, rtol=0, atol=0)
        assert same_local and same_global and back
        torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)


def test_make_mesh_plan_passes_max_buffers():
    """TP-local shapes planned with max_buffers: never more padding than one buffer."""
    from ragged._models import model_units

    layer = next(u for u in model_units("llama3-70b") if u.kind == "layer").params
    col, row = {"tp": spec.Shard(0)}, {"tp": spec.Shard(1)}
    specs = {k: (row if ("o_proj" in k or "down_proj" in k) else col) if v.dim() == 2 else None for k, v in layer.items()}
    mesh = spec.Mesh((256, 8), ("dp", "tp"))
    one = spec.make_mesh_plan(layer, specs, mesh=mesh)
    auto = spec.make_mesh_plan(layer, specs, mesh=mesh, max_buffers="auto")
    assert auto.plan.num_buffers > 1 and auto.plan.padding < one.plan.padding
    assert auto.plan.overhead <= 0.02


def _save(mc, kind, mplan, path):
    shards, opt_state, _ = mesh_train(kind, mc, mplan, 2)
    rg.checkpoint.save(path, parallel.to_global(mplan, {"params": shards, "opt": opt_state}, mc), mc.world)
    return parallel.full_params(mplan, shards, mc)


def _load(mc, kind, mplan, path):
    gplan = rg.testing.with_buffers(parallel.global_plan(mplan))  # a multi-buffer global plan
    zero = rg.DBuffer(data=torch.zeros(gplan.shard_size, dtype=gplan.dtype), replicated=torch.zeros(0, dtype=gplan.dtype),
                      plan=gplan, rank=mc.world.rank)
    state = parallel.from_global(mplan, rg.checkpoint.load(path, {"params": zero, "opt": rg.optim.adamw(0.0).init(zero)},
                                                           mc.world), mc)
    return parallel.full_params(mplan, state["params"], mc)


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_checkpoint_of_a_multi_buffer_mesh_run_loads_on_single_buffer_and_back(kind, tmp_path):
    path = str(tmp_path / "ckpt")
    mesh = spec.Mesh((2, 2), mesh_names(kind))
    many = _split(spec.make_mesh_plan(init_params(kind), init_specs(kind), mesh=mesh))
    saved = parallel.simulate_mesh(mesh, _save, kind, many, path)
    one = spec.make_mesh_plan(init_params(kind), init_specs(kind), mesh=mesh)
    for plan in (one, many):
        for full in parallel.simulate_mesh(mesh, _load, kind, plan, path):
            _close(full, saved[0], rtol=0, atol=0)
