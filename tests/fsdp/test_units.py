"""Units: how models and pytrees split into FSDP units, and the errors for bad groupings."""

import re

import pytest
import torch

import ragged as rg
from ragged import fsdp, spec
from ragged.examples.gpt import GPT, GPTConfig


def _gpt(**kw):
    return GPT(GPTConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, ffn_dim=48, max_seq_len=16, **kw))


def test_module_default_units_are_blocks_plus_rest():
    model = _gpt(num_experts=4)
    units = fsdp.make_units(model, world_size=3)
    assert units.names == ("rest", "blocks.0", "blocks.1", "blocks.2")
    names = dict(model.named_parameters())
    covered = [p for u in units for p in u.paths]
    assert sorted(covered) == sorted(names)  # every parameter in exactly one unit
    for u in units:
        assert u.plan.world_size == 3
        assert u.plan.numel == sum(names[p].numel() for p in u.paths)
        prefix = u.name + "."
        assert all(p.startswith(prefix) for p in u.paths) or u.name == fsdp.REST
    assert all(not p.startswith("blocks.") for p in units["rest"].paths)


def test_split_merge_round_trip_and_views():
    model = _gpt()
    units = fsdp.make_units(model, world_size=2)
    params = dict(model.named_parameters())
    trees = units.split(model)
    merged = units.merge(trees)
    assert list(merged) == list(params)  # optree keeps the dict's insertion order on unflatten
    assert all(merged[k] is params[k] for k in params)


def test_explicit_module_groups_longest_prefix_wins():
    model = _gpt()
    units = fsdp.make_units(model, world_size=2, groups=["blocks", "blocks.1"])
    assert set(units.names) == {"rest", "blocks", "blocks.1"}
    assert all(p.startswith("blocks.1.") for p in units["blocks.1"].paths)
    assert not any(p.startswith("blocks.1.") for p in units["blocks"].paths)


def test_pytree_grouping_and_specs():
    g = torch.Generator().manual_seed(0)
    tree = {"layers": [{"w": torch.randn(8, 4, generator=g)}, {"w": torch.randn(8, 4, generator=g)}],
            "head": torch.randn(4, 3, generator=g)}
    units = fsdp.make_units(tree, world_size=2, groups=lambda p: p[:13] if p.startswith("['layers']") else "head",
                            specs=lambda path, t: spec.Rows(2) if t.dim() == 2 else None)
    assert units.names == ("head", "['layers'][0]", "['layers'][1]")
    assert units["['layers'][1]"].plan.leaves[0].granule == 8
    merged = units.merge(units.split(tree))
    assert merged["layers"][1]["w"] is tree["layers"][1]["w"]


def test_shard_then_gather_is_identity_simulated():
    model = _gpt(num_experts=4).double()
    units = fsdp.make_units(model, world_size=3)
    params = dict(model.named_parameters())

    def run(comm):
        return rg.gather(units, rg.shard(units, model, comm), comm)

    for full in rg.collectives.simulate(3, run):
        for k, v in params.items():
            torch.testing.assert_close(full[k], v.detach(), rtol=0, atol=0)


def test_rich_summary_renders():
    from rich.console import Console

    units = fsdp.make_units(_gpt(), world_size=4)
    console = Console(record=True, width=120)
    console.print(units)
    text = console.export_text()
    assert "blocks.2" in text and "total" in text


def test_replicated_leaves_stay_out_of_the_sharded_buffer():
    units = fsdp.make_units(_gpt(), world_size=2, specs={"norm.weight": spec.Replicate()})
    (unit,) = [u for u in units.units if "norm.weight" in u.paths]
    assert [l.path for l in unit.plan.replicated] == ["['norm.weight']"]
    assert all(l.path != "['norm.weight']" for l in unit.plan.leaves)


def test_errors():
    model = _gpt()
    with pytest.raises(ValueError, match=re.escape("groups[0] = 'block.0' matches no parameter")):
        fsdp.make_units(model, world_size=2, groups=["block.0"])
    with pytest.raises(TypeError, match=re.escape("must return a non-empty unit name")):
        fsdp.make_units({"a": torch.ones(2)}, world_size=2, groups=lambda p: 3)
    with pytest.raises(ValueError, match=re.escape("specs names ['nope']")):
        fsdp.make_units(model, world_size=2, specs={"nope": spec.Rows(1)})
    units = fsdp.make_units(model, world_size=2)
    with pytest.raises(ValueError, match="the units were made for"):
        units.split({"x": torch.ones(1)})
    with pytest.raises(KeyError, match="no unit named 'blocks.9'"):
        units["blocks.9"]
