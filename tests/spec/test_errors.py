"""Bad input fails at plan time with the key path, the shape, the rule and the fix."""

import re

import pytest
import torch

import ragged as rg
from ragged import spec


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


def test_non_tensor_leaf_names_its_path_and_the_fix():
    with pytest.raises(TypeError, match=re.escape("params['layers'][1] is a int, not a tensor")) as info:
        rg.make_plan({"layers": [meta(2, 2), 3]}, world_size=2)
    assert "Fix:" in str(info.value) and "meta" in str(info.value)


def test_bad_spec_leaf_names_its_path_and_the_allowed_values():
    with pytest.raises(TypeError, match=re.escape("specs['layers'][1] is 'rows' of type str")) as info:
        rg.make_plan({"layers": [meta(4, 4), meta(4)]}, {"layers": [spec.Rows(1), "rows"]}, world_size=2)
    assert "spec.Rows(n)" in str(info.value)


def test_spec_structure_mismatch_names_the_key_path_and_the_fix():
    with pytest.raises(ValueError, match=re.escape("specs['layers']")) as info:
        rg.make_plan({"layers": [meta(4, 4), meta(4)]}, {"layers": [spec.Rows(1)]}, world_size=2)
    assert "2 children" in str(info.value) and "Fix:" in str(info.value)


def test_blocks_on_stacked_matrices_need_aligned_bands():
    with pytest.raises(rg.LayoutError) as info:
        rg.make_plan({"e": meta(3, 10, 8)}, {"e": spec.Blocks(4, 4)}, world_size=2)
    text = str(info.value)
    assert "params['e'] has shape (3, 10, 8)" in text and "multiple of r = 4" in text and "spec.Rows(10)" in text
    assert info.value.path == "['e']" and info.value.shape == (3, 10, 8)


def test_blocks_on_a_single_matrix_allow_a_short_last_band():
    # 10 rows in bands of 4: the last band has 2 rows and stays whole at the end of the leaf
    plan = rg.make_plan({"w": meta(10, 8)}, {"w": spec.Blocks(4, 4)}, world_size=3, align=1)
    leaf = plan.leaves[0]
    assert leaf.granule == 32
    cuts = [k * plan.shard_size - leaf.offset for k in range(1, 3) if leaf.offset < k * plan.shard_size < leaf.stop]
    assert cuts and all(c % 32 == 0 for c in cuts)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0), "world_size must be a positive int, got 0"),
        (dict(world_size=2, strategy="ilp"), "strategy must be one of ('dp', 'exact', 'naive'), got 'ilp'"),
        (dict(world_size=2, align=0), "align must be a positive int"),
        (dict(world_size=2, order="random"), "order must be one of"),
        (dict(world_size=2, order=["['x']"]), "missing [\"['e']\"], unknown [\"['x']\"]"),
    ],
    ids=["world_size", "strategy", "align", "order-name", "order-paths"],
)
def test_option_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rg.make_plan({"e": meta(3, 10, 8)}, **kwargs)


@pytest.mark.parametrize("bad", [spec.Rows, spec.Elements], ids=["rows", "elements"])
def test_granularity_values_are_checked(bad):
    for value in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"\.n must be a positive int, got"):
            bad(value)


def test_empty_tree_says_what_to_pass():
    with pytest.raises(rg.LayoutError, match="no tensors"):
        rg.make_plan({}, world_size=2)


def test_errors_do_not_poison_the_plan_memo():
    params = {"w": meta(4, 4)}
    with pytest.raises(TypeError):
        rg.make_plan(params, {"w": "rows"}, world_size=2)
    assert rg.make_plan(params, {"w": spec.Rows(2)}, world_size=2).leaves[0].granule == 8
