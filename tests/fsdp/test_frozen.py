"""Frozen parameters stay frozen (simulated ranks): ``requires_grad=False`` leaves get no gradient,
no reduce-scatter, no optimizer state and no update; the rest trains exactly like
``torch.optim.AdamW`` over the trainable parameters (float64). The gloo runs are in
``tests/distributed/test_frozen_gloo.py``."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.fsdp._trainable import FLIPPED_MSG
from ragged.fsdp._units import NOTHING_TRAINS_MSG
from tests.fsdp._cases import Case, fsdp_run, max_diff, reference_run

FROZEN_CASES = {
    "embeddings": Case(frozen=("tok_emb.", "pos_emb.")),
    "whole-layer": Case(frozen=("blocks.1.",)),
    "leaf-in-unit": Case(frozen=("blocks.0.attn.wq.weight", "norm.weight")),
    "embeddings-no-decay": Case(frozen=("tok_emb.",), weight_decay=0.0),
    "moe-layer-accum2": Case(moe=True, frozen=("blocks.1.mlp.",), micro_batches=2),
    "auto-buffers-donate": Case(frozen=("blocks.0.mlp.", "head."), max_buffers="auto", donate=True),
}


def check_frozen_case(params, metrics, case):
    """The trained parameters equal torch's, the frozen ones their initial values bit for bit."""
    ref, ref_losses = reference_run(case)
    init = dict(case.model().named_parameters())
    diff, where = max_diff(params, ref)
    assert diff < 1e-10, f"{where} differs from torch.optim.AdamW by {diff}"
    assert max(abs(m["loss"] - r) for m, r in zip(metrics, ref_losses)) < 1e-9
    frozen = [k for k, p in init.items() if not p.requires_grad]
    assert frozen and all(torch.equal(params[k], init[k]) for k in frozen)
    assert max(max_diff({k: params[k]}, {k: init[k]})[0] for k in init if k not in frozen) > 1e-3


@pytest.mark.parametrize("case", list(FROZEN_CASES.values()), ids=list(FROZEN_CASES))
def test_frozen_parameters_stay_frozen(case):
    for params, metrics in rg.collectives.simulate(2, fsdp_run, case):
        check_frozen_case(params, metrics, case)


def _minimal(comm, model, module_bound):
    """The issue's minimal case: a frozen embedding in front of a trained linear layer."""
    units = fsdp.make_units(model, world_size=comm.world_size, groups=["0", "1"])
    mine = copy.deepcopy(model)
    seen = []

    def loss_fn(params, batch):
        seen.append(params["0.weight"].requires_grad)
        out = mine(batch[0]) if module_bound else torch.func.functional_call(mine, params, (batch[0],))
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), batch[1].flatten())

    opt = rg.optim.adamw(0.1, weight_decay=0.1)
    state = fsdp.init(units, model.state_dict(), opt, comm)
    step = fsdp.make_step(units, loss_fn, opt, comm, module=mine if module_bound else None)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 8, (4, 3), generator=g), torch.randint(0, 8, (4, 3), generator=g)
    rows = slice(2 * comm.rank, 2 * comm.rank + 2)
    for _ in range(2):
        state, metrics = step(state, (x[rows], y[rows]))
    return dict(full=rg.gather(units, state.shards, comm), seen=seen, metrics=metrics, units=units,
                moments={k: d.data.numel() for k, d in state.opt_state[0].mu.items()},
                batch=(x, y))


@pytest.mark.parametrize("module_bound", [False, True], ids=["functional_call", "module"])
def test_frozen_embedding_gets_no_gradient_state_or_reduce_scatter(module_bound):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)).double()
    model[0].weight.requires_grad_(False)
    out = rg.collectives.simulate(2, _minimal, model, module_bound)[0]
    x, y = out["batch"]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    assert torch.equal(out["full"]["0.weight"], model[0].weight)
    for k in ("1.weight", "1.bias"):
        torch.testing.assert_close(out["full"][k], dict(ref.named_parameters())[k], rtol=0, atol=1e-12)
    assert out["seen"] == [False, False]  # autograd never computes the frozen leaf's gradient
    assert out["metrics"]["num_reduces"] == 1  # the embedding's unit moves no gradient
    assert out["moments"] == {"1": 20}  # Adam moments of the linear layer's 8x4 + 8 elements over 2 ranks only
    frozen_unit = out["units"]["0"]
    assert frozen_unit.trainable_plan is None and frozen_unit.frozen == {"0.weight"}


