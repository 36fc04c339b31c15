"""Checkpointing the FSDP training step's state (``ragged.fsdp.TrainState``: one DBuffer per
unit + the optimizer state): resume on another world size, consolidate into the module's state dict."""

from __future__ import annotations

import copy

import torch

import ragged as rg
from ragged import fsdp

simulate = rg.collectives.simulate


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def _batches(n):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _loss(module):
    def loss_fn(params, batch):
        x, y = batch
        return ((torch.func.functional_call(module, params, (x,)) - y) ** 2).mean()

    return loss_fn


def _run(comm, model, state, batches):
    units = _units(model, comm.world_size)
    opt = rg.optim.adamw(1e-2, weight_decay=0.01)
    step = fsdp.make_step(units, _loss(copy.deepcopy(model)), opt, comm)
    b = 8 // comm.world_size
    for x, y in batches:
        rows = slice(b * comm.rank, b * (comm.rank + 1))
        state, _ = step(state, (x[rows], y[rows]))
    return state


def _units(model, m):
    return fsdp.make_units(model, world_size=m, groups=["0", "2", "4"])


def _init(comm, model):
    # the state dict, not the module: init would release a module's parameters, and the tests reuse it
    return fsdp.init(_units(model, comm.world_size), model.state_dict(), rg.optim.adamw(1e-2, weight_decay=0.01), comm)


def test_fsdp_state_resumes_on_another_world_size(tmp_path):
    model, batches, path = _model(), _batches(4), tmp_path / "ckpt"

    def first(comm):
        state = _run(comm, model, _init(comm, model), batches[:2])
        rg.checkpoint.save(path, {"train": state, "step": 2}, comm)

    simulate(2, first)

    def second(comm):
        loaded = rg.checkpoint.load(path, {"train": _init(comm, model), "step": 0}, comm)
        assert loaded["step"] == 2
        state = _run(comm, model, loaded["train"], batches[2:])
        ref = _run(comm, model, _init(comm, model), batches)
        units = _units(model, comm.world_size)
        clone = lambda tree: {k: v.clone() for k, v in tree.items()}  # noqa: E731
        return clone(rg.gather(units, state.shards, comm)), clone(rg.gather(units, ref.shards, comm))

    resumed, reference = simulate(4, second)[0]
    for name, ref in reference.items():
        assert not torch.allclose(ref, dict(model.named_parameters())[name])
        torch.testing.assert_close(resumed[name], ref, msg=name)

    # One file with the module's own parameter names, loadable without ragged.
    exported = rg.checkpoint.consolidate(path, prefix="train.shards", leaf_names=True)
    assert sorted(exported) == sorted(n for n, _ in model.named_parameters())
    fresh = _model()
    fresh.load_state_dict(exported)

    def gathered(comm):
        loaded = rg.checkpoint.load(path, {"train": _init(comm, model), "step": 0}, comm)
        return {k: v.clone() for k, v in rg.gather(_units(model, 1), loaded["train"].shards, comm).items()}

    for name, value in simulate(1, gathered)[0].items():
        torch.testing.assert_close(dict(fresh.named_parameters())[name].detach(), value, rtol=0, atol=0)
