"""Bundled model shapes and the user shapes format."""

import json
from importlib import resources

import pytest
import torch

from ragged import pytree
from ragged.models import MODELS, expand_names, model_shapes, model_units, unit_numel


def _bundled():
    with resources.files("ragged").joinpath("data/model_shapes.json").open() as f:
        return json.load(f)


@pytest.mark.parametrize(
    "model, key, n_units",
    [("llama3-70b", "llama3_70b", 82), ("gpt-oss-120b", "gpt_oss_120b", 38), ("deepseek-v3-671b", "deepseek_v3", 63)],
)
def test_totals_match_the_data_file(model, key, n_units):
    units = model_units(model)
    assert len(units) == n_units
    assert sum(unit_numel(u) for u in units) == _bundled()["_sanity_total_params_excluding_mtp"][key]
    assert all(t.device.type == "meta" for u in units for t in pytree.leaves(u.params))


def test_deepseek_dense_and_moe_layers():
    units = model_units("deepseek-v3-671b")
    kinds = [u.kind for u in units]
    assert kinds[0] == "embed" and kinds[-1] == "head"
    assert kinds[1:4] == ["dense_layer"] * 3 and kinds[4:-1] == ["moe_layer"] * 58
    moe = units[4].params
    assert len(moe) == 782 and moe["mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
    assert "mlp.experts.256.down_proj.weight" not in moe
    raw = _bundled()["deepseek_v3_671b"]
    assert unit_numel(units[4]) == raw["moe_layer_example"]["numel"]
    assert unit_numel(units[1]) == raw["dense_layer_example"]["numel"]


def test_layers_per_unit_merges_consecutive_layers():
    units = model_units("deepseek-v3-671b", layers_per_unit=4)
    names = [u.name for u in units]
    assert names[:3] == ["embed", "layers.0-3", "layers.4-7"] and names[-2:] == ["layers.60", "head"]
    assert units[1].kind == "dense_layer+moe_layer x4" and set(units[1].params) == {f"layers.{i}" for i in range(4)}
    assert sum(unit_numel(u) for u in units) == sum(unit_numel(u) for u in model_units("deepseek-v3-671b"))


def test_dtype_and_shared_meta_tensors():
    units = model_units("gpt-oss-120b", dtype=torch.float32)
    a, b = units[1].params["mlp.experts.down_proj"], units[2].params["mlp.experts.down_proj"]
    assert a.dtype == torch.float32 and a is b  # one meta tensor per shape


def test_user_shapes_file(tmp_path):
    desc = {
        "name": "tiny-moe",
        "units": [
            {"name": "embed", "kind": "embed", "params": {"tok.weight": [100, 16]}},
            {"name": "layers.{0..2}", "kind": "moe", "params": {"norm": [16], "experts.{0..3}.w": [8, 16], "scale": []}},
        ],
    }
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(desc))
    units = model_units(str(path))
    assert [u.name for u in units] == ["embed", "layers.0", "layers.1", "layers.2"]
    assert sorted(units[1].params) == ["experts.0.w", "experts.1.w", "experts.2.w", "experts.3.w", "norm", "scale"]
    assert units[1].params["scale"].shape == ()
    assert model_units(desc)[1].kind == "moe"


@pytest.mark.parametrize(
    "desc, message",
    [
        ({"layers": []}, "non-empty 'units' list"),
        ({"units": [{"name": "a", "params": {}}]}, "has no params"),
        ({"units": [{"name": "a", "params": {"w": [4, -1]}}]}, "params['w'] is [4, -1]"),
        ({"units": [{"name": "a", "params": {"w": "4x4"}}]}, "a shape is a list of non-negative ints"),
        ({"units": [{"params": {"w": [4]}}]}, "units[0] must be an object with a string 'name'"),
    ],
    ids=["no-units", "empty-params", "negative-dim", "string-shape", "no-name"],
)
def test_malformed_descriptions(desc, message):
    with pytest.raises(ValueError) as info:
        model_shapes(desc)
    assert message in str(info.value)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="neither a bundled model"):
        model_units("gpt-5")
    assert set(MODELS) == {"llama3-70b", "gpt-oss-120b", "deepseek-v3-671b"}


def test_expand_names():
    assert expand_names("e.{2..4}.w") == ["e.2.w", "e.3.w", "e.4.w"]
    assert len(expand_names("a{0..1}b{0..2}")) == 6
    with pytest.raises(ValueError, match="empty"):
        expand_names("e.{3..1}")


def test_the_documented_example_format_loads():
    import ragged.models

    doc = ragged.models.__doc__
    text = doc[doc.index("    {\n") : doc.index("    }\n") + 6]
    units = model_units(json.loads(text))
    assert [u.kind for u in units] == ["embed", "dense_layer", "dense_layer"] + ["moe_layer"] * 30 + ["head"]
    assert len(units[3].params) == 9
