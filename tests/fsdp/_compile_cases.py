"""Shared cases for the compiled-model tests (simulated backend and gloo workers).

``compiled_run(comm, case, compile=...)`` trains ``tests.fsdp._cases.Case``'s tiny GPT with
``rg.fsdp.make_step(..., module=model)`` with the model compiled (``"block"``: every block,
``"whole"``: the model, ``None``: eager) and returns the trained parameters, the losses, the
all-gathers and reduce-scatters the last call issued (from its trace) and its metrics. :func:`dynamo_logs` captures what
``TORCH_LOGS=graph_breaks,recompiles`` prints.
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.data import rank_slice
from ragged.examples.gpt import loss_fn

# ragged's own code (not the example models, whose graph breaks are the user's)
RAGGED_CODE = re.compile(r"ragged/(?:fsdp|collectives|transforms|optim|spec|checkpoint|parallel)/|ragged/_\w+\.py")


def in_ragged(message: str) -> bool:
    """Whether a graph break is in ragged's code, or a recompile is of ragged's code or guarded on
    it: its first line (``Graph break in user code at FILE:LINE`` / ``Recompiling function F in
    FILE``) or a failed guard (the lines up to the user stack) names ragged's code. A graph break's
    user traceback runs through ragged's step, which calls the loss, so it is not looked at."""
    lines = message.splitlines()
    head = [lines[0]] if lines else []
    if "Recompiling" in message:
        head += [l for l in lines[1:] if l.strip().startswith("- ") and "User stack" not in l and "File" not in l]
    return any(RAGGED_CODE.search(l) for l in head)


def compile_model(model, how: str | None, backend: str, *, wrap: bool = False):
    """``"block"``: every block compiled (``block.compile()``, or with ``wrap`` a
    ``torch.compile(block)`` wrapper put back in the list, as torchtitan does); ``"whole"``:
    ``model.compile()``."""
    if how == "block":
        for k, block in enumerate(model.blocks):
            if wrap:
                model.blocks[k] = torch.compile(block, backend=backend)
            else:
                block.compile(backend=backend)
    elif how == "whole":
        model.compile(backend=backend)
    return model


def compiled_run(comm, case, *, compile: str | None = "block", backend: str = "inductor", wrap: bool = False,
                 functional: bool = False, compile_update: bool = False):
    """``(params, losses, collectives, metrics of the last step)`` (``collectives``: the last step's
    all-gathers and reduce-scatters from its trace, in issue order); ``functional``: the loss reads the
    parameters through ``functional_call`` and the step is not given the module;
    ``compile_update``: the optimizer's update compiled too (with ``backend``)."""
    model = compile_model(case.model(), compile, backend, wrap=wrap)
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = case.make_optimizer()
    if compile_update:
        opt = opt._replace(update=torch.compile(opt.update, backend=backend))
    state = fsdp.init(units, model, opt, comm)
    step = fsdp.make_step(units, loss_fn(model, checkpoint=case.activation_checkpointing), opt, comm,
                          micro_batches=case.micro_batches, module=None if functional else model, trace=True)
    task, losses, metrics = case.task(), [], None
    for s in range(case.steps):
        state, metrics = step(state, rank_slice(task.batch(s, case.batch), comm.rank, comm.world_size))
        losses.append(metrics["loss"])
    full = rg.gather(units, state.shards, comm)
    issued = tuple(e for e in metrics.pop("trace") if e[0] in ("gather_start", "reduce_start"))
    return {k: v.clone() for k, v in full.items()}, losses, issued, metrics


@contextlib.contextmanager
def dynamo_logs():
    """The records ``TORCH_LOGS=graph_breaks,recompiles`` prints, as ``(kind, message)`` pairs
    (``kind``: ``"graph_break"`` or ``"recompile"``), captured in this process."""
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            kind = "recompile" if "recompiles" in record.name else "graph_break"
            records.append((kind, record.getMessage()))

    handler = Capture(level=logging.DEBUG)
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def _graph_break_and_recompile(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def logs_arrive() -> set[str]:
    """The kinds :func:`dynamo_logs` captures from a function that breaks its graph and is then
    recompiled for another rank: ``{"graph_break", "recompile"}`` when the capture works (the
    control of a test that asserts no log)."""
    fn = torch.compile(_graph_break_and_recompile, backend="eager")
    with dynamo_logs() as records:
        fn(torch.ones(2))
        fn(torch.ones(2, 2))
    return {kind for kind, _ in records}

