"""Quantization on a real CUDA device (skipped without one; ``pytest -m cuda``, run by
``scripts/gpu_check.sh``), W=1 NCCL:

* bit for bit against the CPU: ``quantize`` / ``dequantize`` of every format on crafted amax values
  (where CUDA's division by a host scalar would round differently: [Note: a division every device
  rounds alike] in ragged/_divide.py) and random ones; the quantized gather and reduce-scatter of
  each format over NCCL; a quantized gather and reduce-scatter on two streams, whose scratch
  buffers must not pass from one stream to the other (see [Note: scratch across streams] in
  ragged/collectives/_scratch.py);
* the real step with an fp8 / mxfp8 gather and an int8 reduce-scatter against the CPU's
  straight-through float64 reference and the CPU's run: the quantization is the CPU's bit for bit
  (above), but the model's float64 matrix products are cuBLAS's, which sum in another order than
  the CPU's BLAS, so these compare within 1e-10."""

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
    out["formats"] = {name: _formats(comm, name) for name in FORMATS}
    # numpy arrays travel back by value; a tensor would be shared memory the exiting process takes along
    return str(comm.device), rg.pytree.map(lambda t: t.cpu().numpy() if isinstance(t, torch.Tensor) else t, out)


FORMATS = ("fp8", "int8", "mxfp8")
AMAX = [3.0, 9.0, 11.0, 13.0, 143.0, 0.3, 9.0 * 2.0**-20, 13.0 * 2.0**40]  # amax / q != amax * (1 / q) for some q


def _inputs():
    """A 64 x 128 float32 tensor: random blocks of every magnitude, and rows whose first block's
    amax is one of ``AMAX``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    for i, a in enumerate(AMAX):
        x[i, :32] = torch.linspace(-a, a / 3, 32)
    return x


def _fmt(name):
    import ragged as rg

    return rg.quant.mxfp8(block=32) if name == "mxfp8" else getattr(rg.quant, name)(block=(1, 32))


def _formats(comm, name):
    """On the device: ``quantize`` of :func:`_inputs` and its ``dequantize``; its gather and its
    sum-reduce-scatter over ``comm`` in the format (CPU copies)."""
    import ragged as rg
    from ragged import spec

    fmt, x = _fmt(name), _inputs()
    codes, scales = rg.quant.quantize(x.to(comm.device), fmt)
    plan = rg.make_plan({"w": x}, {"w": spec.Blocks(1, 32) if name != "mxfp8" else spec.Elements(32)},
                        world_size=comm.world_size)
    dbuf = rg.shard(plan, {"w": x.to(comm.device)}, comm)
    gathered = rg.gather(dbuf, comm, format=fmt)["w"]
    reduced = rg.reduce_scatter(plan, {"w": x.to(comm.device)}, comm, op="sum", format=fmt).views()["w"]
    return {"codes": codes.view(torch.uint8).cpu(), "scales": scales.cpu(),
            "dequantized": rg.quant.dequantize(codes, scales, fmt).cpu(), "gathered": gathered.cpu(),
            "reduced": reduced.cpu()}


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

    import numpy as np

    import ragged as rg

    return rg.pytree.map(lambda a: torch.from_numpy(a) if isinstance(a, np.ndarray) else a,
                         launch(1, _train, backend="nccl", timeout=600)[0])


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


@pytest.mark.parametrize("name", FORMATS)
def test_quantization_and_the_quantized_collectives_are_the_cpu_s_bit_for_bit(results, name):
    import ragged as rg
    from ragged import spec

    got = results[1]["formats"][name]
    fmt, x = _fmt(name), _inputs()
    codes, scales = rg.quant.quantize(x, fmt)
    assert torch.equal(got["codes"], codes.view(torch.uint8)) and torch.equal(got["scales"], scales)
    assert torch.equal(got["dequantized"], rg.quant.dequantize(codes, scales, fmt))
    plan = rg.make_plan({"w": x}, {"w": spec.Blocks(1, 32) if name != "mxfp8" else spec.Elements(32)}, world_size=1)

    def cpu(comm):
        dbuf = rg.shard(plan, {"w": x}, comm)
        return (rg.gather(dbuf, comm, format=fmt)["w"],
                rg.reduce_scatter(plan, {"w": x}, comm, op="sum", format=fmt).views()["w"])

    gathered, reduced = rg.collectives.simulate(1, cpu)[0]
    assert torch.equal(got["gathered"], gathered) and torch.equal(got["reduced"], reduced)
