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
