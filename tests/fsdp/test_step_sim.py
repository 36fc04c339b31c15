"""The FSDP step on the simulated backend: numerics against single-process torch.optim.AdamW
(float64), memory (reshard after forward), prefetch / reduce-scatter overlap, mixed precision,
and errors raised before any communication."""

import copy
import re

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.data import rank_slice
from ragged.examples.gpt import loss_fn
from tests.fsdp._cases import Case, fsdp_run, max_diff, reference_run


def _sim(world_size, case, **kw):
    return rg.collectives.simulate(world_size, fsdp_run, case, **kw)


@pytest.mark.parametrize(
    "world_size,case",
    [
        (1, Case()),
        (2, Case()),
        (3, Case(batch=6)),
        (2, Case(micro_batches=2)),
        (4, Case(micro_batches=2, moe=True)),
        (2, Case(prefetch=False, reshard_after_forward=False)),
        (2, Case(donate=True, max_inflight_reduce=3, micro_batches=2)),
        (4, Case(replicate_vectors=True, micro_batches=2, moe=True)),
        (2, Case(activation_checkpointing=True, micro_batches=2, moe=True)),
    ],
    ids=["w1", "w2", "w3", "w2-accum2", "w4-accum2-moe", "w2-noprefetch-noreshard", "w2-donate-inflight3",
         "w4-replicated-vectors-moe", "w2-activation-checkpointing-moe"],
)
def test_adamw_matches_torch_optim(world_size, case):
    ref, ref_losses = reference_run(case)
    results = _sim(world_size, case)
    for params, metrics in results:
        diff, where = max_diff(params, ref)
        assert diff < 1e-10, f"{where} differs by {diff}"
        got = [m["loss"] for m in metrics]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-9, atol=0)
    # the model really trained (parameters moved), so the comparison is not vacuous
    init = dict(case.model().named_parameters())
    assert max_diff(results[0][0], init)[0] > 1e-3


def test_state_in_is_not_mutated():
    case = Case(steps=1)
    model = case.model()
    units = fsdp.make_units(model, world_size=2)

    def run(comm):
        opt = rg.optim.adamw(1e-2)
        state = fsdp.init(units, model, opt, comm)
        before = {k: v.data.clone() for k, v in state.shards.items()}
        step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm)
        new, _ = step(state, case.task().batch(0, 4))
        same = all(torch.equal(state.shards[k].data, before[k]) for k in before)
        moved = any(not torch.equal(new.shards[k].data, before[k]) for k in before)
        return same, moved

    assert rg.collectives.simulate(2, run) == [(True, True)] * 2


def _live_bytes_over_trace(trace, nbytes):
    live, peak = 0, 0
    for event, unit, _ in trace:
        if event == "gather_start":
            live += nbytes[unit]
        elif event == "free":
            live -= nbytes[unit]
        peak = max(peak, live)
    return peak


def test_reshard_after_forward_bounds_gathered_memory():
    case = Case(num_layers=6, steps=2, dtype=torch.float32)
    units = fsdp.make_units(case.model(), world_size=2)
    (params, metrics), _ = _sim(2, case, trace=True)
    m = metrics[-1]
    nbytes = {u.name: u.plan.buffer_numel * 4 for u in units}
    two_largest = sum(sorted(nbytes.values())[-2:])
    assert m["model_bytes"] == sum(nbytes.values())
    assert m["largest_unit_bytes"] == max(nbytes.values())
    assert m["peak_gathered_bytes"] <= two_largest < m["model_bytes"] / 2
    assert _live_bytes_over_trace(m["trace"], nbytes) == m["peak_gathered_bytes"]
    # every unit is gathered in forward, freed, and gathered again in backward
    gathers = [(u, ph) for ev, u, ph in m["trace"] if ev == "gather_start"]
    for block in (f"blocks.{i}" for i in range(6)):
        assert (block, "forward") in gathers and (block, "backward") in gathers
    # ... and its storage really is released (zero bytes) after the step
    (_, metrics_keep), _ = _sim(2, Case(num_layers=6, steps=1, dtype=torch.float32, reshard_after_forward=False))
    assert metrics_keep[-1]["peak_gathered_bytes"] > m["peak_gathered_bytes"]
    assert metrics_keep[-1]["num_gathers"] < m["num_gathers"]