def _shapes(comm, model):
    model = copy.deepcopy(model)
    units = fsdp.make_units(model, world_size=2, groups=["1"])  # one unit "rest" and one "1": a partly frozen unit
    params = dict(model.named_parameters())
    grads = {k: torch.full_like(v, float(comm.rank + 1)) for k, v in params.items()}
    reduced = rg.reduce_scatter(units, grads, comm, op="sum")
    full = rg.gather(units, rg.shard(units, params, comm), comm)
    vag = fsdp.value_and_grad(units, lambda p, x: (torch.func.functional_call(model, p, (x,)) ** 2).mean(), comm)
    _, vgrads = vag(rg.shard(units, params, comm), torch.ones(2, 6))
    return units, reduced, vgrads, full, rg.global_norm(units, reduced, comm)


def test_value_and_grad_and_verbs_cover_trainable_leaves_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 6))
    model[0].weight.requires_grad_(False)
    units, reduced, vgrads, full, norm = rg.collectives.simulate(2, _shapes, model)[0]
    rest = units["rest"]
    assert rest.frozen == {"0.weight"} and rest.trainable_paths == ("0.bias",)
    assert rest.plan.num_buffers == 2 and rest.plan.buffers[0] == rest.trainable_plan.buffers[0]
    for grads in (reduced, vgrads):
        assert grads.keys() == {"rest", "1"}
        assert grads["rest"].plan == rest.trainable_plan and grads["1"].plan == units["1"].plan
    assert [l.path for l in reduced["rest"].plan.leaves] == ["['0.bias']"]
    assert torch.equal(full["0.weight"].float(), full["0.weight"].float())  # the frozen leaf is still gathered
    trained = 16 + 16 * 6 + 6
    assert abs(float(norm) - (trained * 3.0 ** 2) ** 0.5) < 1e-4  # summed gradients (1 + 2) of trainable elements


def test_make_units_records_and_checks_trainability():
    tree = {"a": torch.zeros(4, 2), "b": torch.zeros(3)}
    units = fsdp.make_units(tree, world_size=2, trainable=lambda p: p == "['a']")
    assert units["rest"].frozen == {"['b']"}
    with pytest.raises(TypeError, match=re.escape("trainable(\"['a']\") returned 1")):
        fsdp.make_units(tree, world_size=2, trainable=lambda p: 1)
    with pytest.raises(ValueError, match=re.escape(NOTHING_TRAINS_MSG)):
        fsdp.make_units(tree, world_size=2, trainable=lambda p: False)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=re.escape("make_units(trainable=...) is for pytrees")):
        fsdp.make_units(model, world_size=2, trainable=lambda p: True)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=re.escape(NOTHING_TRAINS_MSG)):
        fsdp.make_units(model, world_size=2)


def _flipped(comm, model, when):
    units = fsdp.make_units(model, world_size=2, groups=["0", "1"])
    mine = copy.deepcopy(model)
    opt = rg.optim.adamw(0.1)
    if when == "before-init":
        mine[0].weight.requires_grad_(True)
        try:
            fsdp.init(units, mine, opt, comm)
        except rg.RaggedError as e:
            return str(e), None
        return "no error", None
    state = fsdp.init(units, mine, opt, comm)  # releases mine's parameters: placeholders keep requires_grad
    before = {k: v.clone() for k, v in rg.gather(units, state.shards, comm).items()}
    step = fsdp.make_step(units, lambda p, x: mine(x).square().mean(), opt, comm, module=mine)
    mine[1].weight.requires_grad_(False)
    try:
        step(state, torch.ones(2, 4))
    except rg.RaggedError as e:
        after = rg.gather(units, state.shards, comm)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return "no error", None


@pytest.mark.parametrize("when", ["before-init", "before-step"])
def test_requires_grad_flipped_after_make_units_is_refused_on_every_rank(when):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    for msg, unchanged in rg.collectives.simulate(2, _flipped, model, when):
        path, now = ("0.weight", True) if when == "before-init" else ("1.weight", False)
        where = "fsdp.init" if when == "before-init" else "step(state, batch)"
        assert msg == FLIPPED_MSG.format(where=where, path=path, now=now, then=not now)
        assert unchanged in (None, True)


def _whole_plan_state(comm, model):
    m = copy.deepcopy(model)
    units = fsdp.make_units(m, world_size=2, groups=["0", "1"])
    opt = rg.optim.adamw(0.1)
    shards = rg.shard(units, m.state_dict(), comm)
    before = {k: v.clone() for k, v in rg.gather(units, shards, comm).items()}
    step = fsdp.make_step(units, lambda p, x: torch.func.functional_call(m, p, (x,)).square().mean(), opt, comm)
    state = fsdp.TrainState(shards, opt.init(shards))  # the optimizer over the whole shards, frozen leaves included
    try:
        step(state, torch.ones(2, 4))
    except rg.RaggedError as e:
        after = rg.gather(units, shards, comm)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return "no error", None


