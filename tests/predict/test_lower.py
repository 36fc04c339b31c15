"""``step.lower(...)`` against real steps on the simulated backend: the persistent bytes of every
rank by category and every collective's calls and bytes exact, the gathered-buffer peak exact,
the gradient-buffer peak within the predicted bounds (see [Note: lowering a step]); the model's
own bytes measured by ``rg.predict.profile_activations`` the same at every world size."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.gpt import GPT, GPTConfig, loss_fn
from tests.fsdp._cases import Case
from ragged.fsdp._schedule import CollectiveSchedule
from tests.predict._lower_cases import measured
from tests.parallel._cases import ep_fsdp_step

# (world size, case, optimizer, steps): the last step is counted; a step learning the schedule
# (the first) or rerunning with it (the second, without resharding after forward) is not steady
CASES = {
    "dense-fp64-adamw": (2, Case(), "adamw", 2),
    "moe-multibuffer-adamw8bit-m3": (3, Case(moe=True, max_buffers="auto", batch=6), "adamw8bit", 2),
    "dense-adamw8bit-m4": (4, Case(), "adamw8bit", 2),
    "frozen-unit-and-partly-frozen": (2, Case(frozen=("blocks.0", "tok")), "adamw", 2),
    "frozen-multibuffer-adamw8bit": (2, Case(moe=True, frozen=("blocks.1.mlp",), max_buffers="auto"), "adamw8bit", 2),
    "bf16-compute-replicated-microbatches": (2, Case(dtype=torch.float32, compute_dtype=torch.bfloat16, micro_batches=2,
                                                     replicate_vectors=True), "adamw", 2),
    "fp32-reduce-inflight2": (2, Case(moe=True, dtype=torch.float32, compute_dtype=torch.bfloat16,
                                      reduce_dtype=torch.float32, max_inflight_reduce=2), "adamw", 2),
    "no-prefetch": (2, Case(prefetch=False), "adamw", 2),
    "no-reshard": (2, Case(prefetch=False, reshard_after_forward=False), "adamw", 3),
    "muon-m3": (3, Case(batch=6), "muon", 2),
    "muon-multibuffer-moe": (2, Case(moe=True, max_buffers="auto"), "muon", 2),
    "clip-finite": (2, Case(), "clip-finite", 2),
    "soap-moe-m3": (3, Case(moe=True, batch=6), "soap", 2),
    "shampoo": (2, Case(), "shampoo", 2),
    "chunks8-moe-inflight2": (2, Case(moe=True, chunks=8, max_inflight_reduce=2), "adamw", 2),
    "chunks4-m4-fp64-reduce-clip": (4, Case(chunks=4, dtype=torch.float32, reduce_dtype=torch.float64), "clip-finite", 2),
}


def check(out):
    for o in out:
        assert o["state"] == o["predicted_state"] == o["given_state"], f"rank {o['rank']}"
        assert o["calls"] == o["predicted_calls"], f"rank {o['rank']}"
        assert o["objects"] == o["predicted_objects"]
        got, want = o["metrics"], o["predicted"]
        assert got["peak_gathered_bytes"] == want["peak_gathered_bytes"]
        assert want["peak_grad_bytes_low"] <= got["peak_grad_bytes"] <= want["peak_grad_bytes"]
        assert want["peak_scratch_bytes_low"] <= got["peak_scratch_bytes"] <= want["peak_scratch_bytes"]
        assert want["peak_shard_bytes_low"] <= got["peak_shard_bytes"] <= want["peak_shard_bytes"]
        assert (got["num_gathers"], got["num_reduces"]) == (want["num_gathers"], want["num_reduces"])


@pytest.mark.parametrize("name", list(CASES))
def test_lowered_step_is_exact(name):
    m, case, optimizer, steps = CASES[name]
    out = rg.collectives.simulate(m, measured, case, optimizer, steps=steps)
    check(out)
    if "frozen" in name:
        assert out[0]["frozen_units"] or out[0]["partly_frozen"]
    if "muon" in name:  # the owner exchange is counted, and AdamW's state covers the other elements only
        assert out[0]["calls"][("all_to_all", "shard")][0] > 0
        assert any(0 < o["state"].get("optimizer.nu", 0) < o["state"]["optimizer.momentum"] for o in out)
    if "multibuffer" in name:
        assert out[0]["buffers"] > 1
    if "8bit" in name:
        assert any(k.endswith("_codes") for k in out[0]["state"]) and any(k.endswith("_scales") for k in out[0]["state"])
    if name.startswith(("soap", "shampoo")):  # the blocks' state by category; the update declares no collective
        derived = ("left_basis", "right_basis") if name.startswith("soap") else ("left_root", "right_root", "graft_nu")
        for field in ("mu", "left_stats", "right_stats", *derived):
            assert all(o["state"][f"optimizer.{field}"] > 0 for o in out), field
    if m > 2 and "8bit" in name:  # codes cover what each rank holds: the ranks differ, and so does the prediction
        assert len({tuple(sorted(o["state"].items())) for o in out}) > 1


def test_soap_and_shampoo_add_no_collective_to_the_lowered_step():
    model = GPT(Case().config(), device="meta")
    units = fsdp.make_units(model, world_size=64, specs=lambda path, t: rg.spec.Blocks(16, 16) if t.dim() >= 2 else None)
    comm = rg.collectives.abstract(64)
    cost = {name: fsdp.make_step(units, lambda p, b: 0, opt, comm).lower().cost_analysis().collectives
            for name, opt in [("adamw", rg.optim.adamw(1e-3)), ("soap", rg.optim.soap(1e-3)),
                              ("shampoo", rg.optim.shampoo(1e-3))]}
    assert rg.optim.soap(1e-3).collectives is None and rg.optim.shampoo(1e-3).collectives is None
    assert cost["soap"] == cost["adamw"] == cost["shampoo"]


def test_first_call_lowers_with_the_initial_schedule():
    out = rg.collectives.simulate(2, measured, Case(), "adamw", steps=1, first_call=True)
    assert out[0]["objects"] == 1  # the learning call's exchange
    check_calls = [(o["calls"], o["predicted_calls"]) for o in out]
    assert all(a == b for a, b in check_calls)


@pytest.mark.parametrize("optimizer", ["adamw", "clip-finite"])
def test_hsdp_replica_axis(optimizer):
    out = rg.collectives.simulate(4, measured, Case(replicate_vectors=True), optimizer, mesh_shape=(2, 2))
    check(out)
    assert ("all_reduce", "replica") in out[0]["calls"]


def test_abstract_comm_lowers_at_ten_thousand_ranks():
    model = GPT(GPTConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=48), device="meta")
    units = fsdp.make_units(model, world_size=10_240)
    comm = rg.collectives.abstract(10_240)
    step = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), comm)
    lowered = step.lower()
    mem, cost = lowered.memory_analysis(), lowered.cost_analysis()
    S = sum(u.plan.shard_size for u in units)
    assert mem.by_category["param_shards"] == 4 * S and mem.by_category["optimizer.mu"] == 4 * S
    assert len(mem.per_rank) == 8 and mem.max_rank in mem.per_rank and any("8 of 10240" in a for a in mem.assumed)
    assert cost.get("reduce_scatter").bytes == sum(4 * u.plan.buffer_numel for u in units)
    assert any("schedule" in a for a in cost.assumed)
    with pytest.raises(ValueError, match="abstract"):
        comm.barrier()


def test_a_muon_step_lowers_on_an_abstract_comm():
    """Muon's state (momentum on the shard, AdamW's over the other elements) and its owner exchange
    lower with no process; its all-to-alls send what it holds of others' matrices and get back
    theirs of its own (on the real backends exact in ``test_lowered_step_is_exact``)."""
    model = GPT(GPTConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=48), device="meta")
    units = fsdp.make_units(model, world_size=64)
    comm = rg.collectives.abstract(64)
    lowered = fsdp.make_step(units, lambda p, b: 0, rg.optim.muon(1e-3, comm=comm, num_waves=2), comm).lower(max_ranks=64)
    cost = lowered.cost_analysis()
    S = sum(u.plan.shard_size for u in units)
    assert all(by["optimizer.momentum"] == 4 * S for by in lowered.state_bytes.values())
    assert any(0 < by.get("optimizer.nu", 0) < 4 * S for by in lowered.state_bytes.values())
    a2a = cost.get("all_to_all")
    assert a2a.calls == 2 * 2 * len(units) and a2a.bytes > 0


def test_categories_of_units_named_with_dots():
    """A unit's name may hold dots (HF Llama's ``model.layers.0``): the optimizer's field names the
    category (``optimizer.mu``), not a part of the unit's name (``optimizer.layers``)."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)])
    units = fsdp.make_units(model, world_size=4, groups=["model.layers.0", "model.layers.1"])
    step = fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(4))
    assert set(step.lower().memory_analysis().by_category) == {"param_shards", "replicated", "optimizer.count",
                                                               "optimizer.mu", "optimizer.nu"}


