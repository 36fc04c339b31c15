"""torch.compile under the FSDP step (simulated ranks, float64): a compiled model trains like
eager and like single-process ``torch.optim.AdamW``, with eager's collective order and memory,
and dynamo logs no graph break and no recompile caused by ragged (see [Note: compiled regions]
in ``ragged/fsdp/_compiled.py``); compiled code ragged cannot see is refused on every rank
before any parameter changes.

Compilation is slow on 2 cores: these tests compile with ``aot_eager`` (dynamo and AOTAutograd,
the parts that meet ragged's runtime: guards, graph breaks, the compiled function's saved
tensors and backward), on the smallest model; inductor (the backend users run) is the gloo
test's per-block case and the compiled example of docs/training-step.md.
Simulated ranks are threads: two threads compiling the same frame at once make dynamo compile it
twice (a "recompile" whose guards passed when dynamo looked for the reason: ``THREAD_RACE``); a
one-rank run first compiles every frame once, with the shapes of the two-rank run. The gloo test
(``tests/distributed/test_compile_gloo.py``) asserts no recompile at all.
"""

import dataclasses

import pytest
import torch

import ragged as rg
from tests.fsdp._cases import Case, max_diff, reference_run
from tests.fsdp._compile_cases import compiled_run, dynamo_logs, in_ragged, logs_arrive

pytestmark = pytest.mark.slow

CASE = Case(num_layers=2, steps=3)
THREAD_RACE = "runtime guards failed even though they passed during recompilation-reason analysis"


def _sim(world_size, case, **kw):
    return rg.collectives.simulate(world_size, compiled_run, case, **kw)


