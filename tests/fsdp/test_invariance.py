"""The chunked step (``fsdp.make_step(..., chunks=C)``) on simulated ranks: everything the step goes
through gives W=1's numbers at W=2 and HSDP 2 x 2, bit for bit; ``local_chunks``; what is refused
(at make_step, on every rank, naming C, W and the fix). The core claims on gloo processes, both
transports: tests/distributed/test_invariance_gloo.py."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.gpt import loss_fn
from ragged.fsdp._schedule import CollectiveSchedule
from tests.fsdp import _invariance_cases as ic

simulate = rg.collectives.simulate
FP8 = rg.quant.fp8(block=(8, 8))


def _fp8(leaf):
    return FP8 if len(leaf.shape) >= 2 and leaf.shape[-2] % 8 == 0 and leaf.shape[-1] % 8 == 0 else None


def _same_at_every_world_size(fn, *args, **kw):
    ref = simulate(1, fn, *args, **kw)[0]
    for world, mesh in ((2, None), (4, (2, 2))):
        for r, got in enumerate(simulate(world, fn, *args, mesh_shape=mesh, **kw)):
            assert ic.same(got, ref), f"W={world} mesh {mesh} rank {r}: {ic.difference(got, ref)}"
    return ref


VARIANTS = {
    "sgd": dict(opt="sgd"),
    "shampoo": dict(opt="shampoo"),
    "muon": dict(opt="muon"),
    "schedule, apply_if_finite": dict(opt="schedule+finite"),
    "bf16 compute, fp32 reduce": dict(policy=fsdp.MixedPrecision(compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "bf16 reduce": dict(policy=fsdp.MixedPrecision(compute_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
    "fp8 all-gather": dict(policy=fsdp.MixedPrecision(gather_format=_fp8)),
    "fp8 reduce-scatter": dict(policy=fsdp.MixedPrecision(reduce_format=_fp8)),
    "activation checkpointing": dict(checkpoint=True),
    "compiled blocks": dict(compile=True),
    "frozen parameters": dict(frozen=("tok_emb.weight", "blocks.0.attn_norm.weight", "blocks.1.mlp.w_up")),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_what_the_step_goes_through_keeps_the_numbers_of_one_rank(variant):
    kw = dict(VARIANTS[variant])
    _same_at_every_world_size(ic.train, "dense", kw.pop("opt", "adamw+clip"), **kw)


def test_replicated_leaves_keep_the_numbers_of_one_rank():
    """spec.Replicate() vectors: all-reduced over the shard group, at 4 ranks as an all-gather of every
    rank's copy summed over the tree (up to 2 ranks the all-reduce adds once)."""
    def specs(path, t):
        return rg.spec.Replicate() if t.dim() == 1 else ic.specs(path, t)

    ref = simulate(1, ic.train, specs=specs)[0]
    for world in (2, 4):
        for r, got in enumerate(simulate(world, ic.train, specs=specs)):
            assert ic.same(got, ref), f"W={world} rank {r}: {ic.difference(got, ref)}"


def _lora_run(comm, lora):
    model = copy.deepcopy(lora)
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = rg.optim.adamw(1e-2)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, lambda p, t: model(input_ids=t, labels=t).loss, opt, comm, module=model, chunks=4)
    losses = []
    for s in range(2):
        tokens = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(s))
        state, metrics = step(state, fsdp.local_chunks(tokens, 4, comm))
        losses.append(metrics["loss"])
    return losses, dict(rg.gather(units, state.shards, comm)), []


def test_lora_keeps_the_numbers_of_one_rank():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)
    torch.manual_seed(0)
    lora = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    _same_at_every_world_size(_lora_run, lora)


