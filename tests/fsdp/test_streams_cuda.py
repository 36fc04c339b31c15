"""The step on a real CUDA device (skipped without one; ``pytest -m cuda``, run by
``scripts/gpu_check.sh``): W=1 NCCL through the real step against ``torch.optim.AdamW`` in
float64, the all-gathers and reduce-scatters on their own streams, the same result as with no
side streams at all, bf16 compute with fp32 reductions, and the fake-process-group memory
harness on the GPU. One spawned NCCL process runs every step check (process start-up and CUDA
initialisation dominate on a fast device)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU)")]


def _train(case, comm, device, *, streams=None, steps_dtype=None):
    """(params after training, losses) of ``case`` through rg.fsdp.make_step on ``device``."""
    import copy

    import ragged as rg
    from ragged import fsdp
    from ragged.examples.gpt import loss_fn
    from ragged.fsdp import _runtime

    saved = _runtime.streams_for
    if streams is not None:
        _runtime.streams_for = streams
    try:
        model = case.model().to(device)
        units = fsdp.make_units(model, world_size=comm.world_size)
        opt = case.make_optimizer()
        state = fsdp.init(units, model, opt, comm)
        step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), opt, comm,
                              policy=fsdp.MixedPrecision(compute_dtype=case.compute_dtype, reduce_dtype=case.reduce_dtype))
        task, losses = case.task(), []
        for s in range(case.steps):
            x, y = task.batch(s, case.batch)
            state, m = step(state, (x.to(device), y.to(device)))
            losses.append(m["loss"])
        return {k: v.detach().cpu().clone() for k, v in rg.gather(units, state.shards, comm).items()}, losses
    finally:
        _runtime.streams_for = saved


def _checks(rank, world, backend, fake=False):
    """Runs in one spawned NCCL process (W=1). ``fake``: the same checks on the CPU (gloo, the
    streams of ``tests/fsdp/_streams.py``), so that the suite runs this code without a GPU."""
    import ragged as rg
    from ragged.fsdp import _device
    from tests.fsdp._cases import Case, reference_run
    from tests.fsdp._streams import FakeCudaApi

    comm = rg.collectives.from_torch()
    device = comm.device
    out = {"device": str(device), "backend": backend}
    case = Case()  # float64 GPT, AdamW with weight decay, 3 steps
    ref, ref_losses = reference_run(case)  # CPU, unsharded torch.optim.AdamW
    seen, api = [], FakeCudaApi() if fake else _device.CudaApi

    class Watched(_device.CudaStreams):
        def __init__(self, device):
            super().__init__(torch.device("cuda", 0) if fake else device, api=api)

        def issued(self, stream, work):
            seen.append((stream, self.api.current_stream(0) == self.streams[stream],
                         self.streams[stream] != self.streams[_device.COMPUTE]))
            return super().issued(stream, work)

    got, losses = _train(case, comm, device, streams=Watched)
    out["fp64_max_diff"] = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
    out["fp64_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out["issued"] = sorted(set(seen))
    host, _ = _train(case, comm, device, streams=lambda d: _device.HOST)  # no side streams: waits on the handles
    out["host_vs_streams"] = max((got[k] - host[k]).abs().max().item() for k in got)
    f32, f32_losses = _train(Case(dtype=torch.float32), comm, device)
    bf16, bf16_losses = _train(Case(dtype=torch.float32, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                               comm, device)
    out["bf16_loss_diff"] = max(abs(a - b) for a, b in zip(f32_losses, bf16_losses))
    out["bf16_finite"] = all(torch.isfinite(v).all().item() for v in bf16.values())
    return out


@pytest.fixture(scope="module")
def results():
    from bench._launch import launch

    return launch(1, _checks, backend="nccl", timeout=600)[0]


def test_nccl_w1_step_matches_torch_adamw_in_float64(results):
    assert results["backend"] == "nccl" and results["device"].startswith("cuda")
    assert results["fp64_max_diff"] < 1e-10 and results["fp64_loss_diff"] < 1e-9, results


def test_collectives_run_on_their_own_streams(results):
    """Every all-gather was issued on the gather stream and every reduce-scatter on the reduce
    stream, both distinct from the compute stream."""
    assert {s for s, *_ in results["issued"]} == {"gather", "reduce"}, results["issued"]
    assert all(on and side for _, on, side in results["issued"]), results["issued"]


def test_side_streams_give_the_result_of_no_streams(results):
    assert results["host_vs_streams"] < 1e-12, results["host_vs_streams"]


def test_bf16_compute_with_fp32_reductions_stays_close_to_fp32(results):
    assert results["bf16_finite"] and results["bf16_loss_diff"] < 5e-2, results


def test_the_fake_process_group_memory_harness_runs_on_the_gpu():
    from bench.memory import run_cell

    cell = run_cell("tiny", 8, True, batch=2, warmup=1, timeout=600)
    for name in ("ragged", "fsdp2"):
        assert cell[name]["device"].startswith("cuda"), cell[name]["device"]
        step = cell[name]["step"]
        assert step["peak"] > step["start"] > 0 and step["reserved_peak"] >= step["peak"]
