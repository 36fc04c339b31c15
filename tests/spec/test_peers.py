"""Peers' padding rules on hand-computed cases and the paper's qualitative claims."""

import math

import pytest
import torch

from ragged import spec
from ragged.models import model_units


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="meta", dtype=dtype)


def test_hand_computed_unit():
    # w (10, 4) and b (3,) in bf16 (FSDP1 aligns starts to 8 elements), W = 4
    params = {"w": meta(10, 4), "b": meta(3)}  # tree order: b, w
    got = {k: v.per_device for k, v in spec.peer_padding(params, 4).items()}
    assert got == {
        "fsdp2": math.ceil(3 / 4) + math.ceil(10 / 4) * 4,  # 1 + 12
        "fsdp1": math.ceil((8 + 40) / 4),  # b padded to 8, then w
        "zero3": math.ceil(3 / 4) + math.ceil(40 / 4),
        "megatron": math.ceil(43 / (4 * 4)) * 4,  # F = lcm(4) = 4
    }


def test_padding_and_overhead_follow_per_device():
    params = {"w": meta(7, 3)}
    for peer, pp in spec.peer_padding(params, 5).items():
        assert pp.padding == 5 * pp.per_device - 21 >= 0
        assert pp.overhead == pytest.approx(pp.padding / 21)
        assert spec.peer_shard_numel(params, 5, peer) == pp.per_device


def test_fsdp2_doubles_when_experts_fewer_than_ranks():
    # paper: 128 experts over 256 ranks doubles FSDP2's padded all-gather buffer
    experts = {"w": meta(128, 2880, 5760)}
    assert spec.peer_padding(experts, 256)["fsdp2"].overhead == pytest.approx(1.0)
    assert spec.peer_padding(experts, 128)["fsdp2"].overhead == 0.0


def test_megatron_inflates_gpt_oss_moe_layers_about_a_third():
    layer = model_units("gpt-oss-120b")[1]
    overhead = spec.peer_padding(layer.params, 64)["megatron"].overhead
    assert 0.25 < overhead < 0.40


def test_ragged_beats_fsdp2_and_megatron_on_moe_layers():
    layer = model_units("gpt-oss-120b")[1]
    for m in (64, 256):
        plan = spec.make_plan(layer.params, spec.Rows(1), world_size=m)
        assert plan.padding < spec.peer_padding(layer.params, m)["megatron"].padding
    # at 256 ranks FSDP2 pads 128 experts to 256 rows; at 64 every dim 0 divides evenly
    plan = spec.make_plan(layer.params, spec.Rows(1), world_size=256)
    assert plan.padding * 100 < spec.peer_padding(layer.params, 256)["fsdp2"].padding


def test_bad_arguments():
    with pytest.raises(ValueError, match="peer must be one of"):
        spec.peer_shard_numel({"w": meta(2)}, 2, "fsdp3")
    with pytest.raises(ValueError, match="world_size"):
        spec.peer_padding({"w": meta(2)}, 0)
