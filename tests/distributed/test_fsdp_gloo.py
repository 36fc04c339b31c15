"""The FSDP training step on real gloo process groups (2 and 4 ranks): N AdamW steps give the
parameters of single-process ``torch.optim.AdamW`` on the same global batch (float64, computed
in each worker), with gradient accumulation and the MoE model too; bf16 compute runs."""


import pytest
import torch


from tests.fsdp._cases import Case, fsdp_run, loss_fn, max_diff, rank_slice, reference_run
from tests.transforms._cases import plan_through_verbs, units_through_verbs
from tests.distributed._harness import both_transports, comm, mesh, workers_2_and_4
from tests.distributed._harness import transport as transport_options

pytestmark = pytest.mark.distributed

workers2, workers4, workers = workers_2_and_4()
transport = both_transports()


def _compare(case):
    params, metrics = fsdp_run(comm(), case, trace=True)
    ref, ref_losses = reference_run(case)
    diff, where = max_diff(params, ref)
    loss_err = max(abs(m["loss"] - r) for m, r in zip(metrics, ref_losses))
    init = dict(case.model().named_parameters())
    moved = max_diff(params, init)[0]
    last = metrics[-1]
    return dict(diff=diff, where=where, loss_err=loss_err, moved=moved,
                peak=last["peak_gathered_bytes"], model=last["model_bytes"], largest=last["largest_unit_bytes"],
                trace=last["trace"])


@pytest.mark.parametrize(
    "case",
    [Case(), Case(micro_batches=2), Case(moe=True, micro_batches=2), Case(replicate_vectors=True),
     Case(activation_checkpointing=True)],
    ids=["adamw", "adamw-accum2", "moe-adamw-accum2", "adamw-replicated-vectors", "adamw-activation-checkpointing"],
)
def test_adamw_matches_torch_optim(workers, case):
    for r, out in enumerate(workers.run(_compare, case)):
        assert out["diff"] < 1e-10, f"rank {r}: {out['where']} differs by {out['diff']}"
        assert out["loss_err"] < 1e-9
        assert out["moved"] > 1e-3
        assert out["peak"] < out["model"]
        assert out["peak"] <= 2 * out["largest"]


def _bf16(case):
    params, metrics = fsdp_run(comm(), case)
    return [m["loss"] for m in metrics], all(v.dtype == torch.float32 for v in params.values())


def test_bf16_compute_trains(workers2):
    case = Case(dtype=torch.float32, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32, steps=6, lr=3e-3,
                micro_batches=2)
    for losses, fp32_master in workers2.run(_bf16, case):
        assert fp32_master
        assert losses[-1] < losses[0]


def _overlap(case):
    _, metrics = fsdp_run(comm(), case, trace=True)
    trace = metrics[-1]["trace"]
    pos = {(ev, u, ph): i for i, (ev, u, ph) in enumerate(trace)}
    return (pos[("gather_start", "blocks.1", "forward")] < pos[("compute", "blocks.0", "forward")],
            pos[("reduce_start", "blocks.2", "backward")] < pos[("compute", "blocks.0", "backward")])


def test_prefetch_and_reduce_overlap_on_gloo(workers2):
    assert workers2.run(_overlap, Case(steps=2, dtype=torch.float32)) == [(True, True)] * 2


def _hsdp(case):
    import ragged as rg

    c = rg.collectives.from_torch(mesh((2, 2)), **transport_options())  # 2 replicas x 2 shards
    params, metrics = fsdp_run(c, case)
    ref, ref_losses = reference_run(case)
    return max_diff(params, ref)[0], abs(metrics[-1]["loss"] - ref_losses[-1])


def test_hsdp_2x2_matches_torch_optim(workers4):
    for diff, loss_err in workers4.run(_hsdp, Case(micro_batches=2)):
        assert diff < 1e-10 and loss_err < 1e-9


def _hsdp_start_apart():
    """Mesh rank 3 (replica 1, shard rank 1) builds from another seed: ``fsdp.init`` refuses on
    every rank (the message), then ``broadcast_from=3`` starts every rank from rank 3's values (the
    largest difference of the exported model from that seed's)."""
    import ragged as rg
    from ragged import fsdp
    from tests.fsdp._lifecycle_cases import exported_init, tiny

    c = rg.collectives.from_torch(mesh((2, 2)), **transport_options())
    seed = int(c.replica_rank * c.world_size + c.rank == 3)
    try:
        exported_init(c, tiny(seed))
        refused = None
    except fsdp.ParamsMismatchError as e:
        refused = str(e)
    full = exported_init(c, tiny(seed), broadcast_from=3)
    return refused, max((full[k] - v).abs().max().item() for k, v in tiny(1).state_dict().items() if k in full)


def test_hsdp_ranks_start_equal_or_from_one_rank(workers4):
    for refused, diff in workers4.run(_hsdp_start_apart):
        assert refused is not None and "ranks [0, 1, 2] vs ranks [3] (mesh order, replica-major)" in refused, refused
        assert diff == 0.0


def _step_switch(case):
    """Every rank runs a step; then the last rank alone switches to a step with other micro
    batches. The step agrees on its units and options every step (even with the comm's
    default plan_check="first_use"), so every rank raises instead of hanging."""
    import copy

    import ragged as rg
    from ragged import fsdp

    c = comm()
    assert c.plan_check == "first_use"
    model = case.model()
    units = fsdp.make_units(model, world_size=c.world_size)
    opt = case.make_optimizer()
    state = fsdp.init(units, model, opt, c)
    steps = [fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, c, micro_batches=k) for k in (1, 2)]
    task = case.task()
    batch = lambda s: rank_slice(task.batch(s, case.batch), c.rank, c.world_size)
    state, _ = steps[0](state, batch(0))
    try:
        steps[1 if c.rank == c.world_size - 1 else 0](state, batch(1))
    except rg.PlanMismatchError as e:
        return str(e)
    return None


def test_rank_switching_step_options_raises_on_every_rank(workers):
    msgs = workers.run(_step_switch, Case(steps=2))
    assert all(m is not None and "micro_batches: 1 on ranks" in m and "vs 2 on ranks" in m for m in msgs), msgs


def _layouts_through_verbs():
    return plan_through_verbs(comm()), units_through_verbs(comm())


def test_plan_and_units_through_the_one_verb(workers2):
    """rg.shard / gather / reduce_scatter / global_norm of a LayoutPlan and of fsdp.Units on gloo
    equal the per-layout computations (the MeshPlan layout runs on 4 gloo ranks in
    test_parallel_gloo.py)."""
    assert workers2.run(_layouts_through_verbs) == [(True, True), (True, True)]



def _handshake_in_use():
    return comm().handshake


def test_each_transport_is_the_one_in_use(workers2, transport):
    """The autouse transport fixture really switches the workers' comm (both_transports)."""
    assert workers2.run(_handshake_in_use) == [{"gloo-default": "header", "nccl-shaped": "deferred"}[transport]] * 2
