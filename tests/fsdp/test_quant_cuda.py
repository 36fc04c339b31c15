"""The quantized step on a real CUDA device (skipped without one; ``pytest -m cuda``, run by
``scripts/gpu_check.sh``): W=1 NCCL, an fp8 / mxfp8 gather and an int8 reduce-scatter through the
real step, against the CPU's straight-through float64 reference (quantization is IEEE float32
arithmetic and a round-to-nearest-even cast, the same bits on both devices)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU)")]


def _train(rank, world, backend):
    import ragged as rg
    from tests.fsdp import _quant_cases as qc
    from tests.fsdp._cases import Case

    comm = rg.collectives.from_torch()
    out = {}
    for gather, reduce in (("fp8", None), ("mxfp8", "int8")):
        case = Case(moe=True)
        params, losses = qc.run(comm, case, gather, reduce, device=comm.device)
        out[(gather, reduce)] = ({k: v.cpu() for k, v in params.items()}, losses)
    return str(comm.device), out


@pytest.fixture(scope="module")
def results():
    from bench._launch import launch

    return launch(1, _train, backend="nccl", timeout=600)[0]


def test_fp8_gather_step_on_nccl_equals_the_straight_through_reference(results):
    from tests.fsdp import _quant_cases as qc
    from tests.fsdp._cases import Case

    device, runs = results
    assert device.startswith("cuda")
    ref, ref_losses = qc.gather_reference(Case(moe=True), "fp8")
    params, losses = runs[("fp8", None)]
    assert qc.max_diff(params, ref) < 1e-10
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10


def test_mxfp8_gather_and_int8_reduce_scatter_on_nccl_equal_the_cpu_run(results):
    import ragged as rg
    from tests.fsdp import _quant_cases as qc
    from tests.fsdp._cases import Case

    _, runs = results
    cpu = rg.collectives.simulate(1, qc.run, Case(moe=True), "mxfp8", "int8")[0]
    assert qc.max_diff(runs[("mxfp8", "int8")][0], cpu[0]) < 1e-10
