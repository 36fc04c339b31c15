"""FSDP2 <-> ragged mid-run on real gloo process groups: FSDP2 (``fully_shard`` every block and the
root, ``torch.optim.AdamW``, float64) trains 2 steps at W=a and saves with ``dcp.save``; ragged
loads it at W=b (``fsdp.init(units, rg.checkpoint.fsdp2(path), opt, comm)``), trains 2 steps and
saves (``fsdp.save_fsdp2``); FSDP2 loads that at W=c with plain ``dcp.load`` +
``set_model_state_dict`` / ``set_optimizer_state_dict`` and trains 2 more. Every parameter equals
FSDP2 trained alone for the 6 steps within 1e-10, with the world size changing across each switch
(2 -> 4 -> 2 and 4 -> 2 -> 4), ragged's pieces whole rows or single elements (ranges that start
and end mid-row, so the N-D boxes of [Note: a flat range as boxes] are partial rows), in both
ragged transports."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._harness import both_transports, comm, transport as transport_options, workers_fixture
from tests.fsdp._cases import Case

pytestmark = pytest.mark.distributed

workers2, workers4 = workers_fixture(2), workers_fixture(4)
transport = both_transports()

CASE = Case(num_layers=2, steps=0)
K = J = M = 2
_REFERENCE: dict = {}


def _fsdp2(src, out, steps):
    """FSDP2 at this pool's W: load ``src`` (if given), train ``steps``, save to ``out`` (if
    given); rank 0 returns the full parameters."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    from ragged.examples.data import rank_slice

    rank, w = dist.get_rank(), dist.get_world_size()
    model = CASE.model() if src is None else Case(num_layers=CASE.num_layers, seed=5).model()  # loaded: other values
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=CASE.lr, weight_decay=CASE.weight_decay)
    if src is not None:
        sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=src)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optimizer"])
    task = CASE.task()
    for s in steps:
        x, y = rank_slice(task.batch(s, CASE.batch), rank, w)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    if out is not None:
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=out)
    full = {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}
    steps_seen = sorted({float(st["step"]) for st in opt.state.values()})
    return (full, steps_seen) if rank == 0 else None


def _ragged(src, out, steps, elements):
    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import rank_slice
    from ragged.examples.gpt import loss_fn

    c = comm()
    model = Case(num_layers=CASE.num_layers, seed=9).model()  # loaded: other values
    specs = (lambda path, t: rg.spec.Elements(1)) if elements else None  # pieces that start and end mid-row
    units = fsdp.make_units(model, world_size=c.world_size, specs=specs)
    opt = CASE.make_optimizer()
    state = fsdp.init(units, rg.checkpoint.fsdp2(src), opt, c)
    step = fsdp.make_step(units, loss_fn(model), opt, c)
    task = CASE.task()
    for s in steps:
        state, _ = step(state, rank_slice(task.batch(s, CASE.batch), c.rank, c.world_size))
    fsdp.save_fsdp2(units, state, c, out, optimizer=opt)
    return int(state.opt_state[0].count)


SWITCHES = [(2, 4, 2, False), (4, 2, 4, True)]  # ragged's granularity: whole rows (the default) or single elements


@pytest.fixture(scope="module")
def fsdp2_dirs(tmp_path_factory):
    """``{a: the directory FSDP2 saved after K steps at W=a}``, each made once (the ragged
    transports do not touch it)."""
    return {}


@pytest.mark.parametrize("a,b,c,elements", SWITCHES,
                         ids=[f"w{a}-w{b}-w{c}-{'elements' if e else 'rows'}" for a, b, c, e in SWITCHES])
def test_fsdp2_ragged_fsdp2_equals_fsdp2_alone(request, tmp_path_factory, tmp_path, fsdp2_dirs, a, b, c, elements):
    pools = {w: request.getfixturevalue(f"workers{w}") for w in (a, b, c)}
    if a not in fsdp2_dirs:
        fsdp2_dirs[a] = str(tmp_path_factory.mktemp("fsdp2") / f"w{a}")
        pools[a].run(_fsdp2, None, fsdp2_dirs[a], range(K))
    first, second = fsdp2_dirs[a], str(tmp_path / "ragged")
    assert pools[b].run(_ragged, first, second, range(K, K + J), elements) == [K + J] * b
    got, seen = pools[c].run(_fsdp2, second, None, range(K + J, K + J + M))[0]
    assert seen == [float(K + J + M)]
    if a not in _REFERENCE:
        _REFERENCE[a] = pools[a].run(_fsdp2, None, None, range(K + J + M))[0][0]
    ref = _REFERENCE[a]
    init = dict(CASE.model().named_parameters())
    assert sorted(got) == sorted(ref)
    diffs = {k: (got[k] - ref[k]).abs().max().item() for k in ref}
    assert max(diffs.values()) < 1e-10, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    moved = {k: (ref[k] - init[k]).abs().max().item() for k in ref}
    assert min(moved.values()) > 1e-4, moved  # every parameter moved: the comparison can fail


def _refused(src):
    import ragged as rg
    from ragged import fsdp
    from ragged.checkpoint import CheckpointMismatchError

    import torch.distributed as dist

    c = rg.collectives.from_torch(**transport_options())  # its own comm: the refusal poisons it (see transforms/_check.py)
    model = CASE.model()
    units = fsdp.make_units(model, world_size=c.world_size)
    try:
        fsdp.init(units, rg.checkpoint.fsdp2(src), rg.optim.adamw(2 * CASE.lr, weight_decay=CASE.weight_decay), c)
    except CheckpointMismatchError as exc:
        dist.barrier()  # every rank got here: none was left waiting in a collective
        return str(exc)
    return None


def test_hyperparameter_mismatch_refused_on_every_rank(workers2, tmp_path):
    path = str(tmp_path / "fsdp2")
    workers2.run(_fsdp2, None, path, range(1))
    got = workers2.run(_refused, path)
    assert got[0] == got[1] and "has lr=0.01" in got[0] and "the ragged optimizer lr=0.02" in got[0], got
