"""FSDP x TP and FSDP x EP on simulated 2x2 (and 2x2x2) meshes against float64 single-process
training; layout round trips; checkpoints of a 2x2 run loaded on 4x1, 1x1 and 2x2.

The same bodies run on 4 real gloo ranks in tests/distributed/test_parallel_gloo.py.
"""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import parallel, spec
from tests._cuda_division import cuda_division
from tests.parallel._cases import (
    STEPS,
    batches_per_step,
    init_params,
    init_specs,
    mesh_names,
    mesh_train,
    reference_train,
)

TOL = dict(rtol=1e-10, atol=1e-12)


def _close_trees(got, want, **tol):
    got_l, want_l = rg.pytree.leaves(got), rg.pytree.leaves(want)
    assert len(got_l) == len(want_l)
    for a, b in zip(got_l, want_l):
        torch.testing.assert_close(a, b.detach(), **(tol or TOL))


def _mplan(kind, shape=(2, 2)):
    mesh = spec.Mesh(shape, mesh_names(kind))
    return spec.make_mesh_plan(init_params(kind), init_specs(kind), mesh=mesh)


def _train_and_collect(mc, kind, mplan, steps):
    shards, _, losses = mesh_train(kind, mc, mplan, steps)
    return parallel.full_params(mplan, shards, mc), losses


@pytest.mark.parametrize("kind", ["tp", "ep"], ids=["fsdp_x_tp", "fsdp_x_ep"])
def test_training_equals_single_process(kind):
    mplan = _mplan(kind)
    out = parallel.simulate_mesh(mplan.mesh, _train_and_collect, kind, mplan, STEPS)
    ref, _, ref_losses = reference_train(kind, STEPS, n_batches=batches_per_step(kind, mplan.mesh))
    for full, losses in out:  # every rank reassembles the same global params
        _close_trees(full, ref)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    # the params moved: the comparison is not between two copies of the initial values
    assert any(not torch.allclose(a, b) for a, b in zip(rg.pytree.leaves(out[0][0]), rg.pytree.leaves(init_params(kind))))


def _ep_without_data_axis(mc, mplan):
    local = rg.gather(mplan, rg.shard(mplan, init_params("ep"), mc), mc)
    local = rg.pytree.map(lambda t: t.detach().requires_grad_(), local)
    from tests.parallel._cases import D, TOKENS, moe_batch, moe_loss_sum

    (moe_loss_sum(local, moe_batch(0, mc.rank), mc["ep"]) / (mc.mesh.size * TOKENS * D)).backward()
    grads = rg.pytree.map(lambda t: t.grad, local)
    with_ep = rg.reduce_scatter(mplan, grads, mc, op="sum", data_axes=("ep",))
    without = rg.reduce_scatter(mplan, grads, mc, op="sum")
    return rg.gather(mplan, with_ep, mc), rg.gather(mplan, without, mc)


def test_ep_data_axis_reduction_matters():
    """Leaves replicated on "ep" (router, norm, out) need the EP all-reduce; experts must not get it."""
    mplan = _mplan("ep")
    out = parallel.simulate_mesh(mplan.mesh, _ep_without_data_axis, mplan)
    with_ep, without = out[0]
    assert not torch.allclose(with_ep["router"], without["router"])
    assert not torch.allclose(with_ep["norm"], without["norm"])
    torch.testing.assert_close(with_ep["experts"]["w_in"], without["experts"]["w_in"], rtol=0, atol=0)


# ---- layouts -----------------------------------------------------------------------------------
def _mixed_params():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return {"qkv": r(3 * 16, 8), "o": r(8, 16), "experts": r(4, 8, 8), "bias": r(16), "norm": r(8)}


MIXED_SPECS = {
    "qkv": {"dp": spec.Blocks(4, 8), "tp": spec.Shard(0, groups=3)},
    "o": {"dp": spec.Rows(2), "tp": spec.Shard(1)},
    "experts": {"dp": spec.Blocks(4, 4), "tp": spec.Shard(2), "ep": spec.Shard(0)},
    "bias": {"tp": spec.Shard(0), "ep": spec.Shard(0)},  # two axes on one dim: tp outermost
    "norm": {"dp": spec.Replicate()},
}


