"""The FSDP step on multi-buffer units (simulated ranks, float64): every unit's buffers are
gathered in one coalesced launch and reduce-scattered likewise; the parameters equal the
single-buffer run's and single-process torch.optim.AdamW's. Gloo: tests/distributed/test_buffers_gloo.py."""

import dataclasses

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.gpt import GPT, GPTConfig
from tests.fsdp._cases import Case, fsdp_run, max_diff, reference_run


@pytest.mark.parametrize(
    "world_size,case",
    [
        (2, Case(split_buffers=True)),
        (3, Case(split_buffers=True, batch=6, micro_batches=2)),
        (4, Case(split_buffers=True, moe=True, micro_batches=2, replicate_vectors=True)),
        (2, Case(split_buffers=True, activation_checkpointing=True, donate=True, max_inflight_reduce=3)),
        (2, Case(max_buffers="auto", moe=True)),
    ],
    ids=["w2", "w3-accum2", "w4-moe-replicated", "w2-checkpointing-donate", "w2-auto-moe"],
)
def test_step_on_multi_buffer_units_matches_single_buffer_and_torch(world_size, case):
    ref, ref_losses = reference_run(case)
    single = rg.collectives.simulate(world_size, fsdp_run, dataclasses.replace(case, split_buffers=False, max_buffers=1))
    results = rg.collectives.simulate(world_size, fsdp_run, case)
    for (params, metrics), (one, _) in zip(results, single):
        assert max_diff(params, one)[0] < 1e-12
        diff, where = max_diff(params, ref)
        assert diff < 1e-10, f"{where} differs by {diff}"
        torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics], dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-9, atol=0)
    assert max_diff(results[0][0], dict(case.model().named_parameters()))[0] > 1e-3


def test_split_units_really_have_several_buffers():
    model = GPT(GPTConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=48, max_seq_len=16), device="meta")
    units = fsdp.make_units(model, world_size=2)
    split = [rg.testing.with_buffers(u.plan) for u in units]
    assert all(p.num_buffers >= 2 for p in split)


def test_make_units_passes_max_buffers():
    model = GPT(GPTConfig(vocab_size=50, dim=24, num_layers=1, num_heads=4, ffn_dim=40, max_seq_len=16, num_experts=4),
                device="meta")
    one = fsdp.make_units(model, world_size=8)
    auto = fsdp.make_units(model, world_size=8, max_buffers="auto")
    assert all(u.plan.num_buffers == 1 for u in one)
    assert max(u.plan.num_buffers for u in auto) > 1  # the MoE block: 144 padding elements -> 16
    for a, b in zip(one, auto):
        assert b.plan.padding <= a.plan.padding
    assert sum(u.plan.padding for u in auto) < sum(u.plan.padding for u in one)
