"""What the step benchmark measures, and how (all in the benchmark process, nothing in ragged).

* Step time: ``barrier``; ``perf_counter`` around the step (CUDA: synchronize); the max over ranks.
* Allocated tensor bytes (CPU has no allocator statistics in torch 2.13): the bytes of the
  tensors the method keeps between steps (:func:`storage_bytes`, unique storages: parameter
  shards, optimizer state, gradients), plus the largest rise of allocated bytes during one
  step, from the allocation / free events of torch's profiler (``profile_memory=True``; the
  raw kineto events, every CPU allocation made by a thread that torch's profiler follows:
  the main and autograd threads; gloo's own threads allocate nothing for the paths used
  here, since both FSDP2 and ragged hand gloo preallocated outputs). On CUDA:
  ``torch.cuda.max_memory_allocated``.
* RSS: ``/proc/self/status`` VmHWM after resetting it (``/proc/self/clear_refs`` 5) right
  before the step, minus VmRSS before the step: how much resident memory the step adds.
  Both methods live in one process, so absolute RSS is not split between them.
* Bytes communicated: every collective the method issues is counted at the API the method
  calls (FSDP2: ``torch.distributed`` functions; ragged: its ``Collectives`` object) as the
  full buffer: all-gather output, reduce-scatter input, all-reduce tensor.
* Copies and where time goes: one extra profiled step per method; host time in labelled
  ranges (FSDP2's own ``record_function`` labels, and labels this module adds around
  ragged's step internals) and in copy ops.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import time

import torch
import torch.distributed as dist

__all__ = ["storage_bytes", "rss", "reset_peak_rss", "CommCounter", "profile_step", "ragged_labels", "Timer"]


def storage_bytes(tensors) -> int:
    """Bytes of the unique storages behind ``tensors`` (DTensors count their local tensor)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        local = getattr(t, "_local_tensor", None)
        if local is not None:
            t = local
        if t.is_meta:  # no memory (e.g. rg.fsdp placeholders); meta storages all report data_ptr 0
            continue
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in seen or s.nbytes() == 0:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def _status() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmHWM", "VmRSS")):
                    k, v = line.split(":")
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def rss() -> dict[str, int]:
    """``{"VmHWM": bytes, "VmRSS": bytes}`` of this process (empty off Linux)."""
    return _status()


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux ``clear_refs`` 5); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class CommCounter:
    """Counts collective bytes per method (see the module docstring)."""

    def __init__(self):
        self.active: str | None = None
        self.bytes = collections.Counter()
        self.calls = collections.Counter()
        self._patched = []

    def add(self, kind: str, nbytes: int):
        if self.active is not None:
            self.bytes[(self.active, kind)] += nbytes
            self.calls[(self.active, kind)] += 1

    def reset(self):
        self.bytes.clear()
        self.calls.clear()

    def per(self, method: str) -> dict[str, int]:
        return {k: v for (m, k), v in self.bytes.items() if m == method}

    def install_torch(self, method: str):
        """Counts ``torch.distributed`` collectives while ``self.active == method``."""
        def nb(t):
            return t.numel() * t.element_size()

        specs = {
            "all_gather_single": ("all_gather", lambda a, k: nb(k.get("output", a[0] if a else None))),
            "all_gather_into_tensor": ("all_gather", lambda a, k: nb(k.get("output_tensor", a[0] if a else None))),
            "reduce_scatter_single": ("reduce_scatter", lambda a, k: nb(k.get("input", a[1] if len(a) > 1 else None))),
            "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: nb(k.get("input", a[1] if len(a) > 1 else None))),
            "all_reduce": ("all_reduce", lambda a, k: nb(k.get("tensor", a[0] if a else None))),
        }
        for name, (kind, size) in specs.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue

            @functools.wraps(orig)
            def wrapped(*a, _orig=orig, _kind=kind, _size=size, **k):
                if self.active == method:
                    self.add(_kind, _size(a, k))
                return _orig(*a, **k)

            setattr(dist, name, wrapped)
            self._patched.append((dist, name, orig))

    def install_comm(self, comm, method: str):
        """Counts a ragged ``Collectives`` object's calls while ``self.active == method``."""
        def wrap(name, kind, size):
            orig = getattr(comm, name)

            @functools.wraps(orig)
            def wrapped(*a, **k):
                if self.active == method:
                    self.add(kind, size(*a, **k))
                return orig(*a, **k)

            setattr(comm, name, wrapped)

        wrap("all_gather_into", "all_gather", lambda out, inp, **k: out.numel() * out.element_size())
        wrap("reduce_scatter_into", "reduce_scatter", lambda out, inp, **k: inp.numel() * inp.element_size())
        wrap("all_reduce", "all_reduce", lambda t, **k: t.numel() * t.element_size())
        wrap("all_to_all", "all_to_all", lambda out, inp, *a, **k: inp.numel() * inp.element_size())