def _roundtrip(mc, mplan, params):
    d = rg.shard(mplan, params, mc)
    local = rg.gather(mplan, d, mc)
    want_local = parallel.parts(mplan, params, mc.coords)
    for ml, a, b in zip(mplan.leaves, rg.pytree.leaves(local), rg.pytree.leaves(want_local)):
        assert torch.equal(a, b), ml.path
        # the strided bookkeeping: element i of the part is global element part_index[i]
        assert torch.equal(a.reshape(-1), rg.pytree.leaves(params)[ml.index].reshape(-1)[parallel.part_index(ml, mc.coords)])
    full = parallel.full_params(mplan, d, mc)
    back = parallel.from_global(mplan, parallel.to_global(mplan, d, mc), mc)
    return full, torch.equal(back.data, d.data) and torch.equal(back.replicated, d.replicated)


def test_shard_gather_full_params_roundtrip_2x2x2():
    params = _mixed_params()
    mesh = spec.Mesh((2, 2, 2), ("dp", "tp", "ep"))
    mplan = spec.make_mesh_plan(params, MIXED_SPECS, mesh=mesh)
    assert mplan.leaf("['qkv']").part_shape == (24, 8)
    assert mplan.leaf("['experts']").part_shape == (2, 8, 4)
    for full, same in parallel.simulate_mesh(mesh, _roundtrip, mplan, params):
        _close_trees(full, params, rtol=0, atol=0)
        assert same


def _norm(mc, mplan, params):
    return rg.global_norm(mplan, rg.shard(mplan, params, mc), mc)


@pytest.mark.parametrize("case", ["tp", "ep", "mixed_2x2x2"])
def test_global_norm_counts_every_global_element_once(case):
    """rg.global_norm(mplan, ...) of a sharded model equals the norm of its global tensors: TP/EP
    shards summed across ranks, replicated leaves counted once (strided, Replicate, 3 axes)."""
    if case == "mixed_2x2x2":
        params = _mixed_params()
        mplan = spec.make_mesh_plan(params, MIXED_SPECS, mesh=spec.Mesh((2, 2, 2), ("dp", "tp", "ep")))
    else:
        params, mplan = init_params(case), _mplan(case)
    want = torch.sqrt(sum(torch.sum(t.double() ** 2) for t in rg.pytree.leaves(params)))
    for got in parallel.simulate_mesh(mplan.mesh, _norm, mplan, params):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_strided_shard_keeps_q_k_v_apart():
    """Shard(0, groups=3) on a fused QKV weight: each TP rank holds its rows of Q, of K and of V."""
    w = torch.arange(12.0).view(12, 1)  # rows: Q = 0..3, K = 4..7, V = 8..11
    mp = spec.make_mesh_plan({"qkv": w}, {"qkv": {"tp": spec.Shard(0, groups=3)}}, mesh=spec.Mesh((1, 2), ("dp", "tp")))
    local = parallel.parts(mp, {"qkv": w}, {"dp": 0, "tp": 1})["qkv"].view(-1).tolist()
    assert local == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    assert parallel.part_index(mp.leaves[0], {"dp": 0, "tp": 1}).tolist() == [2, 3, 6, 7, 10, 11]


# ---- checkpoints -------------------------------------------------------------------------------
def _save_after(mc, kind, mplan, steps, path):
    shards, opt_state, _ = mesh_train(kind, mc, mplan, steps)
    state = parallel.to_global(mplan, {"params": shards, "opt": opt_state}, mc)
    rg.checkpoint.save(path, state, mc.world)
    return parallel.full_params(mplan, shards, mc)


def _like(mc, kind, mplan):
    shards = rg.shard(mplan, init_params(kind), mc)
    return {"params": shards, "opt": rg.optim.adamw(0.0).init(shards)}


def _resume_plain(mc, kind, mplan, path, start):
    """A mesh whose non-FSDP axes have size 1: its plan is a plain plan of the global shapes,
    so the checkpoint loads directly with rg.checkpoint.load."""
    state = rg.checkpoint.load(path, _like(mc, kind, mplan), mc.world)
    shards, _, _ = mesh_train(kind, mc, mplan, 1, shards=state["params"], opt_state=state["opt"], start=start)
    return parallel.full_params(mplan, shards, mc)


