"""FSDP x TP and FSDP x EP on 4 real gloo ranks (2x2 DeviceMeshes), against float64
single-process training computed in the test process; a TP MLP written with DTensor through
``parallel.to_dtensor``; checkpoints of a 2x2 run loaded on 4x1 (gloo) and 1x1 (this process).

Workers are started once for the module (tests/distributed/_harness.py).
"""

from __future__ import annotations


import pytest
import torch

import ragged as rg
from ragged import parallel, spec
from tests.distributed._harness import both_transports, workers_fixture
from tests.distributed._harness import transport as transport_options

from tests.parallel._cases import (
    STEPS,
    batches_per_step,
    ep_fsdp_step_train,
    init_params,
    init_specs,
    mesh_names,
    mesh_train,
    reference_train,
)

pytestmark = pytest.mark.distributed

workers4 = workers_fixture(4)
transport_fixture = both_transports()
TOL = dict(rtol=1e-10, atol=1e-12)
_MESHES: dict = {}


def _mcomm(shape, names):
    """A cached MeshComm over init_device_mesh("cpu", shape, names) (collective on first use)."""
    options = transport_options()
    key = (tuple(shape), tuple(names), tuple(sorted(options.items())))
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = parallel.from_device_mesh(init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names)),
                                                 **options)
    return _MESHES[key]


def _mplan(kind, shape=(2, 2)):
    return spec.make_mesh_plan(init_params(kind), init_specs(kind), mesh=spec.Mesh(shape, mesh_names(kind)))


def _close_trees(got, want):
    got_l, want_l = rg.pytree.leaves(got), rg.pytree.leaves(want)
    assert len(got_l) == len(want_l)
    for a, b in zip(got_l, want_l):
        torch.testing.assert_close(a, b.detach(), **TOL)


# ---- bodies (module level: pickled to the workers) ---------------------------------------------
def _train(kind, steps):
    mc = _mcomm((2, 2), mesh_names(kind))
    mplan = _mplan(kind)
    shards, _, losses = mesh_train(kind, mc, mplan, steps)
    return parallel.full_params(mplan, shards, mc), losses


def _strided_to_dtensor_refused():
    mc = _mcomm((2, 2), mesh_names("tp"))
    mplan = _mplan("tp")
    local = rg.gather(mplan, rg.shard(mplan, init_params("tp"), mc), mc)
    try:
        parallel.to_dtensor(mplan, local, mc.device_mesh)
    except ValueError as e:
        return str(e)
    return None


def _save(kind, path):
    mc = _mcomm((2, 2), mesh_names(kind))
    mplan = _mplan(kind)
    shards, opt_state, _ = mesh_train(kind, mc, mplan, 2)
    rg.checkpoint.save(path, parallel.to_global(mplan, {"params": shards, "opt": opt_state}, mc), mc.world)
    return parallel.full_params(mplan, shards, mc)


def _resume_4x1(kind, path):
    mc = _mcomm((4, 1), mesh_names(kind))
    mplan = _mplan(kind, (4, 1))
    shards = rg.shard(mplan, init_params(kind), mc)
    like = {"params": shards, "opt": rg.optim.adamw(0.0).init(shards)}
    state = rg.checkpoint.load(path, like, mc.world)
    shards, _, _ = mesh_train(kind, mc, mplan, 1, shards=state["params"], opt_state=state["opt"], start=2)
    return parallel.full_params(mplan, shards, mc)


def _global_norm(kind):
    mc = _mcomm((2, 2), mesh_names(kind))
    mplan = _mplan(kind)
    return rg.global_norm(mplan, rg.shard(mplan, init_params(kind), mc), mc)


def _ep_step(steps, clip=None):
    return ep_fsdp_step_train(_mcomm((2, 2), mesh_names("ep")), steps, clip=clip)


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tp", "ep", "dt"], ids=["fsdp_x_tp", "fsdp_x_ep", "fsdp_x_tp_dtensor"])
def test_training_equals_single_process(workers4, kind):
    out = workers4.run(_train, kind, STEPS)
    mesh = spec.Mesh((2, 2), mesh_names(kind))
    ref, _, ref_losses = reference_train(kind, STEPS, n_batches=batches_per_step(kind, mesh))
    for full, losses in out:
        _close_trees(full, ref)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert any(not torch.allclose(a, b) for a, b in zip(rg.pytree.leaves(out[0][0]), rg.pytree.leaves(init_params(kind))))


def test_to_dtensor_refuses_strided_shard(workers4):
    messages = workers4.run(_strided_to_dtensor_refused)
    assert all(m is not None and "Shard(0, groups=2)" in m and "['blocks'][0]['b13']" in m for m in messages)


@pytest.mark.parametrize("kind", ["tp", "ep"], ids=["fsdp_x_tp", "fsdp_x_ep"])
def test_checkpoint_2x2_loads_on_4x1_and_1x1(workers4, kind, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = workers4.run(_save, kind, path)
    n22 = batches_per_step(kind, spec.Mesh((2, 2), mesh_names(kind)))
    ref2, opt, _ = reference_train(kind, 2, n_batches=n22)
    _close_trees(saved[0], ref2)
    # 1x1: this process alone
    mp11 = _mplan(kind, (1, 1))
    shards = rg.shard(mp11.plan, init_params(kind), rank=0)
    loaded = rg.checkpoint.load(path, {"params": shards, "opt": rg.optim.adamw(0.0).init(shards)}, rg.checkpoint.SingleProcess())
    _close_trees(rg.unflatten(mp11.plan, loaded["params"].data, loaded["params"].replicated), ref2)
    # 4x1 on the same 4 gloo ranks, continuing one step
    got = workers4.run(_resume_4x1, kind, path)
    want = reference_train(kind, 1, n_batches=batches_per_step(kind, spec.Mesh((4, 1), mesh_names(kind))),
                           params=ref2, opt=opt, start=2)[0]
    for full in got:
        _close_trees(full, want)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["adamw", "clip-sgd"])
def test_fsdp_make_step_with_expert_parallelism(workers4, clip):
    """FSDP x EP through rg.fsdp.make_step(data_axes=parallel.data_groups(...)) on 4 gloo
    ranks (2x2 DeviceMesh) equals float64 single-process torch.optim.AdamW; with global-norm
    clipping over the whole mesh (rg.global_norm(units, ...)), torch's clip_grad_norm_ + SGD."""
    out = workers4.run(_ep_step, STEPS, clip)
    ref, _, ref_losses = reference_train("ep", STEPS, n_batches=batches_per_step("ep", spec.Mesh((2, 2), ("dp", "ep"))),
                                         clip=clip)
    for local, losses, coords, mplan in out:
        _close_trees(local, parallel.parts(mplan, ref, coords))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)


@pytest.mark.parametrize("kind", ["tp", "ep"], ids=["fsdp_x_tp", "fsdp_x_ep"])
def test_global_norm_counts_every_global_element_once(workers4, kind):
    want = torch.sqrt(sum(torch.sum(t.double() ** 2) for t in rg.pytree.leaves(init_params(kind))))
    for got in workers4.run(_global_norm, kind):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