def test_prefetch_starts_next_gather_before_compute_and_reduce_overlaps_backward():
    case = Case(num_layers=4, steps=2, dtype=torch.float32)
    (_, metrics), _ = _sim(2, case, trace=True)
    trace = metrics[-1]["trace"]  # second step: the schedule hint is learnt
    for phase in ("forward", "backward"):
        computes = [(i, u) for i, (ev, u, ph) in enumerate(trace) if ev == "compute" and ph == phase]
        assert len(computes) >= 4
        for (i_prev, _), (i_next, u_next) in zip(computes, computes[1:]):
            starts = [i for i, (ev, u, ph) in enumerate(trace[:i_next]) if ev == "gather_start" and u == u_next]
            # the next unit's all-gather was issued before the current unit computed
            assert starts and starts[-1] < i_prev, (phase, u_next, trace)
    # blocks.3's reduce-scatter starts before backward reaches blocks.0
    pos = {(ev, u, ph): i for i, (ev, u, ph) in enumerate(trace)}
    assert pos[("reduce_start", "blocks.3", "backward")] < pos[("compute", "blocks.0", "backward")]
    # without prefetch every gather is issued right when needed (a reduce-scatter may be waited in between)
    (_, plain), _ = _sim(2, Case(num_layers=4, steps=2, dtype=torch.float32, prefetch=False), trace=True)
    t = [e for e in plain[-1]["trace"] if e[0] != "reduce_done"]
    for i, (ev, u, ph) in enumerate(t):
        if ev == "compute" and i > 0 and t[i - 1][0] == "gather_done":
            assert t[i - 2] == ("gather_start", u, ph)


def test_bf16_compute_fp32_master_close_to_fp32():
    kw = dict(dtype=torch.float32, steps=2, lr=0.5, optimizer="sgd")
    init = dict(Case(**kw).model().named_parameters())
    (p32, m32), _ = _sim(2, Case(**kw))
    for reduce_dtype in (None, torch.float32):
        (p16, m16), _ = _sim(2, Case(**kw, compute_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
        assert all(v.dtype == torch.float32 for v in p16.values())  # master stays fp32
        assert m16[0]["largest_unit_bytes"] * 2 == m32[0]["largest_unit_bytes"]  # gathered in bf16
        for a, b in zip(m16, m32):
            assert abs(a["loss"] - b["loss"]) < 1e-2
        # the SGD updates agree to bf16 precision (relative to their size)
        d32 = torch.cat([(p32[k] - init[k].detach()).flatten() for k in init])
        d16 = torch.cat([(p16[k] - init[k].detach()).flatten() for k in init])
        assert d32.norm() > 1e-2
        assert (d16 - d32).norm() / d32.norm() < 0.05


def test_step_errors_before_communication():
    case = Case()
    model = case.model()
    units = fsdp.make_units(model, world_size=2)

    def run(comm):
        opt = rg.optim.sgd(0.1)
        state = fsdp.init(units, model, opt, comm)
        step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm, micro_batches=3)
        out = []
        try:
            step(state, case.task().batch(0, 4))
        except ValueError as e:
            out.append(str(e))
        bad = fsdp.make_step(units, lambda p, b: torch.ones(2, requires_grad=True), opt, comm)
        try:
            bad(state, case.task().batch(0, 4))
        except TypeError as e:
            out.append(str(e))
        try:
            step(fsdp.TrainState({}, state.opt_state), case.task().batch(0, 4))
        except KeyError as e:
            out.append(str(e))
        return out

    for msgs in rg.collectives.simulate(2, run):
        assert "batch[0] has shape (4, 16); with micro_batches=3" in msgs[0]
        assert "must return a scalar tensor" in msgs[1]
        assert "state.shards lacks units" in msgs[2]

    def wrong_world(comm):
        return fsdp.make_step(units, loss_fn(model), rg.optim.sgd(0.1), comm)

    with pytest.raises(ValueError, match=re.escape("planned for world_size=2 but comm has 3 ranks")):
        rg.collectives.simulate(3, wrong_world)
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        rg.collectives.simulate(2, lambda c: fsdp.make_step(units, loss_fn(model), rg.optim.sgd(0.1), c, micro_batches=0))


def test_freed_units_really_release_storage_and_nothing_leaks():
    """Inspects real storages during forward (test-side forward pre-hooks on the rank's own module
    copy): when a block starts, at most two units hold allocated storage (itself and the
    prefetched next one); after the step no ``_Run`` survives."""
    import gc

    from ragged.fsdp._runtime import Run as _Run

    case = Case(num_layers=5, steps=2, dtype=torch.float32)
    model = case.model()
    units = fsdp.make_units(model, world_size=2)

    def run(comm):
        module = copy.deepcopy(model)
        seen = []
        current = {}

        def loss(params, batch):
            current["params"] = params
            return loss_fn(module)(params, batch)

        def pre_hook(mod, args):
            params = current["params"]
            allocated = {u.name for u in units if params[u.paths[0]].untyped_storage().nbytes() > 0}
            seen.append(allocated)

        for block in module.blocks:
            block.register_forward_pre_hook(pre_hook)
        opt = rg.optim.adamw(1e-3)
        state = fsdp.init(units, model, opt, comm)
        step = fsdp.make_step(units, loss, opt, comm)
        for s in range(case.steps):
            state, _ = step(state, case.task().batch(s, 4))
        after = [params_.untyped_storage().nbytes() for params_ in current["params"].values()]
        return seen, after

    for seen, after in rg.collectives.simulate(2, run):
        assert len(seen) == 2 * 5
        assert max(len(s) for s in seen) <= 2
        assert all(len(s) >= 1 for s in seen)
        assert sum(after) == 0  # every gathered buffer released after the step
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is _Run]