def _resume_mesh(mc, kind, mplan, path, start):
    """Back onto a 2x2 mesh: load into the global plan, then from_global."""
    gplan = parallel.global_plan(mplan)
    zero = rg.DBuffer(data=torch.zeros(gplan.shard_size, dtype=gplan.dtype), replicated=torch.zeros(0, dtype=gplan.dtype),
                      plan=gplan, rank=mc.world.rank)
    like = {"params": zero, "opt": rg.optim.adamw(0.0).init(zero)}
    state = parallel.from_global(mplan, rg.checkpoint.load(path, like, mc.world), mc)
    shards, _, _ = mesh_train(kind, mc, mplan, 1, shards=state["params"], opt_state=state["opt"], start=start)
    return parallel.full_params(mplan, shards, mc)


@pytest.mark.parametrize("kind", ["tp", "ep"], ids=["fsdp_x_tp", "fsdp_x_ep"])
def test_checkpoint_2x2_loads_on_4x1_1x1_2x2(kind, tmp_path):
    path = str(tmp_path / "ckpt")
    mp22 = _mplan(kind)
    saved = parallel.simulate_mesh(mp22.mesh, _save_after, kind, mp22, 2, path)
    n22 = batches_per_step(kind, mp22.mesh)
    ref2 = reference_train(kind, 2, n_batches=n22)[0]
    _close_trees(saved[0], ref2)

    def ref_continue(n_batches):  # 2 steps on the 2x2 batches, then 1 on the new mesh's
        params, opt, _ = reference_train(kind, 2, n_batches=n22)
        return reference_train(kind, 1, n_batches=n_batches, params=params, opt=opt, start=2)[0]

    # 4x1: plain FSDP over 4 ranks
    mp41 = _mplan(kind, (4, 1))
    got = parallel.simulate_mesh(mp41.mesh, _resume_plain, kind, mp41, path, 2)
    _close_trees(got[0], ref_continue(batches_per_step(kind, mp41.mesh)))
    # 1x1: one process, no mesh communication
    mp11 = _mplan(kind, (1, 1))
    shards = rg.shard(mp11.plan, init_params(kind), rank=0)
    like = {"params": shards, "opt": rg.optim.adamw(0.0).init(shards)}
    loaded = rg.checkpoint.load(path, like, rg.checkpoint.SingleProcess())
    _close_trees(rg.unflatten(mp11.plan, loaded["params"].data, loaded["params"].replicated), ref2)
    got = parallel.simulate_mesh(mp11.mesh, _resume_plain, kind, mp11, path, 2)
    _close_trees(got[0], ref_continue(1))
    # and back onto 2x2 through from_global
    got = parallel.simulate_mesh(mp22.mesh, _resume_mesh, kind, mp22, path, 2)
    _close_trees(got[0], ref_continue(batches_per_step(kind, mp22.mesh)))


# ---- composition with rg.fsdp.make_step ---------------------------------------------------------
def _tp_with_fsdp_step(mc, mplan):
    from ragged import fsdp
    from tests.parallel._cases import LR, WD, tp_batch, tp_loss, tp_params

    units = fsdp.make_units(mplan.part_meta(), world_size=mc["dp"].world_size,
                            groups=lambda p: p[:13] if "blocks" in p else "rest",
                            specs=lambda path, t: mplan.leaf(path).granularity)
    opt = rg.optim.adamw(LR, weight_decay=WD)
    state = fsdp.init(units, parallel.parts(mplan, tp_params(), mc.coords), opt, mc["dp"])
    step = fsdp.make_step(units, lambda params, batch: tp_loss(params, batch, mc["tp"]), opt, mc["dp"])
    losses = []
    for s in range(STEPS):
        state, metrics = step(state, tp_batch(s, mc.coords["dp"]))
        losses.append(metrics["loss"])
    return rg.gather(units, state.shards, mc["dp"]), losses, dict(mc.coords)


