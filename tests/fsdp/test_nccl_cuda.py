"""ragged over a real single-rank NCCL communicator (``pytest -m cuda``, run by
``scripts/gpu_check.sh``; skipped without CUDA): the training step with AdamW, with 8-bit AdamW, and
with the quantized wire (an fp8 gather, an int8 reduce-scatter), in NCCL's shape (native
collectives + the deferred ledger, the default on NCCL), with nothing turned into a local copy:
every all-gather and reduce-scatter ragged issues reaches NCCL's process group (counted at both
boundaries by ``bench/_counts.CommCounter``), and the ledger's checks are issued too (its
all-reduces, beyond ragged's own). So real kernels, streams, events and waits run. Also: the
optimizer update alone makes no host sync on CUDA DBuffers (``tests/_host_syncs.py``), and the
step's syncs are counted.

What one GPU cannot test (two ranks: NCCL refuses two on one device) is emulated on gloo by
``tests/distributed/test_nccl_rules_gloo.py``. One spawned process runs every check;
``test_the_checks_run_on_gloo`` runs the same code on the CPU (gloo, W=1), so that the suite
keeps it working where no GPU is.
"""

from __future__ import annotations

import math

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU)")
CONFIGS = ("adamw", "adamw_8bit", "quantized wire")
VERIFY_EVERY = 4  # the ledger checks every 4 recorded calls: several checks in two steps


def _step_parts(name):
    """``(case, optimizer, specs, policy)`` of a configuration."""
    import ragged as rg
    from ragged import fsdp
    from tests.fsdp import _quant_cases as qc
    from tests.fsdp._cases import Case

    case = Case(num_layers=1, steps=3)  # dense: an MoE's routing reads values on the host (nonzero)
    if name == "adamw_8bit":
        return case, rg.optim.adamw_8bit(case.lr, weight_decay=case.weight_decay, min_size=256), qc.specs, None
    policy = None
    if name == "quantized wire":
        pick = lambda fmt: (lambda leaf: qc.chooser(fmt)(leaf.shape))  # noqa: E731
        policy = fsdp.MixedPrecision(gather_format=pick("fp8"), reduce_format=pick("int8"))
    return case, case.make_optimizer(), qc.specs if policy else None, policy


def _run(comm, name, counter, device):
    """Three steps of a configuration: the first learns the schedule, the second's collectives
    are counted at both boundaries, the third's host syncs. Returns the counts and the losses."""
    import copy

    from ragged import fsdp
    from ragged.examples.gpt import loss_fn
    from tests._host_syncs import HostSyncs

    case, opt, specs, policy = _step_parts(name)
    model = case.model().to(device)
    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs)
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm, policy=policy)
    task, losses = case.task(), []
    batches = [tuple(t.to(device) for t in task.batch(s, case.batch)) for s in range(case.steps)]
    state, m = step(state, batches[0])
    losses.append(float(m["loss"]))
    counter.reset()
    counter.active = "step"
    state, m = step(state, batches[1])
    counter.active = None
    losses.append(float(m["loss"]))
    with HostSyncs(device) as syncs:
        state, m = step(state, batches[2])
    losses.append(float(m["loss"]))
    return {"records": counter.records("step"), "step_syncs": syncs.events, "losses": losses}


def _update_syncs(device) -> dict:
    """Host syncs of the second optimizer update on ``device``'s DBuffers, per optimizer."""
    import ragged as rg
    from ragged import spec
    from tests._host_syncs import HostSyncs

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 96, generator=g), "b": torch.randn(96, generator=g)}
    plan = rg.make_plan(params, {"w": spec.Blocks(32, 32), "b": spec.Elements(1)}, world_size=1)
    on = lambda t: rg.shard(plan, rg.pytree.map(lambda x: x.to(device), t), rank=0)  # noqa: E731
    out = {}
    for name, opt in {"adamw": rg.optim.adamw(1e-2, weight_decay=0.1),
                      "adamw_8bit": rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000)}.items():
        local = on(params)
        state = opt.init(local)
        for k in range(2):
            grads = on(rg.pytree.map(lambda x: torch.randn_like(x) * (k + 1), params))  # copied from the host
            with HostSyncs(device) as syncs:
                _, state = opt.update(grads, state, local)
        out[name] = syncs.events
    return out


def _checks(rank, world, backend):
    """Runs in one spawned process (W=1) on NCCL (or gloo: the CPU's run of this code)."""
    import ragged as rg
    from bench._counts import CommCounter

    comm = rg.collectives.from_torch(handshake="deferred", verify_every=VERIFY_EVERY)
    device = comm.device
    counter = CommCounter()  # ragged's calls on axis "shard", NCCL's on "world" (the default group)
    counter.install_comm(comm, "step")
    counter.install_torch("step")
    out = {"device": str(device), "backend": backend, "update_syncs": _update_syncs(device)}
    for name in CONFIGS:
        out[name] = _run(comm, name, counter, device)
    return out


@pytest.fixture(scope="module")
def results():
    from bench._launch import launch

    return launch(1, _checks, backend="nccl", timeout=600)[0]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", CONFIGS)
def test_every_collective_reaches_nccl(results, name):
    """Nothing turned into a local copy: each all-gather and reduce-scatter ragged issued is one
    call on NCCL's process group; the ledger's checks are all-reduces beyond ragged's own."""
    assert results["backend"] == "nccl" and results["device"].startswith("cuda"), results
    _assert_nothing_local(name, results[name])


def _assert_nothing_local(name, run):
    rec = run["records"]
    moved = "all_to_all" if name == "quantized wire" else "reduce_scatter"  # the quantized one: an all-to-all
    assert {kind for kind, axis in rec if axis == "shard" and kind != "all_reduce"} == {"all_gather", moved}, rec
    for kind in ("all_gather", moved):
        assert rec.get((kind, "world"), (0, 0))[0] == rec[(kind, "shard")][0] > 0, (kind, rec)
    assert rec.get(("all_reduce", "world"), (0, 0))[0] > rec.get(("all_reduce", "shard"), (0, 0))[0], rec
    assert all(map(math.isfinite, run["losses"])), run["losses"]


@pytest.mark.cuda
@needs_cuda
def test_the_optimizer_update_makes_no_host_sync_on_cuda(results):
    assert results["update_syncs"] == {"adamw": [], "adamw_8bit": []}, results["update_syncs"]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", CONFIGS)
def test_a_step_makes_at_most_three_host_syncs(results, name):
    """The step's bound, on the device (docs/gpu.md states it)."""
    assert len(results[name]["step_syncs"]) <= 3, results[name]["step_syncs"]


def test_the_checks_run_on_gloo():
    """The same code on the CPU (gloo, W=1, NCCL's shape): every configuration trains with nothing
    turned into a local copy and the ledger checking, and the optimizer update makes no host sync
    (the step's syncs are counted as the CPU's counter sees them, not held to the device's bound)."""
    from bench._launch import launch

    out = launch(1, _checks, backend="gloo", timeout=600)[0]
    assert out["update_syncs"] == {"adamw": [], "adamw_8bit": []}, out["update_syncs"]
    for name in CONFIGS:
        _assert_nothing_local(name, out[name])