def test_optimizer_state_over_frozen_leaves_is_refused_before_communication():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    for msg, unchanged in rg.collectives.simulate(2, _whole_plan_state, model):
        assert msg.startswith("step(state, batch): state.opt_state[...] holds a DBuffer over the whole plan of unit '0'")
        assert "(0.weight) included" in msg and unchanged


def _two_stages(comm, case, stage_two_frozen, path):
    """Stage 1 trains ``case`` (its frozen parameters frozen) and saves; stage 2 makes units with
    another trainable set, loads the parameters and starts the optimizer afresh."""
    first = fsdp_run(comm, case, save=path)[0]
    model = Case(frozen=stage_two_frozen).model()
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = case.make_optimizer()
    like = fsdp.init(units, model.state_dict(), opt, comm)
    shards = rg.checkpoint.load(path, fsdp.TrainState(like.shards, None), comm, strict=False).shards
    state = fsdp.TrainState(shards, opt.init(fsdp.trainable_shards(units, shards)))
    step = fsdp.make_step(units, rg.examples.gpt.loss_fn(copy.deepcopy(model)), opt, comm)
    task = case.task()
    for s in range(case.steps, 2 * case.steps):
        state, _ = step(state, rg.examples.data.rank_slice(task.batch(s, case.batch), comm.rank, comm.world_size))
    return first, {k: v.clone() for k, v in rg.gather(units, state.shards, comm).items()}


@pytest.mark.parametrize("stage_two_frozen", [(), ("blocks.0.", "tok_emb.")], ids=["unfreeze", "freeze-more"])
def test_trainable_set_changes_between_runs_through_a_checkpoint(tmp_path, stage_two_frozen):
    case = Case(frozen=("tok_emb.", "pos_emb."))
    first, second = rg.collectives.simulate(2, _two_stages, case, stage_two_frozen, str(tmp_path / "ckpt"))[0]
    model = case.model()  # torch: AdamW over the stage-1 trainable set, then a new AdamW over the stage-2 set
    task, fn = case.task(), rg.examples.gpt.loss_fn(model)
    for stage, steps in ((case.frozen, range(case.steps)), (stage_two_frozen, range(case.steps, 2 * case.steps))):
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(stage))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=case.lr,
                                weight_decay=case.weight_decay)
        for s in steps:
            opt.zero_grad()
            fn(dict(model.named_parameters()), task.batch(s, case.batch)).backward()
            opt.step()
        if stage == case.frozen:
            assert max_diff(first, dict(model.named_parameters()))[0] < 1e-10
    assert max_diff(second, dict(model.named_parameters()))[0] < 1e-10


def _lora_in_two_dtypes(comm, model, frozen_dtype):
    from tests.fsdp._cases import lm_batches, train_sharded

    policy = fsdp.MixedPrecision(frozen_dtype=frozen_dtype)
    params, metrics = train_sharded(comm, copy.deepcopy(model), lm_batches(), policy=policy)
    return params, metrics[-1]["peak_gathered_bytes"], metrics[-1]["model_bytes"]


def test_frozen_leaves_gathered_in_their_own_dtype():
    """MixedPrecision(frozen_dtype=float32) on a float64 LoRA model: the frozen base is gathered
    and computed in float32 (half its bytes), the adapters train in float64 like torch.optim.AdamW
    on the same model with its frozen weights cast to float32, and the base stays bit-identical."""
    from tests.distributed.test_finetune_gloo import lora_llama
    from tests.fsdp._cases import lm_batches, train_reference

    model = lora_llama()
    (full, peak, model_bytes), _ = rg.collectives.simulate(2, _lora_in_two_dtypes, model, torch.float32)
    (_, peak64, model_bytes64), _ = rg.collectives.simulate(2, _lora_in_two_dtypes, model, None)
    ref_model = copy.deepcopy(model)
    for p in ref_model.parameters():
        if not p.requires_grad:
            p.data = p.data.float()
    ref = train_reference(ref_model, lm_batches())
    for k, p in model.named_parameters():
        if p.requires_grad:
            assert (full[k] - ref[k]).abs().max().item() < 1e-10, k
        else:
            assert torch.equal(full[k], p)  # the float64 master of a frozen leaf never changes
    assert model_bytes < 0.55 * model_bytes64 and peak < peak64
