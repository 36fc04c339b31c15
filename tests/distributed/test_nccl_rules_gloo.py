"""NCCL's rules, kept by NCCL's shape on gloo (issue 44): the stand-in for a multi-GPU CI (see
[Note: NCCL's rules on gloo] in ragged/collectives/_gloo_device.py and docs/engine.md).

Under ``handshake="deferred"`` on gloo every work fails the comm on a timed wait, reports its
completion late by a random number of queries drawn per rank, and every rank's collectives,
interleaved across the shard and replica groups, are compared at each agreement point. Training
in that transport must therefore make no timed wait, issue the same collectives in the same order
on every rank (every ``verify_every`` calls a device-side check, whatever the device's progress)
and give the losses and parameters of gloo's default transport, bit for bit."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import ragged as rg
from ragged import CollectiveError
from tests.distributed._harness import mesh, workers_fixture
from tests.fsdp._cases import Case, fsdp_run

pytestmark = pytest.mark.distributed

workers2 = workers_fixture(2)
workers4 = workers_fixture(4)


def _timed_wait():
    """A timed wait on a work of NCCL's shape fails the comm: this rank raises, its peer's next
    call raises the poison (through the ledger's watcher, no timeout)."""
    comm = rg.collectives.from_torch(dist.new_group(list(range(dist.get_world_size()))), handshake="deferred")
    t = torch.ones(4)
    comm.all_reduce(t)
    outcome = []
    try:
        if comm.rank == 0:
            work = comm._ledger.issued(dist.all_reduce(t, group=comm.group, async_op=True))
            work.wait(datetime.timedelta(seconds=30))
        else:
            dist.all_reduce(t, group=comm.group)  # the peer of the raw call above
        comm.all_reduce(t)  # rank 1 waits in it until its watcher sees rank 0's poison
        outcome.append("no error")
    except CollectiveError as e:
        outcome.append(str(e))
    return outcome[0]


def test_a_timed_wait_fails_the_comm_on_every_rank(workers2):
    mine, peer = workers2.run(_timed_wait)
    assert "a timed wait" in mine and "NCCL" in mine, mine
    assert "a timed wait" in peer, peer


def _steps(case, handshake, replicas=1, verify_every=64):
    """The case's losses and parameters through one transport; NCCL's shape ends with a
    ``comm.verify()``, so a difference in the collectives of the last step is raised too."""
    group = mesh((replicas, dist.get_world_size() // replicas)) if replicas > 1 else None
    comm = rg.collectives.from_torch(group, handshake=handshake, verify_every=verify_every)
    params, metrics = fsdp_run(comm, case)
    comm.verify()
    return [m["loss"] for m in metrics], params


def _both(case, replicas=1):
    deferred = _steps(case, "deferred", replicas, verify_every=3)  # a device-side check every 3 calls of a group
    header = _steps(case, "header", replicas)
    return deferred, header


@pytest.mark.parametrize("case", [Case(steps=2, micro_batches=2, max_inflight_reduce=2),
                                  Case(steps=2, moe=True, micro_batches=2)], ids=["dense-accum2-inflight2", "moe-accum2"])
def test_training_in_nccl_shape_keeps_its_rules_and_gloos_numbers(workers2, case):
    for (losses, params), (ref_losses, ref) in workers2.run(_both, case):
        assert losses == ref_losses
        assert all(torch.equal(params[k], ref[k]) for k in ref)


def test_hsdp_issues_both_groups_calls_in_one_order_on_every_rank(workers4):
    """2 replicas x 2 shards: each unit's all-reduce over the replicas comes at the same place among
    the shard group's collectives on every rank, whatever the device's progress."""
    case = Case(steps=2, micro_batches=2, max_inflight_reduce=2)
    for (losses, params), (ref_losses, ref) in workers4.run(_both, case, 2):
        assert losses == ref_losses
        assert all(torch.equal(params[k], ref[k]) for k in ref)


def _step_syncs(optimizer: str, clip: str | None, scheduled: bool):
    """The host syncs (``tests/_host_syncs.py``) of the third step of the tiny GPT in NCCL's shape,
    after a first that learns the schedule and a second."""
    import copy

    from ragged import fsdp
    from ragged.examples.gpt import loss_fn
    from tests._host_syncs import HostSyncs

    comm = rg.collectives.from_torch(handshake="deferred")
    case = Case(steps=3, dtype=torch.float32)
    lr = rg.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10) if scheduled else 1e-2
    opt = rg.optim.adamw(lr, weight_decay=0.1) if optimizer == "adamw" else rg.optim.adamw_8bit(lr, min_size=64)
    if clip is not None:
        opt = rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=comm, error_if_nonfinite=clip == "finite"), opt)
    model = case.model()
    units = fsdp.make_units(model, world_size=comm.world_size)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm)
    task = case.task()
    for s in range(3):
        batch = tuple(t.chunk(comm.world_size)[comm.rank] for t in task.batch(s, case.batch))
        if s < 2:
            state, _ = step(state, batch)
            continue
        with HostSyncs() as syncs:
            state, _ = step(state, batch)
    return syncs.events


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
@pytest.mark.parametrize("clip", [None, "clip", "finite"], ids=["no-clip", "clip", "clip-error-if-nonfinite"])
def test_a_step_makes_at_most_three_host_syncs(workers2, optimizer, clip):
    """What makes the host wait for the device in a steady step (docs/gpu.md): the start-of-call and
    end-of-call agreements read their results, and ``error_if_nonfinite`` adds its agreement; a
    learning-rate schedule's value (checked, and compared across ranks) adds none."""
    for scheduled in (False, True):
        for events in workers2.run(_step_syncs, optimizer, clip, scheduled):
            assert len(events) == 2 + (clip == "finite"), (scheduled, events)
