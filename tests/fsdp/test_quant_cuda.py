"""The quantized step on a real CUDA device (skipped without one; ``pytest -m cuda``, run by
``scripts/gpu_check.sh``): W=1 NCCL, an fp8 / mxfp8 gather and an int8 reduce-scatter through the
real step, against the CPU's straight-through float64 reference (quantization is IEEE float32
arithmetic and a round-to-nearest-even cast, the same bits on both devices); and a quantized gather
and reduce-scatter on two streams, whose scratch buffers must not pass from one stream to the other
(see [Note: scratch across streams] in ragged/collectives/_scratch.py)."""

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
    out["two streams"] = _two_streams(comm)
    return str(comm.device), out


def _two_streams(comm):
    """An fp8 gather on stream A whose decode is held back (a sleep queued before its wait), then an
    fp8 reduce-scatter of other values on stream B with chunks of the same size: a pool shared by
    both streams hands B the gather's chunks, and B writes its codes into them before A decodes.
    Returns the gathered weight and the reduced gradient (CPU) and their expected values."""
    import ragged as rg
    from ragged import spec

    fmt = rg.quant.fp8(block=(32, 32))
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    plan = rg.make_plan({"w": w}, {"w": spec.Blocks(32, 32)}, world_size=comm.world_size)
    dbuf = rg.shard(plan, {"w": w.to(comm.device)}, comm)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    a.wait_stream(torch.cuda.current_stream())
    b.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(a):
        pending = rg.gather_start(dbuf, comm, format=fmt)
        torch.cuda._sleep(1 << 29)  # ~0.3 s of stream A: its decode runs after B has gone ahead
        gathered = rg.gather_wait(pending)["w"]
    with torch.cuda.stream(b):
        reduced = rg.reduce_scatter(plan, {"w": g.to(comm.device)}, comm, op="sum", format=fmt).views()["w"]
    torch.cuda.synchronize()
    roundtrip = lambda x: rg.quant.dequantize(*rg.quant.quantize(x, fmt), fmt)  # noqa: E731
    return gathered.cpu(), roundtrip(w), reduced.cpu(), roundtrip(g)


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


def test_a_scratch_buffer_given_back_on_one_stream_is_not_written_by_another(results):
    _, runs = results
    gathered, want_gathered, reduced, want_reduced = runs["two streams"]
    assert torch.equal(gathered, want_gathered)
    assert torch.equal(reduced, want_reduced)