def _warm(case, **kw):
    """One rank on the per-rank batch of two: every frame compiled once, with the shapes of the run."""
    rg.collectives.simulate(1, compiled_run, dataclasses.replace(case, batch=case.batch // 2), **kw)


def _ragged_lines(records):
    return [m for _, m in records if in_ragged(m)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: frames compiled by another test (other shapes) would
    recompile here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def eager():
    """Eager ragged (the same module binding) and the unsharded reference, once."""
    return _sim(2, CASE, compile=None), reference_run(CASE)


@pytest.mark.parametrize("how,backend", [("block", "aot_eager"), ("whole", "aot_eager")],
                         ids=["blocks-aot-eager", "whole-aot-eager"])
def test_compiled_model_trains_like_eager_and_torch_optim(eager, how, backend):
    (eager_runs, (ref, ref_losses)) = eager
    with dynamo_logs() as records:
        _warm(CASE, compile=how, backend=backend)  # compiles each frame once (see the module docstring)
        runs = _sim(2, CASE, compile=how, backend=backend)
    assert not [m for _, m in records], records  # no graph break, no recompile at all: a dense model
    assert logs_arrive() == {"graph_break", "recompile"}  # and the capture sees them when there are some
    for (params, losses, issued, metrics), (eparams, elosses, eissued, emetrics) in zip(runs, eager_runs):
        diff, where = max_diff(params, ref)
        assert diff < 1e-10, f"{where} differs from torch.optim by {diff}"
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10
        assert max_diff(params, eparams)[0] < 1e-12
        assert metrics["schedule_reruns"] == 0
        if how == "block":  # every region is one unit: eager's collectives, in eager's order, and its memory
            assert issued == eissued
            assert metrics["peak_gathered_bytes"] == emetrics["peak_gathered_bytes"] < metrics["model_bytes"]
            assert metrics["num_gathers"] == emetrics["num_gathers"]
        else:  # one region reads every unit: all are gathered while it runs
            assert metrics["peak_gathered_bytes"] == metrics["model_bytes"]


def test_moe_and_checkpointing_inside_the_model_keep_eager_collectives():
    """Experts a rank's tokens skip (the model's own graph breaks: ``nonzero``), activation
    checkpointing of every compiled block (recomputed in backward through its boundary) and
    gradient accumulation: eager's results and collective sequence, no ragged code in the logs."""
    case = Case(num_layers=2, steps=2, moe=True, activation_checkpointing=True, micro_batches=2)
    ref, ref_losses = reference_run(case)
    eager_runs = _sim(2, case, compile=None)
    with dynamo_logs() as records:
        _warm(case, compile="block", backend="aot_eager")
        runs = _sim(2, case, compile="block", backend="aot_eager")
    assert any(kind == "graph_break" and "gpt.py" in m for kind, m in records)  # the MoE's data-dependent ops
    assert not _ragged_lines(records), _ragged_lines(records)
    # Block.forward for the other kind of block (dense MLP / MoE): the model's own recompile; and
    # the threads' race of the module docstring (seen here only: gloo ranks show none)
    other = [m for kind, m in records if kind == "recompile" and "___check_type_id(self._modules['mlp']" not in m
             and THREAD_RACE not in m]
    assert not other, other
    for (params, losses, issued, _), (_, _, eissued, _) in zip(runs, eager_runs):
        assert max_diff(params, ref)[0] < 1e-10
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10
        assert issued == eissued


def test_torchtitan_style_compiled_blocks_train_like_eager(eager):
    """``model.blocks[k] = torch.compile(block)``: parameter names gain ``_orig_mod``; the units
    follow the module given to ``make_units``."""
    eager_runs, _ = eager
    runs = _sim(2, CASE, compile="block", backend="aot_eager", wrap=True)
    for (params, losses, issued, _), (eparams, elosses, eissued, _) in zip(runs, eager_runs):
        assert max(abs(a - b) for a, b in zip(losses, elosses)) < 1e-12
        assert issued == eissued
        assert max(abs(p - eparams[k.replace("._orig_mod", "")]).max().item() for k, p in params.items()) < 1e-12


def test_a_compiled_optimizer_update_trains_like_torch_optim():
    """The jit-like path ``bench/compile.py --compile-optimizer`` times: the compiled blocks and
    ``torch.compile(opt.update)`` of ``adamw(donate=True)`` (moments and the update written in
    place, which the compiled function must keep) train like ``torch.optim.AdamW``."""
    case = dataclasses.replace(CASE, donate=True)
    ref, ref_losses = reference_run(case)
    for params, losses, _, _ in _sim(2, case, compile="block", backend="aot_eager", compile_update=True):
        assert max_diff(params, ref)[0] < 1e-10
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10


def _refused(comm):
    from ragged import fsdp
    from ragged.examples.data import rank_slice
    from ragged.examples.gpt import loss_fn
    from tests.fsdp._compile_cases import compile_model

    model = compile_model(CASE.model(), "block", "aot_eager")
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = CASE.make_optimizer()
    state = fsdp.init(units, model, opt, comm)
    before = {k: v.clone() for k, v in rg.gather(units, state.shards, comm).items()}
    step = fsdp.make_step(units, loss_fn(model), opt, comm)  # functional_call of the compiled blocks, no module=
    batch = rank_slice(CASE.task().batch(0, CASE.batch), comm.rank, comm.world_size)
    with pytest.raises(rg.RaggedError) as info:
        step(state, batch)
    after = rg.gather(units, state.shards, comm)
    return str(info.value), max_diff(after, before)[0]


def test_compiled_code_ragged_cannot_see_is_refused_on_every_rank():
    """Compiled blocks read through ``functional_call`` without ``module=`` (a compiled function
    inside the loss is refused too: ``tests/distributed/test_compile_gloo.py``, in worker processes,
    because dynamo keeps that refused call's inputs, and so its autograd graph, alive in the process
    for good, which ``test_step_sim``'s no-``Run``-survives check would see)."""
    for message, moved in rg.collectives.simulate(2, _refused):
        assert "make_step(..., module=model)" in message
        assert moved == 0.0


def _compiled_wrapper(comm):
    """``cmodel = torch.compile(model)`` after ``make_units(model)``: ``module=cmodel``, the loss calls it."""
    from ragged import fsdp
    from ragged.examples.data import rank_slice
    from tests.fsdp._cases import cross_entropy

    model = CASE.model()
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = CASE.make_optimizer()
    state = fsdp.init(units, model, opt, comm)
    cmodel = torch.compile(model, backend="aot_eager")
    step = fsdp.make_step(units, lambda p, b: cross_entropy(cmodel(b[0]), b[1]), opt, comm, module=cmodel)
    task, losses = CASE.task(), []
    for s in range(CASE.steps):
        state, metrics = step(state, rank_slice(task.batch(s, CASE.batch), comm.rank, comm.world_size))
        losses.append(metrics["loss"])
    return losses


def test_the_compiled_wrapper_of_the_model_may_be_the_module(eager):
    _, (_, ref_losses) = eager
    for losses in rg.collectives.simulate(2, _compiled_wrapper):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10
