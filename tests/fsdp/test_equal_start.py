"""Ranks start from the same values (simulated ranks; the gloo cases are in
``tests/distributed/test_models_gloo.py``): ``fsdp.init`` refuses ranks that hold different values
on every rank, naming the first one, before anything changes; ``broadcast_from=r`` starts every
rank from rank r's values, bit for bit, and trains like single-process torch."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import fsdp
from tests.fsdp._lifecycle_cases import meta_tiny, tiny

simulate = rg.collectives.simulate


def _init_or_error(comm, models, **kw):
    """``fsdp.init`` of this rank's model: ``("ok", export)`` or ``(error type, message, unchanged)``."""
    model = models[comm.rank + comm.replica_rank * comm.world_size]
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    units = fsdp.make_units(model, world_size=comm.world_size)
    try:
        state = fsdp.init(units, model, rg.optim.adamw(1e-2), comm, **kw)
    except rg.RaggedError as e:
        unchanged = all(type(p) is torch.nn.Parameter and torch.equal(p, before[k]) for k, p in model.named_parameters())
        return type(e), str(e), unchanged
    return "ok", fsdp.export(units, state.shards, comm, module=model, rank0_only=False)


def _nudged(change):
    model = tiny()
    with torch.no_grad():
        w = model.blocks[1].lin.weight
        if change == "one-ulp":
            w[2, 3] = torch.nextafter(w[2, 3], torch.tensor(10.0, dtype=w.dtype))
        elif change == "swap":
            w[[0, 1]] = w[[1, 0]].clone()
        elif change == "sign-of-zero":
            model.blocks[1].lin.bias[0] = 0.0
        elif change == "buffer":
            model.bn.running_mean[1] += 1e-12
    return model


@pytest.mark.parametrize("change", ["seed", "one-ulp", "swap", "sign-of-zero", "buffer"])
def test_ranks_holding_different_values_are_refused_on_every_rank_before_any_change(change):
    models = [tiny(), tiny(), tiny(seed=1) if change == "seed" else _nudged(change)]
    if change == "sign-of-zero":
        with torch.no_grad():
            models[0].blocks[1].lin.bias[0] = models[1].blocks[1].lin.bias[0] = -0.0
    first = {"seed": "'emb.weight'", "buffer": "buffer 'bn.running_mean'", "sign-of-zero": "'blocks.1.lin.bias'"}.get(
        change, "'blocks.1.lin.weight'")
    for kind, msg, unchanged in simulate(3, _init_or_error, models):
        assert kind is fsdp.ParamsMismatchError and issubclass(kind, rg.RaggedError), msg
        assert unchanged
        assert f"different values for {first}" in msg and "ranks [0, 1] vs ranks [2]" in msg, msg
        assert "broadcast_from=0" in msg and "seed" in msg


def test_hsdp_replicas_must_hold_the_same_values_too():
    models = [tiny(), tiny(), tiny(), tiny(seed=1)]  # replica 1, shard rank 1 differs
    for kind, msg, unchanged in simulate(4, _init_or_error, models, mesh_shape=(2, 2)):
        assert kind is fsdp.ParamsMismatchError and unchanged and "ranks [0, 1, 2] vs ranks [3]" in msg, msg


@pytest.mark.parametrize("mesh_shape, source", [((1, 3), 2), ((2, 2), 1)], ids=["fsdp-from-2", "hsdp-from-1"])
def test_broadcast_from_starts_every_rank_from_that_rank_bit_for_bit(mesh_shape, source):
    models = [tiny(seed=r) for r in range(3 if mesh_shape == (1, 3) else 4)]
    want = {**models[source].state_dict(), **dict(models[source].named_buffers())}
    want = {k: v.detach().clone() for k, v in want.items()}
    for r, (ok, full) in enumerate(simulate(len(models), _init_or_error, models, mesh_shape=mesh_shape,
                                            broadcast_from=source)):
        assert ok == "ok" and full.keys() <= want.keys()
        for k, v in full.items():
            assert torch.equal(v, want[k]), (r, k)
        for k, b in models[r].named_buffers():
            assert torch.equal(b, want[k]), (r, k)


def _train(comm, models, data, source):
    from torch.func import functional_call

    model = models[comm.rank]
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = rg.optim.adamw(1e-2, weight_decay=0.1)
    state = fsdp.init(units, model, opt, comm, broadcast_from=source)
    loss = lambda p, x: functional_call(model, p, (x,)).square().mean()  # noqa: E731
    step = fsdp.make_step(units, loss, opt, comm)
    for x in data:
        state, _ = step(state, x[2 * comm.rank: 2 * comm.rank + 2])
    return rg.gather(units, state.shards, comm)


def test_broadcast_from_then_training_equals_torch_from_that_rank():
    models = [tiny(seed=r).eval() for r in range(2)]  # eval: the BatchNorm uses its (broadcast) running stats
    data = [torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    ref = tiny(seed=1).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x in data:
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    for got in simulate(2, _train, models, data, 1):
        for k, v in ref.named_parameters():
            torch.testing.assert_close(got[k], v.detach(), rtol=0, atol=1e-12)


def test_values_made_real_in_a_meta_module_are_checked_and_the_rest_is_not():
    def run(comm, differ):
        model = meta_tiny()
        model.blocks[0].lin.weight = torch.nn.Parameter(torch.full((6, 6), float(comm.rank if differ else 1), dtype=torch.float64))
        units = fsdp.make_units(model, world_size=2)
        try:
            fsdp.init(units, model, rg.optim.sgd(0.1), comm)
        except fsdp.ParamsMismatchError as e:
            return str(e)
        return "ok"

    assert simulate(2, run, False) == ["ok", "ok"]
    assert all("different values for 'blocks.0.lin.weight'" in m for m in simulate(2, run, True))


@pytest.mark.parametrize("bad", [2, -1, True, "0"])
def test_broadcast_from_must_be_a_rank_of_the_mesh(bad):
    models = [tiny(), tiny()]
    for got, msg, unchanged in simulate(2, _init_or_error, models, broadcast_from=bad):
        assert got is rg.RaggedValueError and "broadcast_from must be an int in [0, 2)" in msg and unchanged, msg