def test_lower_refuses_bad_inputs():
    model = torch.nn.Linear(4, 4)
    units = fsdp.make_units(model, world_size=8)
    step = fsdp.make_step(units, lambda p, b: 0, rg.optim.sgd(0.1), rg.collectives.abstract(8), micro_batches=2)
    with pytest.raises(ValueError, match="micro_batches=2"):
        step.lower(batch_shapes=torch.empty(3, 4, device="meta"))
    with pytest.raises(ValueError, match="activations"):
        step.lower(activations=1 << 20)


def _abstract_step(m=8, **kw):
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    units = fsdp.make_units(model, world_size=m, groups=[str(i) for i in range(4)])
    return fsdp.make_step(units, lambda p, b: 0, rg.optim.adamw(1e-3), rg.collectives.abstract(m), **kw)


def test_the_lowering_names_first_published_in_fsdp_still_resolve():
    """``rg.fsdp.Lowered`` & co are ``rg.predict``'s objects (looked up there on first use)."""
    from ragged.fsdp import Network

    names = ("Collective", "CostAnalysis", "Lowered", "MemoryAnalysis", "Activations", "profile_activations", "Link",
             "Network", "TimeEstimate")
    assert all(getattr(fsdp, n) is getattr(rg.predict, n) for n in names) and Network is rg.predict.Network
    assert set(names) <= set(dir(fsdp))
    assert isinstance(_abstract_step().lower(), fsdp.Lowered)
    with pytest.raises(AttributeError, match="no attribute 'Lowerd'"):
        fsdp.Lowerd


