"""``rg.fsdp.value_and_grad`` and the step's layers on the simulated backend: gradients equal
``torch.func.grad`` of the unsharded loss, collectives identical on every rank whatever the
routing, ``torch.optim`` semantics for parameters no rank used, the mixed-precision policy, the
donation guard and the module binding."""

import copy
import re

import pytest
import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.data import rank_slice
from tests._cuda_division import cuda_division
from tests.fsdp._cases import (cross_entropy, logits_of, max_diff, moe_batches, tiny_moe, train_reference,
                               train_sharded)


def _params(seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"layers": [{"w": torch.randn(5, 4, generator=g, dtype=torch.float64),
                        "b": torch.randn(5, generator=g, dtype=torch.float64)},
                       {"w": torch.randn(1, 5, generator=g, dtype=torch.float64),
                        "b": torch.randn(1, generator=g, dtype=torch.float64)}]}


def _loss(p, batch):
    x, y = batch
    h = torch.tanh(x @ p["layers"][0]["w"].T + p["layers"][0]["b"])
    return ((h @ p["layers"][1]["w"].T + p["layers"][1]["b"] - y) ** 2).mean()


@pytest.mark.parametrize("world_size,micro_batches,replicate", [(2, 1, False), (3, 2, True)], ids=["w2", "w3-accum2-rep"])
def test_value_and_grad_equals_func_grad_of_the_unsharded_loss(world_size, micro_batches, replicate):
    params = _params()
    g = torch.Generator().manual_seed(4)
    batch = (torch.randn(12, 4, generator=g, dtype=torch.float64), torch.randn(12, 1, generator=g, dtype=torch.float64))
    specs = (lambda path, t: rg.spec.Replicate() if t.dim() == 1 else None) if replicate else None
    units = fsdp.make_units(params, world_size=world_size, groups=lambda path: path[:13], specs=specs)

    def run(comm):
        f = fsdp.value_and_grad(units, _loss, comm, micro_batches=micro_batches)
        loss, grads = f(rg.shard(units, params, comm), rank_slice(batch, comm.rank, world_size))
        return loss, rg.gather(units, grads, comm)

    want = torch.func.grad(_loss)(params, batch)
    for loss, got in rg.collectives.simulate(world_size, run):
        assert abs(loss - _loss(params, batch).item()) < 1e-12
        for i in range(2):
            for n in ("w", "b"):
                torch.testing.assert_close(got["layers"][i][n], want["layers"][i][n], rtol=1e-12, atol=1e-14)


def test_collectives_are_the_same_on_every_rank_whatever_the_routing():
    """Experts as separate units: rank 0's tokens use experts 0 and 1, rank 1's 1 and 2. Every rank
    issues the same collectives (digests equal) and the result is torch's."""
    template = tiny_moe()
    batches = moe_batches()

    def run(comm):
        model = copy.deepcopy(template)
        units = fsdp.make_units(model, world_size=comm.world_size)
        opt = rg.optim.adamw(1e-2)
        state = fsdp.init(units, model, opt, comm)
        step = fsdp.make_step(units, lambda p, b: cross_entropy(logits_of(model, b[0]), b[1]), opt, comm, module=model,
                              trace=True)
        digests = []
        for batch in batches:
            state, metrics = step(state, rank_slice(batch, comm.rank, comm.world_size))
            digests.append(tuple(e for e in metrics["trace"] if e[0] in ("gather_start", "reduce_start")))
        return digests, rg.gather(units, state.shards, comm)

    (d0, p0), (d1, p1) = rg.collectives.simulate(2, run)
    assert d0 == d1 and len(set(d0)) >= 2
    ref = train_reference(copy.deepcopy(template), batches, weight_decay=0.0)
    assert max_diff(p0, ref)[0] < 1e-10


