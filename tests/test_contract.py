"""The public contract of shared/design.md, written exactly as code outside this repo uses it.

If a name or a meaning here changes, code outside this repo breaks: extend, do not break.
"""

import dataclasses

import pytest
import torch

import ragged as rg
from ragged import spec


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(12, 8, generator=g, dtype=torch.float64),
        "experts": torch.randn(3, 8, 4, generator=g, dtype=torch.float64),
        "b": torch.randn(8, generator=g, dtype=torch.float64),
    }


def test_plan_fields_and_meanings():
    params = _params()
    plan = rg.make_plan(params, None, world_size=3, align=None, strategy="dp")
    assert plan.world_size == 3
    assert plan.padding == plan.world_size * plan.shard_size - sum(t.numel() for t in params.values())
    assert plan.overhead == pytest.approx(plan.padding / sum(t.numel() for t in params.values()))
    for leaf in plan.leaves:
        assert isinstance(leaf.path, str) and isinstance(leaf.offset, int) and isinstance(leaf.granule, int)
        assert leaf.numel == torch.Size(leaf.shape).numel() and leaf.dtype == torch.float64
    # None means Rows(1) everywhere; a row is the last dim, one element for 1-D tensors
    assert {l.path: l.granule for l in plan.leaves} == {"['w']": 8, "['experts']": 4, "['b']": 1}
    for strategy in ("dp", "exact", "naive"):
        assert rg.make_plan(params, spec.Rows(1), world_size=3, strategy=strategy).strategy == strategy
    # frozen, hashable, independent of dict insertion order
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.shard_size = 1
    assert hash(plan) == hash(rg.make_plan(dict(reversed(list(params.items()))), world_size=3))
    # meta tensors plan without memory
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in params.items()}
    assert rg.make_plan(meta, world_size=3) == plan


def _contract_step(comm, params, grads_per_rank):
    plan = rg.make_plan(params, {"w": spec.Rows(2), "experts": spec.Blocks(4, 4), "b": spec.Elements(1)},
                        world_size=comm.world_size)
    local = rg.shard(plan, params, comm)
    assert local.data.shape == (plan.shard_size,)
    pieces = local.views()
    full = rg.gather(local, comm)
    gshard = rg.reduce_scatter(plan, grads_per_rank[comm.rank], comm, op="mean")
    opt = rg.optim.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    opt_state = opt.init(local)
    updates, opt_state = opt.update(gshard, opt_state, local)
    new_local = rg.optim.apply_updates(local, updates)
    with pytest.raises(dataclasses.FrozenInstanceError):
        local.data = None  # DBuffer is immutable: replace, don't mutate
    return pieces, full, rg.gather(new_local, comm)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_gather_reduce_scatter_adamw_match_torch(world_size):
    params = _params()
    g = torch.Generator().manual_seed(1)
    grads = [{k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()} for _ in range(world_size)]
    results = rg.collectives.simulate(world_size, _contract_step, params, grads)

    reference = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = torch.optim.AdamW(reference.values(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for k, v in reference.items():
        v.grad = sum(gr[k] for gr in grads) / world_size  # op="mean"
    torch_opt.step()
    for pieces, full, updated in results:
        rg.testing.assert_trees_all_close(full, params, rtol=0, atol=0)
        rg.testing.assert_trees_all_close(updated, {k: v.detach() for k, v in reference.items()}, rtol=1e-12, atol=1e-12)
    # this rank's pieces keep rows as rows and, over all ranks, are exactly the leaf
    rows = torch.cat([pieces["w"] for pieces, _, _ in results])
    assert rows.ndim == 2 and torch.equal(rows, params["w"])


def test_gather_is_differentiable_and_backward_reduce_scatters():
    params = _params()
    plan = rg.make_plan(params, world_size=2)

    def fn(comm):
        local = rg.shard(plan, params, comm)
        data = local.data.clone().requires_grad_()
        full = rg.gather(local.replace(data=data), comm)
        loss = sum((v * (comm.rank + 1)).sum() for v in full.values())
        loss.backward()
        return data.grad

    grads = rg.collectives.simulate(2, fn)
    expected = rg.collectives.simulate(2, lambda comm: rg.shard(plan, {k: torch.full_like(v, 3.0) for k, v in params.items()}, comm).data)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)  # d/dx sum_r (r+1) x = 3 on real elements, 0 on padding
