"""The public hypothesis strategies and tree assertions themselves."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ragged as rg
from ragged import spec
from ragged.testing import assert_trees_all_close
from ragged.testing import strategies as rst


@given(rst.param_trees(device="cpu", dtype=torch.float64, min_leaves=2))
def test_real_param_trees_hold_random_data(tree):
    leaves = rg.pytree.leaves(tree)
    assert len(leaves) >= 2 and all(t.dtype == torch.float64 and t.device.type == "cpu" for t in leaves)
    nonempty = [t for t in leaves if t.numel()]
    assert all(bool((t != 0).any()) for t in nonempty)


@given(rst.shapes(min_dims=2).flatmap(lambda s: st.tuples(st.just(s), rst.block_specs(s))))
def test_block_specs_are_valid_for_their_shape(shape_and_spec):
    shape, blocks = shape_and_spec
    assert isinstance(blocks, spec.Blocks)
    spec.granule_of(blocks, shape)  # raises if invalid


@given(rst.param_trees().flatmap(lambda t: st.tuples(st.just(t), rst.spec_trees(t, replicate=True))))
def test_spec_trees_match_the_params_structure(tree_and_specs):
    tree, specs = tree_and_specs
    specs_leaves = rg.pytree.leaves(specs, none_is_leaf=True)
    assert len(specs_leaves) == len(rg.pytree.leaves(tree))


@given(rst.plans(strategy="exact"))
def test_plans_strategy_builds_plans(plan):
    assert plan.strategy == "exact" and plan.buffer_numel >= plan.numel
    assert all(math.prod(l.shape) == l.numel for l in plan.leaves)


def test_assert_trees_all_close_reports_the_key_path_and_structure():
    a = {"w": torch.ones(2, dtype=torch.float64), "b": [torch.zeros(3)]}
    assert_trees_all_close(a, {"w": torch.ones(2, dtype=torch.float64) + 1e-12, "b": [torch.zeros(3)]})
    with pytest.raises(AssertionError, match=r"leaf \['b'\]\[0\] differs"):
        assert_trees_all_close(a, {"w": torch.ones(2, dtype=torch.float64), "b": [torch.ones(3)]})
    with pytest.raises(AssertionError, match="tree structures differ"):
        assert_trees_all_close(a, {"w": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(AssertionError, match="differs"):
        assert_trees_all_close({"x": torch.ones(2)}, {"x": torch.ones(2, dtype=torch.float64)})
    assert_trees_all_close({"x": torch.ones(2)}, {"x": torch.ones(2, dtype=torch.float64)}, check_dtype=False)
    with pytest.raises(ValueError, match="together"):
        assert_trees_all_close(a, a, rtol=1e-3)
