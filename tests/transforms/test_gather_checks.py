"""gather refuses a lossy cast and a wrong ``out=`` before any collective."""

from __future__ import annotations

import re

import pytest
import torch

import ragged as rg

simulate = rg.collectives.simulate
PARAMS = {"w": torch.randn(5, 3), "b": torch.randn(3)}


class _Counting:
    """A comm that counts the collectives it is asked for (and forwards them)."""

    def __init__(self, comm):
        self._comm, self.calls = comm, 0

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name.startswith("all_") or name.startswith("reduce_"):
            def call(*args, **kwargs):
                self.calls += 1
                return attr(*args, **kwargs)

            return call
        return attr


def _try(comm, **kwargs):
    plan = rg.make_plan(PARAMS, world_size=comm.world_size)
    counting = _Counting(comm)
    try:
        rg.gather(rg.shard(plan, PARAMS, rank=comm.rank), counting, **kwargs)
    except rg.RaggedError as exc:
        return type(exc).__name__, str(exc), counting.calls
    return None, None, counting.calls


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_float_to_integer_gather_is_refused(dtype):
    for name, text, calls in simulate(2, _try, dtype=dtype):
        assert name == "RaggedValueError" and calls == 0
        assert f"dtype={dtype} would cast the torch.float32 shard" in text and ".to(" in text


def test_explicit_integer_gather_and_float_casts_work():
    plan = rg.make_plan(PARAMS, world_size=2)

    def fn(comm):
        d = rg.shard(plan, PARAMS, rank=comm.rank)
        ints = rg.gather(d.replace(data=d.data.to(torch.int32), replicated=d.replicated.to(torch.int32)), comm)
        half = rg.gather(d, comm, dtype=torch.bfloat16)
        return ints["w"].dtype, half["w"].dtype

    assert simulate(2, fn) == [(torch.int32, torch.bfloat16)] * 2


@pytest.mark.parametrize("numel_delta, dtype", [(1, torch.float32), (-1, torch.float32), (0, torch.float64)])
def test_wrong_out_is_refused_before_any_collective(numel_delta, dtype):
    plan = rg.make_plan(PARAMS, world_size=2)
    out = torch.empty(plan.buffer_numel + numel_delta, dtype=dtype)
    for name, text, calls in simulate(2, _try, out=out):
        assert name == "RaggedValueError" and calls == 0, text
        assert re.search(r"gather: out= (must be|is)", text)