def test_parameters_no_rank_used_are_left_untouched_like_torch_optim():
    """AdamW with weight decay: expert 3 never gets a token; torch skips it (no decay, no moment
    decay); ``skip_unused=False`` decays it as if its gradient were zero."""
    template = tiny_moe()
    batches = moe_batches()
    ref = train_reference(copy.deepcopy(template), batches)
    for skip in (True, False):
        (got, metrics), _ = rg.collectives.simulate(
            2, lambda c: train_sharded(c, copy.deepcopy(template), batches, skip_unused=skip))
        idle = [k for k in ref if ".experts.3." in k]
        assert idle and all(m["unused_leaves"] == len(idle) for m in metrics)
        idle_diff = max(max_diff({k: got[k]}, {k: ref[k]})[0] for k in idle)
        if skip:
            assert idle_diff == 0.0 and max_diff(got, ref)[0] < 1e-10
        else:
            assert idle_diff > 1e-4


def test_momentum_state_of_unused_leaves_is_kept_like_torch_sgd():
    """SGD momentum over steps that use all leaves, then only layer 0's weight, then all again:
    torch keeps the skipped leaves' momentum buffers through the middle step, so does the step."""
    params = _params()
    units = fsdp.make_units(params, world_size=2, groups=lambda path: path[:13])
    x = torch.randn(4, 4, dtype=torch.float64)
    flags = (True, False, True)

    def loss(p, batch):
        xb, use_all = batch
        if use_all:
            return _loss(p, (xb, torch.zeros(xb.shape[0], 1, dtype=xb.dtype)))
        return (xb @ p["layers"][0]["w"].T).square().mean()

    def run(comm):
        opt = rg.optim.sgd(0.1, momentum=0.9)
        state = fsdp.init(units, params, opt, comm)
        step = fsdp.make_step(units, loss, opt, comm)
        unused = []
        for flag in flags:
            state, m = step(state, (x[2 * comm.rank:][:2], flag))
            unused.append(m["unused_leaves"])
        return unused, rg.gather(units, state.shards, comm)

    ref = {k: [{n: t.clone().requires_grad_() for n, t in layer.items()} for layer in v] for k, v in params.items()}
    leaves = [t for layer in ref["layers"] for t in layer.values()]
    torch_opt = torch.optim.SGD(leaves, lr=0.1, momentum=0.9)
    for flag in flags:
        torch_opt.zero_grad()  # set_to_none: leaves the loss does not read get no .grad and are skipped
        loss(ref, (x, flag)).backward()
        torch_opt.step()
    for unused, got in rg.collectives.simulate(2, run):
        assert unused == [0, 3, 0]  # layer 0's bias and all of layer 1 in the middle step
        for i in range(2):
            for n in ("w", "b"):
                torch.testing.assert_close(got["layers"][i][n], ref["layers"][i][n].detach(), rtol=1e-12, atol=1e-14)