def test_late_gradients_rerun_the_call_inside_the_tree():
    """A schedule that reduce-scatters unit 0 before its gradients arrive: the chunked step reruns
    the call with the learnt schedule (a separate late reduce-scatter would add outside the tree)."""
    def run(comm):
        module = ic.model("dense")
        units = fsdp.make_units(module, world_size=comm.world_size)
        opt = rg.optim.adamw(1e-2)
        state = fsdp.init(units, module.state_dict(), opt, comm)
        step = fsdp.make_step(units, loss_fn(copy.deepcopy(module)), opt, comm, chunks=4)
        first = CollectiveSchedule.initial(len(units))
        step.value_and_grad.memo.schedule = dataclasses.replace(
            first, reduce_at=(len(first.forward) - 1,) + first.reduce_at[1:], learning=False)
        state, metrics = step(state, fsdp.local_chunks(ic.global_batch(0), 4, comm))
        assert metrics["schedule_reruns"] == 1
        return [metrics["loss"]], dict(rg.gather(units, state.shards, comm)), []

    _same_at_every_world_size(run)


def test_local_chunks_interleaves_the_chunks_over_the_data_parallel_ranks():
    rows = torch.arange(16).view(8, 2)

    def fn(comm):
        return fsdp.local_chunks({"x": rows, "y": rows[:, 0]}, 4, comm)

    got = simulate(4, fn, mesh_shape=(2, 2))  # rank d = replica * 2 + rank gets chunks d, 4 + d, ...
    assert [g["y"].tolist() for g in got] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert [g["y"].tolist() for g in simulate(2, fn)] == [[0, 2, 8, 10], [4, 6, 12, 14]]
    assert torch.equal(simulate(1, fn)[0]["x"], rows)
    with pytest.raises(ValueError, match=re.escape("batch['y'] has shape (6,); with chunks=4 its leading dimension")):
        simulate(1, lambda c: fsdp.local_chunks({"y": torch.zeros(6)}, 4, c))
    with pytest.raises(ValueError, match=re.escape("chunks=4 does not split over the data-parallel world size W=8")):
        fsdp.local_chunks(rows, 4, rg.collectives.abstract(4, num_replicas=2))


def _make(comm, **kw):
    module = ic.model("dense")
    units = fsdp.make_units(module, world_size=comm.world_size, specs=ic.specs)
    return fsdp.make_step(units, loss_fn(module), rg.optim.sgd(0.1), comm, **kw)


@pytest.mark.parametrize("world, replicas, kw, message", [
    (3, 1, dict(chunks=4), "chunks=4 at data-parallel world size W=3: W does not divide chunks=4. Fix: run at a "
                           "data-parallel world size in (1, 2, 4), or chunks=3"),
    (3, 1, dict(chunks=6), "chunks=6 gives the same numbers at W in (1, 2, 6) only"),
    (2, 4, dict(chunks=8), "4 HSDP replicas: their all-reduce adds more than two terms"),
    (3, 2, dict(chunks=6), "W=6 (3 ranks x 2 HSDP replicas): two HSDP replicas of 3 ranks"),
    (2, 1, dict(chunks=8, micro_batches=2), "micro_batches=2 with chunks=8 at W=2: each rank runs its chunks / W = 4"),
    (2, 1, dict(chunks=0), "chunks must be a positive int"),
    (2, 1, dict(chunks=4, policy=fsdp.MixedPrecision(reduce_dtype=torch.bfloat16, reduce_format=_fp8)),
     "chunks= with a quantized reduce-scatter into torch.bfloat16"),
], ids=["not dividing", "not a power of two", "4 replicas", "odd replicas", "micro_batches", "zero", "fp8 into bf16"])
def test_a_world_size_or_setting_the_tree_cannot_serve_is_refused_at_make_step(world, replicas, kw, message):
    for rank in range(world):  # every rank raises alike: the refusal reads only what they share
        with pytest.raises(ValueError, match=re.escape(message)):
            _make(rg.collectives.abstract(world, rank=rank, num_replicas=replicas), **kw)
    assert _make(rg.collectives.abstract(4, num_replicas=2), chunks=8).micro_batches == 1
    assert _make(rg.collectives.abstract(3), chunks=3).micro_batches == 1  # W = C: one micro-batch, any C


def test_expert_parallelism_is_refused_with_chunks():
    comm = rg.collectives.abstract(2)
    with pytest.raises(ValueError, match=re.escape("chunks= with data_groups (expert parallelism): an expert's matmul")):
        _make(comm, chunks=4, data_groups=[(rg.collectives.abstract(2), lambda path: True)])
