"""``step.lower(...)`` against real steps on 2 and 4 gloo ranks, in both transports: every rank's persistent bytes by category
and every collective's calls and bytes (counted at the ``Collectives`` boundary of the torch
backend) exact (see [Note: lowering a step] in ``ragged/predict/_lower.py``)."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from tests.distributed._harness import TRANSPORTS, workers_2_and_4
from tests.fsdp._cases import Case
from tests.predict._lower_cases import measured

workers2, workers4, workers = workers_2_and_4()

CASES = {
    "dense-fp64-adamw": (Case(), "adamw"),
    "moe-multibuffer-adamw8bit": (Case(moe=True, max_buffers="auto"), "adamw8bit"),
    "frozen-bf16": (Case(frozen=("blocks.0", "tok"), dtype=torch.float32, compute_dtype=torch.bfloat16), "adamw"),
    "muon": (Case(), "muon"),
    "clip-finite": (Case(), "clip-finite"),
}


def _measured(case, optimizer, transport):
    return measured(rg.collectives.from_torch(**dict(transport)), case, optimizer)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("name", list(CASES))
def test_lowered_step_is_exact_on_gloo(workers, name, transport):
    out = workers.run(_measured, *CASES[name], tuple(TRANSPORTS[transport].items()))
    for o in out:
        assert o["state"] == o["predicted_state"], f"rank {o['rank']}"
        assert o["calls"] == o["predicted_calls"], f"rank {o['rank']}"
        assert o["objects"] == o["predicted_objects"]
        assert o["metrics"]["peak_gathered_bytes"] == o["predicted"]["peak_gathered_bytes"]
    assert ("reduce_scatter", "shard") in out[0]["calls"]
