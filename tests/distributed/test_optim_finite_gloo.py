"""Non-finite gradients on one of 2 gloo ranks: apply_if_finite skips on every rank (params and
inner state bit-identical, applied steps equal torch.optim.AdamW), clip_by_global_norm(
error_if_nonfinite=True) raises the same error on every rank before anything changes. The
same cases as tests/optim/test_finite.py, on real processes."""

from __future__ import annotations

import pytest

from tests.distributed._harness import comm, workers_fixture
from tests.optim import _finite_cases as cases

pytestmark = pytest.mark.distributed

workers2 = workers_fixture(2)


def _apply_if_finite(schedule):
    return cases.run_apply_if_finite(comm(), schedule)


def _clip(where):
    return cases.run_clip_nonfinite(comm(), where)


@pytest.mark.parametrize("schedule", sorted(cases.SCHEDULES))
def test_apply_if_finite_on_gloo(workers2, schedule):
    cases.check_apply_if_finite(workers2.run(_apply_if_finite, schedule), schedule)


@pytest.mark.parametrize("where", ["shard", "replicated", None])
def test_clip_error_if_nonfinite_on_gloo(workers2, where):
    cases.check_clip_nonfinite(workers2.run(_clip, where), where)
