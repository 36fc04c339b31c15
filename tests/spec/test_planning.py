import re

import pytest
import torch

import ragged as rg
from ragged import spec


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


def test_blocks_never_cross_a_rank_boundary():
    params = {"a": meta(7, 8), "b": meta(5, 8), "c": meta(3)}
    plan = rg.make_plan(params, spec.Rows(2), world_size=3, align=1)
    S = plan.shard_size
    for leaf in plan.leaves:
        for k in range(1, plan.world_size):
            if leaf.offset < k * S < leaf.stop:
                assert (k * S - leaf.offset) % leaf.granule == 0


def test_each_leaf_keeps_the_granularity_it_was_planned_with():
    plan = rg.make_plan({"router": meta(2, 4), "experts": meta(2, 4, 4)},
                        {"router": spec.Rows(2), "experts": spec.Blocks(2, 4)}, world_size=2)
    assert {l.path: l.granularity for l in plan.leaves} == {"['router']": spec.Rows(2), "['experts']": spec.Blocks(2, 4)}
    assert not hasattr(plan.leaves[0], "spec")  # one name: a spec is what the caller wrote


def test_dict_insertion_order_does_not_matter():
    a = rg.make_plan({"x": meta(4, 4), "y": meta(9)}, world_size=2)
    b = rg.make_plan({"y": meta(9), "x": meta(4, 4)}, world_size=2)
    assert a == b and hash(a) == hash(b) and a.fingerprint() == b.fingerprint()


def test_mixed_dtypes_need_explicit_buffer_dtype():
    params = {"w": meta(4, 4), "b": meta(4, dtype=torch.bfloat16)}
    with pytest.raises(rg.LayoutError, match="mixes dtypes"):
        rg.make_plan(params, world_size=2)
    assert rg.make_plan(params, world_size=2, dtype=torch.float32).dtype == torch.float32


def test_spec_tree_must_be_a_prefix():
    with pytest.raises(rg.RaggedValueError, match=re.escape(
            "specs has key(s) ['v'] that params does not have, and params has key(s) ['w'] that specs does not cover")):
        rg.make_plan({"w": meta(4, 4)}, {"v": spec.Rows(1)}, world_size=2)
    with pytest.raises(rg.RaggedValueError, match=re.escape("specs['l'] has key(s) ['x'] that params['l'] does not")):
        rg.make_plan({"l": {"w": meta(4, 4)}}, {"l": {"w": None, "x": None}}, world_size=2)
    with pytest.raises(rg.RaggedValueError, match=re.escape("params has key(s) ['b'] that specs does not cover")):
        rg.make_plan({"w": meta(4, 4), "b": meta(4)}, {"w": None}, world_size=2)


def test_blocks_on_1d_leaf_names_path_and_fix():
    with pytest.raises(rg.LayoutError, match=r"params\['b'\] has shape \(4,\).*Elements"):
        rg.make_plan({"b": meta(4)}, {"b": spec.Blocks(2, 2)}, world_size=2)


def test_max_buffers_is_validated():
    params = {"w": meta(4, 4)}
    for bad in (0, -1, 2.5, True, "many"):
        with pytest.raises(rg.RaggedValueError, match="max_buffers must be a positive int, got .* It may also be 'auto'"):
            rg.make_plan(params, world_size=2, max_buffers=bad)
    with pytest.raises(rg.RaggedValueError, match="strategy='naive' is plain concatenation"):
        rg.make_plan(params, world_size=2, strategy="naive", max_buffers=2)


def test_several_buffers_when_row_lengths_disagree():
    """DeepSeek-V3's dense layer, the case that motivated several buffers: one buffer pads 35.9%
    at rows:1, m=256 (S a multiple of lcm(7168, 18432, 16384, ...)); "auto" pads 0.19%."""
    from ragged.models import model_units

    layer = next(u for u in model_units("deepseek-v3-671b") if u.kind == "dense_layer").params
    one = rg.make_plan(layer, world_size=256)
    auto = rg.make_plan(layer, world_size=256, max_buffers="auto")
    assert one.overhead > 0.35 and auto.overhead < 0.003 and 1 < auto.num_buffers <= 8
    assert len({auto.buffer_index(l.offset) for l in auto.leaves}) == auto.num_buffers


def test_plan_buffers_contract():
    plan = rg.make_plan({"a": meta(8, 3), "b": meta(4, 5)}, world_size=2, align=1, max_buffers="auto")
    assert plan.buffers == ((0, 12), (24, 10)) and plan.shard_size == 22 and plan.buffer_numel == 44
    assert [tuple(r) for r in plan.shard_ranges(0)] == [(0, 12, 0), (24, 34, 12)]
    assert [(p.leaf.path, p.local_offset, p.numel) for p in plan.local_pieces(1)] == [("['a']", 0, 12), ("['b']", 12, 10)]
    assert plan.owners(plan.leaf("['b']")) == (0, 1) and plan.occupancy() == (22, 22)
    one = rg.make_plan({"a": meta(8, 3), "b": meta(4, 5)}, world_size=2, align=1)
    assert one.buffers == ((0, one.shard_size),) and one.num_buffers == 1
    with pytest.raises(rg.RaggedValueError, match="not the sum of the buffers"):
        plan.replace(shard_size=23)
    with pytest.raises(rg.RaggedValueError, match="tile the global buffer"):
        plan.replace(buffers=((0, 12), (20, 10)))
