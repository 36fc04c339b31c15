"""Property tests: sharded optimizers equal the unsharded computation on any plan, and the
8-bit state does not depend on the world size (hypothesis, "ci" profile)."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import ragged as rg
from ragged import spec
from ragged.testing import strategies as rst

from tests.optim._cases import gather_all, padding_mask, shard_all


def _grads(params, step):
    g = torch.Generator().manual_seed(step)
    return rg.pytree.map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)


@settings(max_examples=40)
@given(rst.plan_inputs(params=rst.param_trees(dtype=torch.float64, device="cpu"), world_sizes=rst.world_sizes(max_value=5),
                       replicate=True))
def test_adamw_on_shards_equals_unsharded(inputs):
    params, specs, world_size = inputs
    plan = rg.make_plan(params, specs, world_size=world_size)
    opt = rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=None), rg.optim.adamw(0.01, weight_decay=0.1))
    # reference: the same optimizer on the plain (unsharded) tree; clip needs the global norm,
    # so the sharded run uses per-rank shards with the norm taken over all of them (world 1 comm)
    ref_opt = opt
    ref, ref_state = params, ref_opt.init(params)
    shards = shard_all(plan, params)
    plain = rg.optim.adamw(0.01, weight_decay=0.1)
    states = [plain.init(s) for s in shards]
    for step in range(2):
        grads = _grads(params, step)
        norm = rg.optim.tree_norm(grads)
        factor = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        u, ref_state = ref_opt.update(grads, ref_state, ref)
        ref = rg.apply_updates(ref, u)
        gs = shard_all(plan, rg.pytree.map(lambda g: g * factor, grads))
        for r in range(world_size):
            u, states[r] = plain.update(gs[r], states[r], shards[r])
            shards[r] = rg.apply_updates(shards[r], u)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12), gather_all(shards), ref)
    for r, s in enumerate(shards):
        assert not s.data[padding_mask(plan, r)].any()


@st.composite
def _quant_inputs(draw):
    n = draw(st.integers(1, 4))
    params, specs = {}, {}
    for i in range(n):
        kind = draw(st.sampled_from(["matrix", "experts", "vector", "small"]))
        seed = draw(st.integers(0, 2**20))
        gen = torch.Generator().manual_seed(seed)
        if kind == "matrix":
            shape = (draw(st.integers(1, 48)), draw(st.integers(1, 48)))
            r, c = draw(st.integers(1, 8)), draw(st.integers(4, 16))
            s = spec.Blocks(r, c) if r * c >= 32 else spec.Blocks(4, 8)
        elif kind == "experts":
            r = draw(st.integers(1, 8))
            shape = (draw(st.integers(1, 3)), r * draw(st.integers(1, 4)), draw(st.integers(4, 24)))
            s = spec.Blocks(r, max(4, -(-32 // r)))
        elif kind == "vector":
            shape = (draw(st.integers(1, 600)),)
            s = spec.Elements(draw(st.integers(32, 96)))
        else:
            shape = (draw(st.integers(1, 30)),)
            s = draw(st.sampled_from([spec.Rows(1), spec.Elements(1), spec.Replicate()]))
        params[f"p{i}"] = torch.randn(shape, generator=gen)
        specs[f"p{i}"] = s
    return params, specs, draw(st.integers(2, 5))


def _run8(params, specs, world_size):
    plan = rg.make_plan(params, specs, world_size=world_size)
    opt = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1)
    shards = shard_all(plan, params)
    states = [opt.init(s) for s in shards]
    for step in range(2):
        gs = shard_all(plan, _grads(params, step))
        for r in range(world_size):
            u, states[r] = opt.update(gs[r], states[r], shards[r])
            shards[r] = rg.apply_updates(shards[r], u)
    per_leaf = {}
    for s, st_ in zip(shards, states):
        for path, parts in rg.optim.adam8bit_leaf_state(st_[0].moments, s, min_size=1).items():
            if path in per_leaf and path in [l.path for l in plan.replicated]:
                continue
            slot = per_leaf.setdefault(path, {})
            for k, v in parts.items():
                slot[k] = torch.cat([slot[k], v]) if k in slot else v
    return per_leaf, gather_all(shards)


@settings(max_examples=40)
@given(_quant_inputs())
def test_adamw_8bit_state_independent_of_world_size(inputs):
    params, specs, world_size = inputs
    one, p1 = _run8(params, specs, 1)
    many, pm = _run8(params, specs, world_size)
    assert one.keys() == many.keys()
    for path, parts in one.items():
        for k, v in parts.items():
            assert torch.equal(many[path][k], v), (path, k)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), pm, p1)


@settings(max_examples=30)
@given(rst.plan_inputs(params=rst.param_trees(dtype=torch.float32, device="cpu"), world_sizes=rst.world_sizes(max_value=4),
                       replicate=True))
def test_multi_transform_on_shards_equals_unsharded(inputs):
    """Per-element labels from plan.local_pieces (and the aligned replicated buffer) route each
    element to the same transformation as the per-leaf labels of the plain tree."""
    params, specs, world_size = inputs
    params = rg.pytree.map(lambda p: p.double(), params)
    plan = rg.make_plan(params, specs, world_size=world_size)
    transforms = {"mat": rg.optim.adamw(0.01, weight_decay=0.1), "vec": rg.optim.sgd(0.1, momentum=0.9)}
    sharded = rg.optim.multi_transform(transforms, lambda leaf: "mat" if len(leaf.shape) >= 2 else "vec", compact=("vec",))
    plain = rg.optim.multi_transform(transforms, rg.pytree.map(lambda p: "mat" if p.ndim >= 2 else "vec", params))
    ref, ref_state = params, plain.init(params)
    shards = shard_all(plan, params)
    states = [sharded.init(s) for s in shards]
    for step in range(2):
        grads = _grads(params, step)
        u, ref_state = plain.update(grads, ref_state, ref)
        ref = rg.apply_updates(ref, u)
        gs = shard_all(plan, grads)
        for r in range(world_size):
            u, states[r] = sharded.update(gs[r], states[r], shards[r])
            shards[r] = rg.apply_updates(shards[r], u)
    rg.pytree.map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12), gather_all(shards), ref)