def test_mixed_precision_is_one_policy_argument():
    """``policy=MixedPrecision(...)`` is the one way to set the step's dtypes (the
    ``compute_dtype=`` / ``reduce_dtype=`` second spelling is gone); bf16 numerics are checked
    against fp32 in tests/fsdp/test_step_sim.py."""
    policy = fsdp.MixedPrecision(compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = fsdp.make_units(_params(), world_size=1)
    comm = rg.collectives.simulate(1, lambda c: c)[0]  # make_step only reads its world size
    step = fsdp.make_step(units, _loss, rg.optim.sgd(0.1), comm, policy=policy)
    assert step.policy is policy and step.value_and_grad.policy is policy
    assert fsdp.make_step(units, _loss, rg.optim.sgd(0.1), comm).policy == fsdp.MixedPrecision()
    with pytest.raises(TypeError, match="unexpected keyword argument 'compute_dtype'"):
        fsdp.make_step(units, _loss, rg.optim.sgd(0.1), comm, compute_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="policy must be a rg.fsdp.MixedPrecision"):
        fsdp.make_step(units, _loss, rg.optim.sgd(0.1), comm, policy=torch.bfloat16)
    with pytest.raises(TypeError, match="MixedPrecision.compute_dtype must be a floating torch.dtype"):
        fsdp.MixedPrecision(compute_dtype=torch.int32)


def test_a_donated_state_is_refused():
    params = _params()
    units = fsdp.make_units(params, world_size=2, groups=lambda path: path[:13])
    x = torch.randn(4, 4, dtype=torch.float64)
    batch = lambda c: (x[2 * c.rank:][:2], torch.zeros(2, 1, dtype=torch.float64))  # noqa: E731

    def run(comm, donate):
        opt = rg.optim.adamw(0.1, donate=donate)
        state = fsdp.init(units, params, opt, comm)
        step = fsdp.make_step(units, _loss, opt, comm)  # donates as the optimizer does
        assert step.donate is donate
        new, _ = step(state, batch(comm))
        new, _ = step(new, batch(comm))  # the state a call returned is fine
        msgs = []
        for read in (lambda: step(state, batch(comm)), lambda: rg.gather(units, state.shards, comm)):
            try:
                read()
            except rg.RaggedValueError as e:
                msgs.append(str(e))
        return msgs

    for msgs in rg.collectives.simulate(2, run, donate=True):
        assert len(msgs) == 2 and all(re.search(r"donated to a previous step call .* Fix: pass", m)
                                      for m in msgs), msgs
    assert rg.collectives.simulate(2, run, donate=False) == [[], []]


def test_a_loss_reading_module_attributes_besides_params_is_refused():
    """functional_call for the model, plus a penalty on the module's own head weight: that part of
    the gradient would land on the module, not the step."""
    template = tiny_moe()

    def run(comm):
        model = copy.deepcopy(template)
        units = fsdp.make_units(model, world_size=comm.world_size)
        opt = rg.optim.sgd(0.1)
        state = fsdp.init(units, model.state_dict(), opt, comm)  # the module keeps its own weights
        before = {k: v.data.clone() for k, v in state.shards.items()}

        def loss(p, b):
            return cross_entropy(logits_of(model, b[0], p), b[1]) + 1e-3 * model.head.weight.square().sum()

        try:
            fsdp.make_step(units, loss, opt, comm)(state, rank_slice(moe_batches(1)[0], comm.rank, comm.world_size))
        except rg.RaggedValueError as e:
            return str(e), all(torch.equal(state.shards[k].data, before[k]) for k in before)
        return None, False

    for msg, unchanged in rg.collectives.simulate(2, run):
        assert unchanged and msg and "rank 0: shape (16, 8)" in msg and "make_step(..., module=model)" in msg


def test_module_binding_is_restored_after_the_step_also_on_error():
    template = tiny_moe()

    def run(comm):
        model = copy.deepcopy(template)
        units = fsdp.make_units(model, world_size=comm.world_size)
        opt = rg.optim.sgd(0.1)
        state = fsdp.init(units, model, opt, comm)  # the module's parameters become placeholders
        own = {k: id(v) for k, v in model.named_parameters(remove_duplicate=False)}
        calls = []

        def loss(p, b):
            calls.append(len(calls))
            if len(calls) > 1:
                raise ValueError("second call fails")
            return cross_entropy(logits_of(model, b[0]), b[1])

        step = fsdp.make_step(units, loss, opt, comm, module=model)
        batch = rank_slice(moe_batches(1)[0], comm.rank, comm.world_size)
        state, _ = step(state, batch)
        restored = {k: id(v) for k, v in model.named_parameters(remove_duplicate=False)} == own
        with pytest.raises(ValueError, match="second call fails"):
            step(state, batch)
        return restored and {k: id(v) for k, v in model.named_parameters(remove_duplicate=False)} == own

    assert rg.collectives.simulate(2, run) == [True, True]


def _data_group_pairs(comm):
    params = {"w": torch.arange(12.0).view(6, 2), "b": torch.ones(2)}
    units = fsdp.make_units(params, world_size=2, groups=lambda p: p)
    shards = rg.shard(units, params, comm)
    pred = lambda path: path == "['b']"  # noqa: E731
    pair, group = (comm, pred), fsdp.DataGroup(comm, pred)
    norms = [rg.global_norm(units, shards, comm, data_groups=[g]) for g in (pair, group)]
    opt = rg.optim.sgd(0.1)
    step = fsdp.make_step(units, lambda p, x: (x @ p["w"].T + p["b"].sum()).square().mean(), opt, comm,
                          data_groups=[pair])
    _, metrics = step(fsdp.TrainState(shards, opt.init(shards)), torch.ones(2, 2))
    return bool(norms[0] == norms[1]), step.data_groups == (group,), metrics["loss"] > 0


def test_data_groups_are_taken_as_pairs():
    """``data_groups=`` entries may be plain ``(comm, is_replicated)`` pairs: the step and
    ``rg.global_norm`` hold them as DataGroups (moved from tests/test_old_names.py); anything else
    is refused."""
    for checks in rg.collectives.simulate(2, _data_group_pairs):
        assert all(checks), checks
    units = fsdp.make_units({"w": torch.ones(2, 2)}, world_size=1)
    with pytest.raises(rg.RaggedTypeError, match=r"make_step: data_groups entries are \(comm, is_replicated"):
        fsdp.make_step(units, lambda p, x: p["w"].sum(), rg.optim.sgd(0.1), None, data_groups=[object()])


def _xs(rank):
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(6, 2, generator=g, dtype=torch.float64), "b": torch.randn(2, generator=g, dtype=torch.float64)}