def test_time_model_limits_and_overlap():
    Link = rg.predict.Link
    lowered = _abstract_step().lower()
    cost = lowered.cost_analysis()
    link = Link(alpha=1e-4, bandwidth=1e8)
    comm_only = lowered.estimate_time(link)
    ag, rs, ar = cost.get("all_gather"), cost.get("reduce_scatter"), cost.get("all_reduce")
    assert ar.calls == 2  # the plan check (two int64) and the end-of-call agreement
    want = (ag.calls * link.seconds("all_gather", ag.bytes // ag.calls, 8)
            + rs.calls * link.seconds("reduce_scatter", rs.bytes // rs.calls, 8)
            + link.seconds("all_reduce", 16, 8) + link.seconds("all_reduce", ar.bytes - 16, 8))
    assert comm_only.seconds == pytest.approx(want, rel=1e-9)  # every collective once, nothing to overlap
    # the time model times the calls cost_analysis counts: Muon's exchange and its plan check, a deferred
    # comm's four-int64 plan check, HSDP's all-reduces of replicated gradients (two calls per unit)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    units = fsdp.make_units(model, world_size=4, specs=lambda p, t: rg.spec.Replicate() if t.dim() == 1 else None)
    comm = rg.collectives.abstract(4, num_replicas=2, handshake="deferred")
    muon = fsdp.make_step(units, lambda p, b: 0, rg.optim.muon(1e-3, comm=comm), comm).lower()
    network = rg.predict.Network(shard=link, replica=Link(alpha=2e-4, bandwidth=1e7))
    on = {"shard": (network.shard, 4), "replica": (network.replica, 2)}
    calls = muon.cost_analysis().collectives
    assert {"all_to_all", "all_reduce"} <= {c.kind for c in calls} and muon.cost_analysis().get("all_reduce", "replica").calls
    assert muon.estimate_time(network).seconds == pytest.approx(
        sum(c.calls * on[c.axis][0].seconds(c.kind, c.bytes / c.calls, on[c.axis][1]) for c in calls), rel=1e-9)
    free_net = lowered.estimate_time(Link(alpha=0.0, bandwidth=float("inf")), compute=1e-3)
    assert free_net.seconds == pytest.approx(free_net.parts["compute"]) == pytest.approx(4 * 3 * 1e-3)
    both = lowered.estimate_time(link, compute=2e-3)
    assert max(both.parts["compute"], comm_only.seconds) <= both.seconds < both.parts["compute"] + comm_only.seconds
    serial = _abstract_step(prefetch=False).lower().estimate_time(link, compute=2e-3)
    assert serial.seconds > both.seconds  # prefetch hides gathers behind compute
    no_overlap = lowered.estimate_time(link, compute=2e-3, overlap=False)  # each collective holds the compute queue
    assert no_overlap.seconds == pytest.approx(no_overlap.parts["compute"] + comm_only.seconds, rel=1e-9)
    assert any("overlap=False" in a for a in no_overlap.assumed)
    # a fraction: each collective holds the compute queue for the rest of its time, between the two
    half = lowered.estimate_time(link, compute=2e-3, overlap=0.5)
    assert both.seconds < half.seconds < no_overlap.seconds
    assert lowered.estimate_time(link, compute=2e-3, overlap=0.0).seconds == pytest.approx(no_overlap.seconds, rel=1e-12)
    assert lowered.estimate_time(link, compute=2e-3, overlap=1.0).seconds == pytest.approx(both.seconds, rel=1e-12)
    with pytest.raises(ValueError, match=re.escape("overlap must be True, False or a number in [0, 1], got 1.5")):
        lowered.estimate_time(link, compute=2e-3, overlap=1.5)


def test_peer_rules_on_one_configuration():
    from ragged.predict._peers import compare

    rows = {r.system: r for r in compare(_abstract_step(m=64).lower())}
    # 256 x 256 weights and 256 biases over 64 ranks: FSDP2 pads nothing (256 rows), ZeRO-3 nothing (256 | 65536)
    assert rows["fsdp2"].by_category["param_shards"] == rows["zero3"].by_category["param_shards"] == 4 * 4 * (256 * 257) // 64
    assert rows["fsdp2"].by_category["optimizer.step"] == 4 * 8  # a 0-d float32 step per parameter
    assert rows["zero3"].by_category["grad_partition"] == rows["zero3"].by_category["param_shards"]
    assert rows["fsdp2"].gather_bytes == rows["zero3"].gather_bytes
    assert rows["ragged"].persistent_bytes == rows["ragged"].by_category["param_shards"] * 3 + 8


def _profile(comm, case):
    model = case.model()
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = case.make_optimizer()
    step = fsdp.make_step(units, loss_fn(copy.deepcopy(model), checkpoint=case.activation_checkpointing), opt, comm,
                          micro_batches=case.micro_batches)
    return rg.predict.profile_activations(step, fsdp.init(units, model, opt, comm), case.task().batch(0, 4))  # one batch per rank


@pytest.mark.parametrize("case", [Case(moe=True), Case(activation_checkpointing=True, micro_batches=2)],
                         ids=["moe", "checkpointing-microbatches"])
def test_activations_do_not_depend_on_the_world_size(case):
    (one,) = rg.collectives.simulate(1, _profile, case)
    assert 0 < one.saved < one.peak and len(one.backward) == len(one.schedule.forward)
    assert rg.collectives.simulate(2, _profile, case) == [one, one]  # every point, the schedule too
    lowered = _lowered_with(one, case)
    mem = lowered.memory_analysis()
    assert mem.peak_parts["activations"] > 0 and mem.peak_bytes >= mem.peak_bytes_low > mem.persistent_bytes
    with pytest.raises(ValueError, match="another schedule"):
        lowered.step.lower(activations=one, schedule=CollectiveSchedule.initial(len(lowered.units)))


def _lowered_with(activations, case, m=64):
    model = case.model()
    meta = type(model)(model.cfg, device="meta")
    units = fsdp.make_units(meta, world_size=m)
    step = fsdp.make_step(units, lambda p, b: 0, case.make_optimizer(), rg.collectives.abstract(m),
                          micro_batches=case.micro_batches)
    return step.lower(activations=activations)


def _ep_lowered(mc):
    """FSDP x EP (``data_groups``): the third step's collectives (the first two learn the schedule)
    on the FSDP and EP comms, next to the lowering's (the loss's MoE dispatch on the EP comm is the model's: not counted by either)."""
    from bench._counts import CommCounter
    from tests.parallel._cases import _data_index, moe_batch

    units, state, step, _ = ep_fsdp_step(mc)
    counter = CommCounter()
    counter.install_comm(mc["dp"], "step")
    counter.install_comm(mc["ep"], "step", axis="data0")
    for s in range(3):
        counter.active = "step" if s == 2 else None
        state, _ = step(state, moe_batch(s, _data_index(mc)))
    calls = {k: v for k, v in counter.records("step").items() if k != ("all_to_all", "data0")}
    lowered = step.lower()
    return calls, {(c.kind, c.axis): (c.calls, c.bytes) for c in lowered.cost_analysis().collectives}


def test_expert_parallel_data_groups_lower_exactly():
    from ragged import parallel, spec
    from tests.parallel._cases import mesh_names

    out = parallel.simulate_mesh(spec.Mesh((2, 2), mesh_names("ep")), _ep_lowered)
    for calls, predicted in out:
        assert calls == predicted
        assert calls[("all_reduce", "data0")][0] >= 2  # the agreement and the router's gradients
