"""The step's stream program (see [Note: streams and lifetimes] in ragged/fsdp/_device.py), run
on the CPU through the real ``CudaStreams`` over a recording fake of the ``torch.cuda`` calls
(``tests/fsdp/_streams.py``): results equal the host path's, no two streams touch a buffer
unordered (the race detector), gathers and reduce-scatters overlap compute, and the detector
does catch a missing fence or wait, each both ways a unit gets its gathered memory (a pool block
swapped in, or its storage resized: ``ragged._compat.CAN_SWAP_STORAGE``); the quantized
collectives' scratch buffers never pass from one side stream to the other. Also: a backward whose
callbacks come from two autograd threads is refused on every rank."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

import ragged as rg
from ragged import _compat
from ragged.collectives import _scratch
from ragged.fsdp import _device, _pool, _runtime
from ragged.transforms import _quantized
from tests.fsdp import _quant_cases as qc
from tests.fsdp._cases import Case, fsdp_run
from tests.fsdp._streams import FakeCudaApi, RecordingStreams

CASES = {
    "w2": (2, Case()),
    "w2-accum2-moe": (2, Case(micro_batches=2, moe=True)),
    "w2-chunks4-inflight2": (2, Case(chunks=4, max_inflight_reduce=2)),
    "w2-cast-fp32-compute-fp64-reduce": (2, Case(compute_dtype=torch.float32, reduce_dtype=torch.float64)),
    "w2-activation-checkpointing": (2, Case(activation_checkpointing=True)),
    "w2-split-buffers-replicated-vectors": (2, Case(split_buffers=True, replicate_vectors=True)),
    "w3-inflight2": (3, Case(batch=6, max_inflight_reduce=2)),
    "w2-noprefetch-noreshard": (2, Case(prefetch=False, reshard_after_forward=False)),
}


@pytest.fixture(params=["swap", "resize"])
def storage(request, monkeypatch):
    """The runtime's way to give a unit its gathered memory: both on a torch that can swap a
    storage's memory (2.13+), the resize path alone on one that cannot (2.11)."""
    if request.param == "swap" and not _compat.CAN_SWAP_STORAGE:
        pytest.skip(f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_ (torch 2.13 and 2.14 have it)")
    monkeypatch.setattr(_compat, "CAN_SWAP_STORAGE", request.param == "swap")
    return request.param


def _fake_run(monkeypatch, world, case, **kw):
    """The case on the simulated backend with every call's streams a RecordingStreams (one fake
    device per rank)."""
    apis, made, lock = {}, [], threading.Lock()

    def streams_for(device):
        with lock:
            api = apis.setdefault(threading.get_ident(), FakeCudaApi())
            made.append(RecordingStreams(api))
            return made[-1]

    monkeypatch.setattr(_runtime, "streams_for", streams_for)
    return rg.collectives.simulate(world, fsdp_run, case, **kw), made


@pytest.mark.parametrize("name", list(CASES))
def test_fake_cuda_streams_give_the_host_results_and_no_races(monkeypatch, storage, name):
    world, case = CASES[name]
    host = rg.collectives.simulate(world, fsdp_run, case)
    fake, made = _fake_run(monkeypatch, world, case)
    assert len(made) >= world * case.steps
    for (hp, hm), (fp, fm) in zip(host, fake):
        for k in hp:
            assert torch.equal(hp[k], fp[k]), k
        assert [m["loss"] for m in hm] == [m["loss"] for m in fm]
    problems = [p for s in made for p in s.problems]
    assert problems == [], problems[:5]


def test_gathers_and_reduce_scatters_overlap_compute(monkeypatch, storage):
    """Most all-gathers run while compute works on something queued after them; every
    reduce-scatter but the last one does. Without prefetch no forward all-gather does."""
    _, made = _fake_run(monkeypatch, 2, Case(num_layers=4, steps=2))
    ag, n_ag = made[-1].overlapped(_device.GATHER)
    rs, n_rs = made[-1].overlapped(_device.REDUCE)
    assert n_ag >= 10 and ag >= n_ag - 1, (ag, n_ag)
    assert n_rs >= 5 and rs >= n_rs - 1, (rs, n_rs)
    _, plain = _fake_run(monkeypatch, 2, Case(num_layers=4, steps=2, prefetch=False))
    ag_plain, n_plain = plain[-1].overlapped(_device.GATHER)
    assert n_plain >= 10 and ag_plain <= 2, (ag_plain, n_plain)


def _most_in_flight(trace) -> int:
    live = most = 0
    for event, _, _ in trace:
        live += (event == "reduce_start") - (event == "reduce_done")
        most = max(most, live)
    return most


def test_reduce_scatters_stay_in_flight_while_the_device_runs_them(monkeypatch):
    """A reduce-scatter is finished when the program says (``max_inflight_reduce``), not when the
    host has queued its wait (issue 44, item 4: ``is_completed`` said yes after any wait, so every
    reduce-scatter was finished at once and compute waited for it): two stay in flight whether the
    device keeps up or lags; its progress only gives the gradient buffers back earlier."""
    peaks = {}
    for lags in (False, True):
        monkeypatch.setattr(FakeCudaApi, "device_lags", lags)
        out, made = _fake_run(monkeypatch, 2, Case(num_layers=4, steps=1, max_inflight_reduce=2), trace=True)
        assert [p for s in made for p in s.problems] == []
        assert [_most_in_flight(metrics[-1]["trace"]) for _, metrics in out] == [3, 3]  # the bound, plus the one starting
        peaks[lags] = out[0][1][-1]["peak_grad_bytes"]
    assert peaks[False] < peaks[True], peaks


def test_the_race_detector_catches_a_buffer_reused_without_its_fence(monkeypatch, storage):
    give = _pool.Pool.give
    monkeypatch.setattr(_pool.Pool, "give", lambda self, block, fences=(): give(self, block, ()))
    _, made = _fake_run(monkeypatch, 2, Case(num_layers=3, steps=1))
    races = [p for s in made for p in s.problems if p.startswith("race")]
    assert races, "dropping every fence must show up as a race"


def test_the_race_detector_catches_compute_not_waiting_for_an_all_gather(monkeypatch, storage):
    monkeypatch.setattr(_device.CudaStreams, "done", lambda self, stream, pending: None)
    _, made = _fake_run(monkeypatch, 2, Case(num_layers=3, steps=1))
    races = [p for s in made for p in s.problems if p.startswith("race") and "read on compute" in p]
    assert races


def test_the_host_strategy_is_the_cpu_one():
    assert _device.streams_for(torch.device("cpu")) is _device.HOST
    with _device.HOST.on(_device.GATHER):
        assert _device.HOST.record(_device.GATHER) is None


def test_a_backward_on_two_autograd_threads_is_refused_on_every_rank(monkeypatch):
    """As if autograd ran some nodes on another device's thread (see [Note: the marker argument on
    CUDA]): every rank raises, before any parameter changes."""
    calls = collections.Counter()

    def thread_id():
        t = threading.get_ident()
        calls[t] += 1
        return t, calls[t] > 20  # from the 21st callback on: "another thread"

    monkeypatch.setattr(_runtime, "_thread_id", thread_id)
    with pytest.raises(rg.RaggedError, match="more than one thread"):
        rg.collectives.simulate(2, fsdp_run, Case(num_layers=3, steps=1))


def test_the_cuda_checks_pass_on_the_cpu_with_fake_streams():
    """``tests/fsdp/test_streams_cuda.py``'s one worker, run on a 1-rank gloo group with the fake
    streams: the code the GPU check runs is exercised here too, with the same assertions."""
    from bench._launch import launch
    from tests.fsdp import test_streams_cuda as on_gpu

    results = launch(1, on_gpu._checks, True, backend="gloo", timeout=600)[0]
    on_gpu.test_collectives_run_on_their_own_streams(results)
    on_gpu.test_side_streams_give_the_result_of_no_streams(results)
    on_gpu.test_bf16_compute_with_fp32_reductions_stays_close_to_fp32(results)
    assert results["fp64_max_diff"] < 1e-10 and results["fp64_loss_diff"] < 1e-9, results


class _RankScratch:
    """The quantized collectives' scratch pool as each rank's device sees it: one real pool per
    simulated rank (one process per rank in a real run), whose buffers are reported to the rank's
    current ``RecordingStreams`` as device memory: a ``take`` writes the buffer on the current
    stream (the encode, the collective's output), a ``give`` reads it there (the decode queued on
    the waiting stream). ``reused`` counts, per stream, the takes a free buffer served."""

    def __init__(self, recorders: dict):
        self.recorders, self.pools, self.seen = recorders, {}, {}
        self.reused = collections.Counter()

    def _here(self):
        t = threading.get_ident()
        rec = self.recorders[t]
        return self.pools.setdefault(t, _scratch._Scratch()), rec, rec.fake.current_name()

    def take(self, numel, dtype, device):
        pool, rec, stream = self._here()
        buf = pool.take(numel, dtype, device)
        key = ("scratch", id(buf))
        if id(buf) in self.seen:
            self.reused[stream] += 1
            rec.access(stream, key, write=True)
        else:
            self.seen[id(buf)] = buf  # kept alive: ids stay unique
            rec.alloc(stream, key, buf.numel() * buf.element_size())
        return buf

    def give(self, buf):
        pool, rec, stream = self._here()
        rec.access(stream, ("scratch", id(buf)))
        pool.give(buf)


def test_quantized_collectives_on_two_side_streams_never_share_a_scratch_buffer(monkeypatch):
    """A unit's fp8 gather and its fp8 reduce-scatter move chunks of one size here (float64
    throughout, the same blocks), so one pool for both side streams handed the buffer a
    reduce-scatter had just given back to the next all-gather, which wrote it while the reduce
    stream could still be summing out of it (see [Note: scratch across streams] in
    ragged/collectives/_scratch.py): a race here, a wrong gradient or weight on a GPU. Keyed by
    stream, each side stream reuses only its own buffers, and the results are the host's."""
    case = Case(num_layers=2, steps=2)
    host = rg.collectives.simulate(2, qc.run, case, "fp8", "fp8")
    apis, recorders, made = {}, {}, []

    def streams_for(device):
        t = threading.get_ident()
        recorders[t] = RecordingStreams(apis.setdefault(t, FakeCudaApi()))
        made.append(recorders[t])
        return recorders[t]

    def current_stream(device):
        api = apis[threading.get_ident()]
        return api.by_name[api.current_name()]

    scratch = _RankScratch(recorders)
    monkeypatch.setattr(_runtime, "streams_for", streams_for)
    monkeypatch.setattr(_quantized, "SCRATCH", scratch)
    monkeypatch.setattr(_scratch, "current_stream", current_stream)
    fake = rg.collectives.simulate(2, qc.run, case, "fp8", "fp8")
    problems = [p for s in made for p in s.problems]
    assert problems == [], problems[:5]
    assert scratch.reused[_device.GATHER] and scratch.reused[_device.REDUCE], scratch.reused  # the pool is in play
    for (hp, hl), (fp, fl) in zip(host, fake):
        assert hl == fl and all(torch.equal(hp[k], fp[k]) for k in hp)