def _one_sgd_step_over_a_data_group_of_three(mc):
    params = {"w": torch.zeros(6, 2, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    units = fsdp.make_units(params, world_size=1, groups=lambda p: p)
    shards = rg.shard(units, params, mc["dp"])
    opt = rg.optim.sgd(1.0)
    step = fsdp.make_step(units, lambda p, x: (p["w"] * x["w"]).sum() + (p["b"] * x["b"]).sum(), opt, mc["dp"],
                          data_groups=[(mc["rep"], lambda path: True)])
    with cuda_division():  # the mean as a GPU would divide: see [Note: a division every device rounds alike]
        state, _ = step(fsdp.TrainState(shards, opt.init(shards)), _xs(mc.coords["rep"]))
    return rg.gather(units, state.shards, mc["dp"])


def test_a_data_group_s_mean_is_the_true_quotient():
    """One SGD step (lr 1, from zero) over a data group of 3: every parameter is minus the
    rank-order sum of the gradients divided by 3, correctly rounded on every device."""
    from ragged import parallel, spec

    want = rg.pytree.map(lambda a, b, c: -((a + b + c) / 3), *[_xs(r) for r in range(3)])
    for got in parallel.simulate_mesh(spec.Mesh((1, 3), ("dp", "rep")), _one_sgd_step_over_a_data_group_of_three):
        assert all(torch.equal(got[k], want[k]) for k in want), got


@pytest.mark.parametrize("make", [lambda d: rg.optim.adamw(0.1, donate=d), lambda d: rg.optim.sgd(0.1, donate=d),
                                  lambda d: rg.optim.adamw_8bit(0.1, donate=d),
                                  lambda d: rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=None),
                                                           rg.optim.adamw(0.1, weight_decay=0.1, mask=lambda l: True,
                                                                          donate=d))],
                         ids=["adamw", "sgd", "adamw_8bit", "chain-masked"])
def test_one_donate_decision_per_step(make):
    """The step donates exactly when its optimizer updates in place (see [Note: one donate
    decision per step]); an explicit ``donate=`` that disagrees is refused at make_step, and a
    wrapped update keeps the decision with ``_replace``."""
    units = fsdp.make_units(_params(), world_size=1)
    comm = rg.collectives.simulate(1, lambda c: c)[0]  # make_step only reads its world size
    for d in (False, True):
        opt = make(d)
        assert opt.donates is d and opt._replace(update=lambda *a: opt.update(*a)).donates is d
        assert fsdp.make_step(units, _loss, opt, comm).donate is d
        assert fsdp.make_step(units, _loss, opt, comm, donate=d).donate is d
        with pytest.raises(rg.RaggedValueError, match=rf"make_step: donate={not d}, but the optimizer "
                                                      rf"{'updates' if d else 'does not update'} in place"):
            fsdp.make_step(units, _loss, opt, comm, donate=not d)
