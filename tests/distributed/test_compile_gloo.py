"""torch.compile under the FSDP step on 2 gloo processes (float64): compiled blocks (inductor,
torchtitan's ``torch.compile(block)`` put back into the model) and the compiled whole model train
like single-process ``torch.optim.AdamW``; dynamo logs (``TORCH_LOGS=graph_breaks,recompiles``,
captured in each rank) show no graph break and no recompile; compiled blocks issue eager's
collectives in eager's order; compiled code ragged cannot see is refused on both ranks."""

import pytest
import torch

from ragged import _compat
from tests.distributed._harness import comm, workers_fixture
from tests.fsdp._cases import Case, max_diff, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

workers2 = workers_fixture(2)
CASE = Case(num_layers=2, steps=3)


def _compiled(case, how, backend, wrap):
    from tests.fsdp._compile_cases import compiled_run, dynamo_logs, logs_arrive

    torch._dynamo.reset()
    with dynamo_logs() as records:
        params, losses, digest, metrics = compiled_run(comm(), case, compile=how, backend=backend, wrap=wrap)
    torch._dynamo.reset()
    _, eager_losses, eager_digest, eager_metrics = compiled_run(comm(), case, compile=None)
    ref, ref_losses = reference_run(case)
    return dict(
        logs=[m for _, m in records], control=logs_arrive(),
        diff=max_diff({k.replace("._orig_mod", ""): v for k, v in params.items()}, ref)[0],
        loss_err=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        eager_loss_err=max(abs(a - b) for a, b in zip(losses, eager_losses)),
        same_collectives=digest == eager_digest,
        peak=metrics["peak_gathered_bytes"], eager_peak=eager_metrics["peak_gathered_bytes"],
        model=metrics["model_bytes"],
    )


_INDUCTOR = pytest.mark.skipif(
    not _compat.INDUCTOR_CPU_FP64_ATTENTION_BACKWARD,
    reason=f"torch {torch.__version__}'s inductor fails the float64 attention backward on the CPU, without ragged "
           "(RuntimeError: expected scalar type Double but found Float; torch 2.13+ passes): see ragged/_compat.py")


@pytest.mark.parametrize("how,backend,wrap", [pytest.param("block", "inductor", True, marks=_INDUCTOR),
                                              ("whole", "aot_eager", False)],
                         ids=["torch-compile-blocks-inductor", "whole-model-aot-eager"])
def test_compiled_model_trains_like_torch_optim_without_graph_breaks_or_recompiles(workers2, how, backend, wrap):
    for r, out in enumerate(workers2.run(_compiled, CASE, how, backend, wrap, timeout=600)):
        assert out["logs"] == [], f"rank {r}: {out['logs']}"
        assert out["control"] == {"graph_break", "recompile"}  # the capture sees what TORCH_LOGS would print
        assert out["diff"] < 1e-10, f"rank {r}: parameters differ from torch.optim by {out['diff']}"
        assert out["loss_err"] < 1e-10 and out["eager_loss_err"] < 1e-12
        if how == "block":
            assert out["same_collectives"]
            assert out["peak"] == out["eager_peak"] < out["model"]
        else:
            assert out["peak"] == out["model"]


def _refused(what):
    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import rank_slice
    from ragged.examples.gpt import loss_fn
    from tests.fsdp._compile_cases import compile_model

    torch._dynamo.reset()
    c = comm()
    model = compile_model(CASE.model(), "block" if what == "functional" else None, "aot_eager")
    units = fsdp.make_units(model, world_size=c.world_size)
    opt = CASE.make_optimizer()
    state = fsdp.init(units, model, opt, c)
    before = {k: v.clone() for k, v in rg.gather(units, state.shards, c).items()}
    if what == "functional":  # functional_call of a compiled model, the step not given the module
        step = fsdp.make_step(units, loss_fn(model), opt, c)
    else:  # a compiled function inside the loss (not a module of the bound model)
        head = torch.compile(lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()),
                             backend="aot_eager")
        step = fsdp.make_step(units, lambda p, b: head(model(b[0]), b[1]), opt, c, module=model)
    try:
        step(state, rank_slice(CASE.task().batch(0, CASE.batch), c.rank, c.world_size))
    except rg.RaggedError as e:
        message = str(e)
    else:
        message = None
    return message, max_diff(rg.gather(units, state.shards, c), before)[0]


@pytest.mark.parametrize("what", ["functional", "function"],
                         ids=["compiled-blocks-without-module", "compiled-function-in-the-loss"])
def test_compiled_code_ragged_cannot_see_is_refused_on_both_ranks(workers2, what):
    for message, moved in workers2.run(_refused, what, timeout=300):
        assert message is not None and "make_step(..., module=model)" in message
        assert moved == 0.0
