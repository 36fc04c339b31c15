"""Every optimizer on multi-buffer plans (simulated ranks, float64): the same parameters as on
the single-buffer plan of the same leaves, and as torch.optim on the whole batch.

Plans are split with ``rg.testing.with_buffers`` (one buffer per granule, or an explicit
partition), so every case really runs with several buffers whatever the padding would choose.
"""

import pytest
import torch

import ragged as rg
from tests.optim import _muon_cases
from tests.optim._engine_cases import CASES, SPECS, _adamw8_state, _ours, _params, _reference



def _split(plan, how):
    if how == "one":
        return plan
    if how == "granule":
        return rg.testing.with_buffers(plan)
    paths = [l.path for l in plan.leaves]  # one buffer per leaf, reversed
    return rg.testing.with_buffers(plan, [[p] for p in reversed(paths)])


def _train(comm, make_opt, how):
    plans = []

    def split(plan):
        plans.append(_split(plan, how))
        return plans[-1]

    return _ours(comm, make_opt, split), plans[0].num_buffers


MORE = {
    "adam": (lambda comm: rg.optim.adam(0.02), lambda ps: torch.optim.Adam(ps, lr=0.02), None),
    "adamw-masked": (lambda comm: rg.optim.adamw(0.02, weight_decay=0.1, mask=lambda leaf: len(leaf.shape) == 2),
                     None, None),
    "multi-transform": (lambda comm: rg.optim.multi_transform(
        {"mat": rg.optim.adamw(0.02, weight_decay=0.1), "vec": rg.optim.sgd(0.1, momentum=0.9)},
        lambda leaf: "mat" if len(leaf.shape) == 2 else "vec"), None, None),
}


@pytest.mark.parametrize("how", ["granule", "leaf"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CASES) + list(MORE))
def test_optimizer_on_multi_buffer_plan(name, world_size, how):
    make_opt, make_torch, clip = {**CASES, **MORE}[name]
    one = rg.collectives.simulate(world_size, _train, make_opt, "one")
    many = rg.collectives.simulate(world_size, _train, make_opt, how)
    assert many[0][1] > 1
    for (a, _), (b, _) in zip(one, many):
        rg.testing.assert_trees_all_close(b, a, rtol=1e-12, atol=1e-14)
    if make_torch is not None:
        ref = _reference(make_torch, world_size, clip)
        rg.testing.assert_trees_all_close(many[0][0], ref, rtol=1e-10, atol=1e-12)


def _adamw8(comm, how):
    plans = []

    def split(plan):
        plans.append(_split(plan, how))
        return plans[-1]

    return (*_adamw8_state(comm, split), plans[0].num_buffers)


@pytest.mark.parametrize("world_size", [2, 4])
def test_adamw_8bit_blocks_stay_whole_on_multi_buffer_plans(world_size):
    """8-bit state per leaf is bit-identical between 1 and several buffers (blocks never cut)."""
    from tests.optim._cases import concat_over_ranks

    one = rg.collectives.simulate(world_size, _adamw8, "one")
    many = rg.collectives.simulate(world_size, _adamw8, "leaf")
    assert many[0][2] == 3
    a = concat_over_ranks([r[0] for r in one])
    b = concat_over_ranks([r[0] for r in many])
    for path, parts in a.items():
        for k, v in parts.items():
            assert torch.equal(b[path][k], v), (path, k)
    rg.testing.assert_trees_all_close(many[0][1], one[0][1], rtol=0, atol=0)


def _muon(comm, how, num_waves):
    params = _muon_cases._params()
    plan = _split(rg.make_plan(params, _muon_cases.SPECS, world_size=comm.world_size), how)
    local = rg.shard(plan, params, comm)
    opt = rg.optim.muon(_muon_cases.LR, comm=comm, momentum=_muon_cases.MOM, weight_decay=_muon_cases.WD,
                        adam=rg.optim.adamw(1e-2, weight_decay=_muon_cases.WD), num_waves=num_waves)
    state = opt.init(local)
    for step in range(_muon_cases.STEPS):
        updates, state = opt.update(rg.shard(plan, _muon_cases._grads(step), comm), state, local)
        local = rg.apply_updates(local, updates)
    return rg.gather(local, comm), plan.num_buffers


@pytest.mark.parametrize("num_waves", [1, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_on_multi_buffer_plans_matches_torch_muon(world_size, num_waves):
    ref = _muon_cases._reference()
    for how in ("granule", "leaf"):
        results = rg.collectives.simulate(world_size, _muon, how, num_waves)
        assert results[0][1] > 1
        for full, _ in results:
            rg.testing.assert_trees_all_close(full, ref, rtol=1e-10, atol=1e-10)  # as tests/optim/test_muon.py
        one = rg.collectives.simulate(world_size, _muon, "one", num_waves)
        rg.testing.assert_trees_all_close(results[0][0], one[0][0], rtol=0, atol=0)


def test_global_norm_and_group_ops_on_multi_buffer_plans():
    def fn(comm):
        params = _params()
        plan = rg.testing.with_buffers(rg.make_plan(params, SPECS, world_size=comm.world_size))
        d = rg.shard(plan, params, comm)
        e = d.scale(2.0).add(d, alpha=-1.0).cast(torch.float32).cast(torch.float64)
        return float(d.global_norm(comm)), float(rg.optim.tree_norm(e, comm=comm)), plan.num_buffers

    want = float(torch.sqrt(sum((p ** 2).sum() for p in rg.pytree.leaves(_params()))))
    for a, b, n in rg.collectives.simulate(3, fn):
        assert n > 1 and a == pytest.approx(want, rel=1e-12) and b == pytest.approx(want, rel=1e-6)

