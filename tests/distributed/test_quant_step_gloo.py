"""The FSDP step with a quantized gather and reduce-scatter on 2 gloo ranks, in both transports (and
step.lower()'s count of its collectives, call by call and byte by byte, against the real run):
float64 training equals the straight-through torch reference (AdamW, 3 steps, within 1e-10), and
the quantized reduce-scatter equals SGD on rank-order sums of per-rank quantized gradients (the
cases of tests/fsdp/_quant_cases.py, also run on simulated ranks in tests/fsdp/test_quant_step.py)."""

import pytest

from tests.distributed._harness import both_transports, comm, workers_fixture
from tests.fsdp import _quant_cases as qc
from tests.fsdp._cases import Case

pytestmark = pytest.mark.distributed

workers2 = workers_fixture(2)
transport = both_transports()


def _train(case, gather, reduce=None):
    return qc.run(comm(), case, gather, reduce)


def test_training_equals_the_straight_through_reference(workers2):
    case = Case(moe=True, micro_batches=2)
    ref, ref_losses = qc.gather_reference(case, "fp8")
    for params, losses in workers2.run(_train, case, "fp8"):
        assert qc.max_diff(params, ref) < 1e-10
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10


def test_quantized_reduce_scatter_equals_the_rank_order_reference(workers2):
    case = Case(optimizer="sgd", lr=0.5, steps=2)
    ref = qc.reduce_reference(case, 2, "mxfp8", "int8")
    for params, _ in workers2.run(_train, case, "mxfp8", "int8"):
        assert qc.max_diff(params, ref) < 1e-12


def _lowered(case):
    from tests.predict._lower_cases import measured

    return measured(comm(), case, "adamw", gather="fp8", reduce="int8")


def test_the_lowering_counts_the_quantized_collectives_exactly(workers2):
    from tests.predict.test_lower import check

    out = workers2.run(_lowered, Case(moe=True))
    check(out)
    assert all(o["calls"][("all_to_all", "shard")][0] > 0 for o in out)