def test_hsdp_2x2_matches_torch_optim():
    """2 replicas x 2 shards: parameters gathered within the shard group, gradients
    reduce-scattered there and averaged across replicas."""
    case = Case(micro_batches=2)
    ref, ref_losses = reference_run(case)
    for params, metrics in rg.collectives.simulate(4, fsdp_run, case, mesh_shape=(2, 2)):
        diff, where = max_diff(params, ref)
        assert diff < 1e-10, f"{where} differs by {diff}"
        assert abs(metrics[-1]["loss"] - ref_losses[-1]) < 1e-9


def test_plain_pytree_with_user_grouping_matches_reference():
    """No nn.Module: a pure loss over a parameter pytree, units chosen by a key-path function."""
    g = torch.Generator().manual_seed(3)
    dims = [6, 10, 7, 1]
    params = {"layers": [{"w": torch.randn(dims[i + 1], dims[i], generator=g, dtype=torch.float64),
                          "b": torch.randn(dims[i + 1], generator=g, dtype=torch.float64)} for i in range(3)]}
    x = torch.randn(12, 6, generator=g, dtype=torch.float64)
    y = torch.randn(12, 1, generator=g, dtype=torch.float64)

    def loss(p, batch):
        h, target = batch
        for i, layer in enumerate(p["layers"]):
            h = torch.nn.functional.linear(h, layer["w"], layer["b"])
            h = torch.tanh(h) if i < 2 else h
        return ((h - target) ** 2).mean()

    units = fsdp.make_units(params, world_size=3, groups=lambda path: path[:13])
    assert units.names == ("['layers'][0]", "['layers'][1]", "['layers'][2]")
    opt = rg.optim.adamw(0.05, weight_decay=0.01)

    def run(comm):
        state = fsdp.init(units, params, opt, comm)
        step = fsdp.make_step(units, loss, opt, comm, trace=True)
        rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        for _ in range(3):
            state, m = step(state, (x[rows], y[rows]))
        return rg.gather(units, state.shards, comm), m["trace"]

    ref = {k: [{n: t.clone().requires_grad_() for n, t in layer.items()} for layer in v] for k, v in params.items()}
    leaves = [t for layer in ref["layers"] for t in layer.values()]
    torch_opt = torch.optim.AdamW(leaves, lr=0.05, weight_decay=0.01)
    for _ in range(3):
        torch_opt.zero_grad()
        loss(ref, (x, y)).backward()
        torch_opt.step()
    for full, trace in rg.collectives.simulate(3, run):
        for i in range(3):
            for n in ("w", "b"):
                torch.testing.assert_close(full["layers"][i][n], ref["layers"][i][n].detach(), rtol=1e-10, atol=1e-12)
        assert ("gather_start", "['layers'][1]", "backward") in trace  # re-gathered for backward


