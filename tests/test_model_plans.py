"""Plans of the bundled models: the paper's Figure 11 claim on MoE layers, and why DeepSeek-V3's
dense layers cannot meet it with per-layer units (every order hits the same forced bound)."""

import pytest

from ragged import spec
from ragged._pytree import pytree
from ragged.models import model_units
from ragged.spec import _search


def _layer(model, kind):
    return next(u for u in model_units(model) if u.kind == kind)


@pytest.mark.parametrize("model", ["gpt-oss-120b", "deepseek-v3-671b"])
@pytest.mark.parametrize("rows", [1, 16])
def test_moe_layers_pad_below_3_percent_up_to_256_ranks(model, rows):
    layer = _layer(model, "moe_layer")
    for m in (8, 16, 32, 64, 128, 256):
        plan = spec.make_plan(layer.params, spec.Rows(rows), world_size=m)
        assert plan.overhead < 0.03, (m, plan)


@pytest.mark.parametrize("m", [128, 256])
def test_deepseek_dense_layer_padding_is_forced_for_every_order(m):
    layer = _layer("deepseek-v3-671b", "dense_layer")
    plan = spec.make_plan(layer.params, spec.Rows(1), world_size=m)
    sizes = [leaf.numel for leaf in plan.leaves]
    granules = [leaf.granule for leaf in plan.leaves]
    bound = _search.order_free_lower_bound(sizes, granules, plan.align, m)
    assert plan.shard_size == bound  # optimal over all orders, and still above 3%
    assert bound % 1032192 == 0 and plan.overhead > 0.03
    assert len(pytree.leaves(layer.params)) == 12
