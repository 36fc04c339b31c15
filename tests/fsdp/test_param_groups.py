"""Per-group hyperparameters by module type (``Units.param_groups`` + ``rg.optim.multi_transform``)
equal ``torch.optim.AdamW`` with the same ``param_groups`` (float64): norms without weight decay,
embeddings without decay at 10x the learning rate, everything else decayed. The gloo run is in
``tests/distributed/test_finetune_gloo.py``."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.data import rank_slice
from tests.fsdp._cases import Case, max_diff, reference_run

LR, DECAY = 1e-2, 0.1
RULES = {torch.nn.Embedding: "embed", torch.nn.RMSNorm: "no_decay"}


def optimizer(units):
    return rg.optim.multi_transform(
        {"decay": rg.optim.adamw(LR, weight_decay=DECAY), "no_decay": rg.optim.adamw(LR),
         "embed": rg.optim.adamw(10 * LR)},
        units.param_groups(RULES, default="decay"),
    )


def torch_groups(model):
    """The same groups, written as a torch user writes them."""
    groups = {"decay": [], "no_decay": [], "embed": []}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            key = "embed" if isinstance(module, torch.nn.Embedding) else "no_decay" if isinstance(module, torch.nn.RMSNorm) else "decay"
            groups[key].append(p)
    return [{"params": groups["decay"], "weight_decay": DECAY}, {"params": groups["no_decay"], "weight_decay": 0.0},
            {"params": groups["embed"], "weight_decay": 0.0, "lr": 10 * LR}]


def grouped_run(comm, case):
    """(full params after training, per-step losses) with module-type groups."""
    model = case.model()
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = optimizer(units)
    state = fsdp.init(units, model, opt, comm)
    loss = rg.examples.gpt.loss_fn(copy.deepcopy(case.model()))
    step = fsdp.make_step(units, loss, opt, comm)
    task, losses = case.task(), []
    for s in range(case.steps):
        state, m = step(state, rank_slice(task.batch(s, case.batch), comm.rank, comm.world_size))
        losses.append(m["loss"])
    return {k: v.clone() for k, v in rg.gather(units, state.shards, comm).items()}, losses


def grouped_reference(case):
    model = case.model()
    opt = torch.optim.AdamW(torch_groups(model), lr=LR)
    task, fn = case.task(), rg.examples.gpt.loss_fn(model)
    for s in range(case.steps):
        opt.zero_grad()
        fn(dict(model.named_parameters()), task.batch(s, case.batch)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def check_grouped(params, case):
    ref = grouped_reference(case)
    diff, where = max_diff(params, ref)
    assert diff < 1e-10, f"{where}: {diff}"
    assert max_diff(params, reference_run(case)[0])[0] > 1e-3  # one decayed group (lr 1e-2, decay 0.1) differs


def test_module_type_groups_match_torch_param_groups():
    case = Case()
    for params, _ in rg.collectives.simulate(2, grouped_run, case):
        check_grouped(params, case)


def test_param_groups_refuses_rules_that_select_nothing_trainable():
    model = Case(frozen=("tok_emb.",)).model()
    units = fsdp.make_units(model, world_size=2)
    with pytest.raises(ValueError, match=re.escape("the rule <class 'torch.nn.modules.linear.Bilinear'> -> 'x' matches no parameter")):
        units.param_groups({torch.nn.Bilinear: "x"}, default="decay")
    with pytest.raises(ValueError, match=re.escape("'gamma' -> 'x' matches no parameter")):
        units.param_groups({"gamma": "x"}, default="decay")
    model.pos_emb.weight.requires_grad_(False)
    units = fsdp.make_units(model, world_size=2)
    with pytest.raises(ValueError, match=re.escape("matches only frozen parameters (2)")):
        units.param_groups(RULES, default="decay")
    with pytest.raises(TypeError, match="must be a module type"):
        units.param_groups({3: "x"}, default="decay")
    tree_units = fsdp.make_units({"w": torch.zeros(2)}, world_size=2)
    with pytest.raises(TypeError, match="make the units from an nn.Module"):
        tree_units.param_groups(RULES, default="decay")