class Timer:
    """Wall time of a step, synchronised across ranks (the max over ranks)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt), out


_FQN = re.compile(r" \(.*\)$|\s*for .*$")
COPY_OPS = ("fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")


def _norm(name: str) -> str:
    return _FQN.sub("", name)


def _label(name: str) -> str | None:
    if name.startswith(("FSDP::", "ragged::", "Optimizer.step")):
        return _norm(name)
    return None


def profile_step(fn, *, device: torch.device):
    """Runs ``fn()`` once under torch's profiler.

    Returns:
        ``(peak_rise_bytes, ranges_ms, copies_ms, peak_where)``: the largest rise of allocated CPU bytes
        during the call (CUDA: of ``max_memory_allocated`` over the start); the *exclusive*
        host time of every labelled range (``FSDP::...`` / ``ragged::...`` / optimizer step,
        summed by label with the module fqn stripped; time in nested labelled ranges is
        subtracted); and the host time of copy / reduction ops, keyed ``"op @ label"`` by the
        innermost labelled range they run in; and where the memory peak was reached (CPU: the
        innermost labelled ranges and op running at that moment).
    """
    from torch.profiler import ProfilerActivity, profile

    peak_where = ""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        kevents = prof.profiler.kineto_results.events()
        events = sorted((e.start_ns(), e.nbytes()) for e in kevents if e.name() == "[memory]")
        cur = peak = 0
        peak_ns = None
        for ts, n in events:
            cur += n
            if cur > peak:
                peak, peak_ns = cur, ts
        if peak_ns is not None:  # which labelled range / op was running when the peak was reached
            inside = [e for e in kevents if e.name() != "[memory]" and e.start_ns() <= peak_ns <= e.end_ns()]
            labels = sorted((e for e in inside if _label(e.name())), key=lambda e: e.start_ns())
            ops = sorted((e for e in inside if not _label(e.name())), key=lambda e: e.start_ns())
            peak_where = " > ".join([_label(e.name()) for e in labels[-2:]] + [e.name() for e in ops[-1:]])
    ranges = collections.Counter()
    copies = collections.Counter()

    def labelled_below(e):
        """Total time of the top-most labelled descendants of e."""
        total = 0.0
        for c in e.cpu_children:
            total += c.cpu_time_total if _label(c.name) else labelled_below(c)
        return total

    for e in prof.events():
        label = _label(e.name)
        if label:
            ranges[label] += (e.cpu_time_total - labelled_below(e)) / 1e3
        if e.name in COPY_OPS or e.name in _COPYISH:
            p, where = e.cpu_parent, "-"
            while p is not None:
                if p.name in COPY_OPS:  # an aten op inside FSDP2's copy op: counted there
                    where = None
                    break
                if _label(p.name):
                    where = _label(p.name)
                    break
                p = p.cpu_parent
            if where is not None:
                copies[f"{e.name} @ {where}"] += e.cpu_time_total / 1e3
    return peak, dict(ranges), dict(copies), peak_where


_COPYISH = ("aten::copy_", "aten::cat", "aten::sum", "aten::_chunk_cat", "aten::split_with_sizes_copy", "aten::zero_",
            "aten::fill_", "aten::masked_fill_")


@contextlib.contextmanager
def ragged_labels():
    """Adds ``record_function`` labels around ragged's FSDP step internals (bench only)."""
    from torch.profiler import record_function

    from ragged.fsdp import _step

    targets = {
        "_start": "ragged::all_gather_start",
        "_wait": "ragged::all_gather_wait",
        "_store_grad": "ragged::grad_copy_in",
        "_reduce": "ragged::reduce_scatter_start",
        "_finish_oldest_reduce": "ragged::reduce_scatter_wait+sum",
    }
    saved = {}
    for attr, label in targets.items():
        orig = getattr(_step._Run, attr)
        saved[attr] = orig

        def wrapped(self, *a, _orig=orig, _label=label, **k):
            with record_function(_label):
                return _orig(self, *a, **k)

        setattr(_step._Run, attr, wrapped)
    step_call = _step.Step.__call__

    def call(self, *a, **k):
        with record_function("ragged::step"):
            return step_call(self, *a, **k)

    _step.Step.__call__ = call
    try:
        yield
    finally:
        for attr, orig in saved.items():
            setattr(_step._Run, attr, orig)
        _step.Step.__call__ = step_call