def test_fsdp_make_step_on_tp_local_units():
    """rg.fsdp units planned on mplan.part_meta() over mcomm["dp"], with TP collectives inside
    the loss: the overlapped FSDP step composes with TP unchanged."""
    from tests.parallel._cases import tp_params, tp_specs

    mplan = spec.make_mesh_plan(tp_params(), tp_specs(), mesh=spec.Mesh((2, 2), ("dp", "tp")))  # norms Replicate()
    out = parallel.simulate_mesh(mplan.mesh, _tp_with_fsdp_step, mplan)
    ref, _, ref_losses = reference_train("tp", STEPS, n_batches=2)
    for local, losses, coords in out:
        _close_trees(local, parallel.parts(mplan, ref, coords))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)


@pytest.mark.parametrize("data_axes", [("ep",), ()], ids=["with_ep_data_axis", "without"])
def test_fsdp_make_step_with_expert_parallelism(data_axes):
    """FSDP x EP through the overlapped step: equal to float64 single-process training when
    the router / norm / output gradients are all-reduced over "ep" (data_axes), and not without."""
    from tests.parallel._cases import ep_fsdp_step_train

    mesh = spec.Mesh((2, 2), ("dp", "ep"))
    out = parallel.simulate_mesh(mesh, ep_fsdp_step_train, STEPS, data_axes=data_axes)
    ref, _, ref_losses = reference_train("ep", STEPS, n_batches=batches_per_step("ep", mesh))
    for local, losses, coords, mplan in out:
        want = parallel.parts(mplan, ref, coords)
        if data_axes:
            _close_trees(local, want)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        else:
            assert not torch.allclose(local["router"], want["router"])


def test_fsdp_make_step_with_expert_parallelism_and_clipping():
    """Global-norm clipping under FSDP x EP: rg.global_norm(units, ...) over the data axes gives the norm
    of the whole model on every rank, so SGD after clipping equals torch's clip_grad_norm_ + SGD
    (the clip is active: far below the gradient norm)."""
    from tests.parallel._cases import ep_fsdp_step_train

    mesh = spec.Mesh((2, 2), ("dp", "ep"))
    out = parallel.simulate_mesh(mesh, ep_fsdp_step_train, STEPS, clip=0.05)
    ref, _, ref_losses = reference_train("ep", STEPS, n_batches=batches_per_step("ep", mesh), clip=0.05)
    for local, losses, coords, mplan in out:
        _close_trees(local, parallel.parts(mplan, ref, coords))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)


def _mean_vs_sum(mc, mplan):
    g = rg.pytree.map(lambda t: torch.randn(t.shape, dtype=t.dtype, generator=torch.Generator().manual_seed(mc.rank)),
                      mplan.part_meta())
    g = rg.pytree.map(lambda t: t.to(torch.float64), g)
    with cuda_division():  # the mean as a GPU would divide: see [Note: a division every device rounds alike]
        mean = rg.reduce_scatter(mplan, g, mc, op="mean", data_axes=("ep",))
    total = rg.reduce_scatter(mplan, g, mc, op="sum", data_axes=("ep",))
    return mean.data, total.data, mean.replicated, total.replicated


def test_reduce_scatter_mean_divides_by_fsdp_times_data_axes():
    """The mean is the sum over dp (3) and ep (2) divided by 6, correctly rounded on every device."""
    mplan = _mplan("ep", shape=(3, 2))
    for mean, total, rmean, rtotal in parallel.simulate_mesh(mplan.mesh, _mean_vs_sum, mplan):
        assert torch.equal(mean, total / 6) and torch.equal(rmean, rtotal / 6)
        assert total.abs().sum() > 0 and rtotal.abs().sum() > 0


def test_hsdp_x_tp_training_equals_single_process():
    """HSDP x TP on a 2x2x2 mesh: FSDP over "dp", replicas on "rep" (a data axis on which every
    leaf is replicated: one all-reduce of the whole shard), TP on "tp"."""
    from tests.parallel._cases import tp_params, tp_specs

    mesh = spec.Mesh((2, 2, 2), ("rep", "dp", "tp"))
    mplan = spec.make_mesh_plan(tp_params(), tp_specs(), mesh=mesh)
    out = parallel.simulate_mesh(mesh, _train_and_collect, "tp", mplan, STEPS)
    ref, _, ref_losses = reference_train("tp", STEPS, n_batches=batches_per_step("tp", mesh))
    assert batches_per_step("tp", mesh) == 4
    for full, losses in out:
        _close_trees(full, ref)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