def test_unused_parameter_gets_zero_gradient():
    """A leaf the loss never reads is reduced as zero (after backward) and the rest is exact."""
    g = torch.Generator().manual_seed(5)
    params = {"a": {"w": torch.randn(5, 4, generator=g, dtype=torch.float64), "unused": torch.randn(3, generator=g,
                                                                                                    dtype=torch.float64)},
              "b": {"w": torch.randn(1, 5, generator=g, dtype=torch.float64)}}
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)

    def loss(p, batch):
        return (torch.tanh(batch @ p["a"]["w"].T) @ p["b"]["w"].T).square().mean()

    units = fsdp.make_units(params, world_size=2, groups=lambda path: path[:5])
    opt = rg.optim.sgd(0.3)

    def run(comm):
        state = fsdp.init(units, params, opt, comm)
        step = fsdp.make_step(units, loss, opt, comm)
        for _ in range(2):
            state, _ = step(state, x[4 * comm.rank : 4 * comm.rank + 4])
        return rg.gather(units, state.shards, comm)

    ref = {k: {n: t.clone().requires_grad_() for n, t in v.items()} for k, v in params.items()}
    for _ in range(2):
        grads = torch.autograd.grad(loss(ref, x), [ref["a"]["w"], ref["b"]["w"]])
        with torch.no_grad():
            ref["a"]["w"] -= 0.3 * grads[0]
            ref["b"]["w"] -= 0.3 * grads[1]
    for full in rg.collectives.simulate(2, run):
        torch.testing.assert_close(full["a"]["unused"], params["a"]["unused"], rtol=0, atol=0)
        torch.testing.assert_close(full["a"]["w"], ref["a"]["w"].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(full["b"]["w"], ref["b"]["w"].detach(), rtol=1e-12, atol=1e-12)


def test_parameters_kept_by_the_loss_are_safe_after_the_step():
    """Leaves that outlive the call no longer point into released storage (printing one used to
    read freed memory)."""
    params = {"a": torch.randn(5, 4), "b": torch.randn(1, 5)}
    units = fsdp.make_units(params, world_size=2, groups=lambda p: p)
    opt = rg.optim.sgd(0.1)

    def run(comm):
        kept = []

        def loss(p, x):
            kept.append(p)
            return (torch.tanh(x @ p["a"].T) @ p["b"].T).square().mean()

        state = fsdp.init(units, params, opt, comm)
        fsdp.make_step(units, loss, opt, comm)(state, torch.randn(4, 4))
        return repr(kept[0]["a"]), kept[0]["a"].numel()

    assert rg.collectives.simulate(2, run) == [("tensor([], requires_grad=True)", 0)] * 2



def test_tied_weights():
    """A head tied to the embedding (one parameter used first and last) trains like torch."""
    case = Case(steps=2, num_layers=2)

    def tied():
        m = case.model()
        m.head.weight = m.tok_emb.weight
        return m

    model = tied()
    units = fsdp.make_units(model, world_size=2)
    assert "head.weight" not in units["rest"].paths  # named_parameters() lists a tied tensor once

    def run(comm):
        opt = case.make_optimizer()
        state = fsdp.init(units, model, opt, comm)
        step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm)
        for s in range(case.steps):
            state, _ = step(state, rank_slice(case.task().batch(s, case.batch), comm.rank, 2))
        return rg.gather(units, state.shards, comm)

    ref = tied()
    opt = torch.optim.AdamW(ref.parameters(), lr=case.lr, weight_decay=case.weight_decay)
    for s in range(case.steps):
        opt.zero_grad()
        loss_fn(ref)(dict(ref.named_parameters()), case.task().batch(s, case.batch)).backward()
        opt.step()
    for full in rg.collectives.simulate(2, run):
        diff, where = max_diff(full, dict(ref.named_parameters()))
        assert diff < 1e-10, f"{where} differs by {diff}"


class _MatmulStashingWeight(torch.autograd.Function):
    """``x @ w`` whose backward reads ``w`` from a plain ``ctx`` attribute (not saved tensors):
    under the step that is a view of released unit storage until backward gathers it on use."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        ctx.w = w
        return x @ w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g @ ctx.w.T, x.T @ g


def test_backward_code_that_reads_parameters_gathers_them():
    """Custom backward code reading a parameter (here from a ctx attribute) gets the gathered
    values: the step equals plain autograd on one process, on 2 ranks and 2 units."""
    g = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(6, 5, generator=g, dtype=torch.float64), "b": torch.randn(5, 4, generator=g, dtype=torch.float64)}
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)

    def loss(p, batch):
        xb, yb = batch
        # unit "a" is released when "b" is used (reshard after forward), before this backward reads it
        return ((torch.tanh(_MatmulStashingWeight.apply(xb, p["a"])) @ p["b"] - yb) ** 2).mean()

    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    for _ in range(2):
        loss(ref, (x, y)).backward()
        with torch.no_grad():
            for v in ref.values():
                v -= 0.1 * v.grad
                v.grad = None

    def run(comm):
        units = fsdp.make_units(params, world_size=comm.world_size, groups=lambda path: path)
        opt = rg.optim.sgd(0.1)
        state = fsdp.init(units, params, opt, comm)
        step = fsdp.make_step(units, loss, opt, comm)
        for _ in range(2):
            state, _ = step(state, rank_slice((x, y), comm.rank, comm.world_size))
        return rg.gather(units, state.shards, comm)

    for got in rg.collectives.simulate(2, run):
        for k in params:
            torch.testing.assert_close(got[k], ref[k].detach(), rtol=1e-12, atol=1e-12)


def test_global_norm_of_units_equals_tree_norm_without_data_groups():
    case = Case(replicate_vectors=True)
    model = case.model()
    specs = lambda path, t: rg.spec.Replicate() if t.dim() == 1 else None  # noqa: E731
    units = fsdp.make_units(model, world_size=2, specs=specs)
    want = torch.sqrt(sum((p.detach() ** 2).sum() for p in model.parameters()))

    def fn(comm):
        shards = rg.shard(units, model, comm)
        return rg.global_norm(units, shards, comm), rg.optim.tree_norm(shards, comm=comm)

    for mine, theirs in rg.collectives.simulate(2, fn):
        torch.testing.assert_close(mine, want.to(mine.dtype), rtol=1e-12, atol=0)
        torch.testing.assert_close(mine, theirs.to(mine.dtype), rtol=1e-12, atol=0)
