"""What the step benchmark measures, and how (all in the benchmark process, nothing in ragged).

* Step time: ``barrier``; ``perf_counter`` around the step (CUDA: synchronize); the max over ranks
  (:class:`Timer`). Every benchmark times through this module: :func:`interleaved` runs the
  compared methods once per repeat, alternating their order, warm-up excluded (:func:`wall` on
  one process, ``Timer(device).seconds`` across ranks); :func:`paired` and :func:`median_ci` give
  the paired ratio (median over repeats of a / b in the same repeat: steadier on a shared
  machine than a ratio of medians) and its seeded bootstrap confidence interval.
* Allocated tensor bytes (CPU has no allocator statistics in torch 2.13): the bytes of the
  tensors the method keeps between steps (:func:`storage_bytes`, unique storages: parameter
  shards, optimizer state, gradients), plus the largest rise of allocated bytes during one
  step, from the allocation / free events of torch's profiler (``profile_memory=True``; the
  raw kineto events, every CPU allocation made by a thread that torch's profiler follows:
  the main and autograd threads; gloo's own threads allocate nothing for the paths used
  here, since both FSDP2 and ragged hand gloo preallocated outputs). On CUDA:
  ``torch.cuda.max_memory_allocated``.
* Live bytes from a method's construction on (:class:`LiveBytes`, ``bench/memory.py``): the
  same allocator events, summed from the moment the profiler starts (before the method
  exists), so the live bytes at any moment are everything the method allocated and has not
  freed -- state, caches and buffers it keeps outside its state included -- and the peak of a
  window is absolute, not a rise. On CUDA: ``torch.cuda.memory_allocated`` /
  ``max_memory_allocated`` / ``max_memory_reserved`` (the caching allocator's reserve).
* CPU time and minor page faults of the rank's process during each step (:func:`process_work`,
  ``getrusage``: every thread, gloo's included): the work behind the wall time, steadier than
  it on a loaded machine; minor faults count first touches of freshly mapped memory.
* RSS: ``/proc/self/status`` VmHWM after resetting it (``/proc/self/clear_refs`` 5) right
  before the step, minus VmRSS before the step: how much resident memory the step adds.
  Both methods live in one process, so absolute RSS is not split between them.
* Bytes communicated: ``bench/_counts.py`` (``CommCounter``).
* Copies and where time goes: one extra profiled step per method; host time in labelled
  ranges (FSDP2's own ``record_function`` labels, and labels this module adds around
  ragged's step internals) and in copy ops.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import os
import random
import re
import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["storage_bytes", "rss", "reset_peak_rss", "profile_step", "ragged_labels", "Timer", "LiveBytes",
           "wall", "interleaved", "paired", "median_ci", "process_work"]


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


def process_work() -> tuple[float, int, float]:
    """``(CPU seconds, minor page faults, CPU seconds on gloo's threads)`` this process has used so
    far, every thread included (gloo's and autograd's): the work a step does, which a loaded
    machine's time-slicing does not inflate the way it inflates wall time. Minor faults count first
    touches of fresh pages. gloo's threads (``gloo_tcp_loop``: the TCP transport's send and receive;
    ``pt_gloo_runloop``: the native collectives' own copies and reductions) are summed from
    ``/proc/self/task`` (Linux; 0.0 elsewhere): the host work of moving the bytes, which on a GPU
    NCCL's kernels do on the device."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt, _gloo_thread_seconds()


def _gloo_thread_seconds() -> float:
    """CPU seconds of this process's gloo threads: ``schedstat``'s nanoseconds on the CPU (``stat``'s
    clock ticks, 10 ms, where the kernel keeps no schedstat); 0.0 off Linux."""
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if "gloo" not in f.read():
                    continue
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
            except OSError:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except OSError:  # the thread ended meanwhile
            continue
    return total


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux ``clear_refs`` 5); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Timer:
    """Wall time of a step, synchronised across ranks (the max over ranks)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        """``(seconds, fn())``."""
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

    def seconds(self, fn) -> float:
        return self(fn)[0]


def wall(fn) -> float:
    """Seconds one call of ``fn()`` takes on this process."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: dict, repeats: int, *, warmup: int = 1, timer=wall) -> dict[str, list[float]]:
    """Times every function of ``fns`` once per repeat, in the given order on even repeats and
    reversed on odd ones, after ``warmup`` untimed rounds. ``timer(fn) -> seconds`` (default
    :func:`wall`; ``Timer(device).seconds`` across ranks). A function that returns a generator is
    timed per phase: each ``yield phase`` closes one segment, kept as ``f"{name} {phase}"``.

    Returns:
        ``{name: [seconds of each timed repeat]}``.

    Examples:
        >>> from bench._measure import interleaved
        >>> def two_phases():
        ...     yield "forward"
        ...     yield "backward"
        >>> sorted(interleaved({"a": lambda: None, "b": two_phases}, 3))
        ['a', 'b backward', 'b forward']
        >>> len(interleaved({"a": lambda: None}, 3)["a"])
        3
    """
    names = list(fns)
    times: dict[str, list[float]] = {}
    keys: dict[str, list[str]] = {name: [] for name in names}  # per method, its keys in order
    for r in range(warmup + repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            phases = {}

            def run(name=name):
                out = fns[name]()
                if hasattr(out, "__next__"):
                    t0 = time.perf_counter()
                    for phase in out:
                        t1 = time.perf_counter()
                        phases[f"{name} {phase}"] = t1 - t0
                        t0 = t1

            dt = timer(run)
            if r >= warmup:
                for key, value in (phases or {name: dt}).items():
                    if key not in times:
                        keys[name].append(key)
                    times.setdefault(key, []).append(value)
    return {key: times[key] for name in names for key in keys[name]}


def paired(ta, tb) -> float:
    """Median over repeats of ``ta[i] / tb[i]`` (both timed in the same repeat)."""
    return statistics.median(x / y for x, y in zip(ta, tb))


def median_ci(xs, level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """Bootstrap confidence interval of the median of ``xs`` (seeded: the same data give the same
    interval; a single value gives itself).

    Examples:
        >>> from bench._measure import median_ci
        >>> median_ci([1.0, 1.0, 1.0])
        (1.0, 1.0)
    """
    rnd = random.Random(0)
    xs = list(xs)
    meds = sorted(statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(resamples))
    lo = meds[int((1 - level) / 2 * resamples)]
    hi = meds[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return lo, hi


_FQN = re.compile(r" \(.*\)$|\s*for .*$")
COPY_OPS = ("fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")


def _norm(name: str) -> str:
    return _FQN.sub("", name)


def _label(name: str) -> str | None:
    if name.startswith(("FSDP::", "ragged::", "Optimizer.step", "bench::")):
        return _norm(name)
    return None


def profile_step(fn, *, device: torch.device):
    """Runs ``fn()`` once under torch's profiler.

    Returns:
        ``(peak_rise_bytes, ranges_ms, copies_ms, peak_where, reserved_rise_bytes)``: the largest rise of
        allocated CPU bytes during the call (CUDA: of ``max_memory_allocated`` over the start); the *exclusive*
        host time of every labelled range (``FSDP::...`` / ``ragged::...`` / optimizer step,
        summed by label with the module fqn stripped; time in nested labelled ranges is
        subtracted); and the host time of copy / reduction ops, keyed ``"op @ label"`` by the
        innermost labelled range they run in; and where the memory peak was reached (CPU: the
        innermost labelled ranges and op running at that moment); CUDA only (else ``None``): how
        much the caching allocator's reserve rose during the call, from a reserve emptied of cached
        blocks first (``empty_cache``), so a method is not credited with blocks another one freed.
    """
    from torch.profiler import ProfilerActivity, profile

    peak_where, reserved = "", None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        reserved = torch.cuda.max_memory_reserved() - base_reserved
    else:
        kevents = prof.profiler.kineto_results.events()
        events = sorted((e.start_ns(), e.nbytes()) for e in kevents if e.name() == "[memory]")
        cur = peak = 0
        peak_ns = None
        for ts, n in events:
            cur += n
            if cur > peak:
                peak, peak_ns = cur, ts
        if peak_ns is not None:
            peak_where = _running_at(kevents, peak_ns)
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
    return peak, dict(ranges), dict(copies), peak_where, reserved


def _site(chain: tuple) -> str:
    """A short name for where an allocation was made: its labelled ranges (the window, then the
    innermost other label) and its outermost and innermost op."""
    labels = [c for c in chain if _label(c)]
    ops = [c for c in chain if not _label(c)]
    keep = labels[:1] + [lab for lab in labels[1:][-1:]] + (ops[:1] + ops[-1:] if len(ops) > 1 else ops)
    return " > ".join(_norm(c) for c in keep) or "(outside any op)"


def _running_at(kevents, ns: int) -> str:
    """Which labelled ranges (innermost two) and op were running at ``ns`` (kineto events)."""
    inside = [e for e in kevents if e.name() != "[memory]" and e.start_ns() <= ns <= e.end_ns()]
    labels = sorted((e for e in inside if _label(e.name())), key=lambda e: e.start_ns())
    ops = sorted((e for e in inside if not _label(e.name())), key=lambda e: e.start_ns())
    ops = [ops[0], ops[-1]] if len(ops) > 1 else ops  # outermost (e.g. an autograd node) and innermost op
    return " > ".join([_label(e.name()) for e in labels[-2:]] + [e.name() for e in ops])


class LiveBytes:
    """Live tensor bytes of this process over named windows (see the module docstring).

    Use as a context manager around everything a method does (from its construction on), and
    mark windows with :meth:`window`; after the ``with`` block :meth:`result` gives, per window,
    the live bytes at its start and end and its peak (CPU: where the peak was reached).

    Examples:
        >>> import torch
        >>> from bench._measure import LiveBytes
        >>> with LiveBytes(torch.device("cpu")) as live:
        ...     keep = torch.zeros(1000)
        ...     with live.window("step"):
        ...         tmp = torch.ones(3000); del tmp
        >>> r = live.result("step")
        >>> r["start"], r["peak"], r["end"]
        (4000, 16000, 4000)
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._windows: dict[str, dict] = {}
        self._prof = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self._prof is not None:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self._parse()
        return False

    @contextlib.contextmanager
    def window(self, name: str):
        """Marks a window (CUDA: resets the peak statistics at its start)."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated() - self._base
            yield
            torch.cuda.synchronize()
            self._windows[name] = dict(start=start, peak=torch.cuda.max_memory_allocated() - self._base,
                                       end=torch.cuda.memory_allocated() - self._base,
                                       reserved_peak=torch.cuda.max_memory_reserved(), where="")
            return
        from torch.profiler import record_function

        with record_function(f"bench::{name}"):
            yield

    def _parse(self):
        """Every allocation / free (with its address and the ops and labels it ran under), from
        the profiler's event tree; the running total; each window's start, peak and end."""
        allocs, windows = [], {}

        def walk(node, chain):
            ef = node.extra_fields
            if type(ef).__name__ == "_ExtraFields_Allocation":
                if ef.device.type == "cpu":
                    allocs.append((node.start_time_ns, ef.ptr, ef.alloc_size, chain))
                return
            if node.name.startswith("bench::"):
                windows[node.name[len("bench::"):]] = (node.start_time_ns, node.end_time_ns)
            for child in node.children:
                walk(child, chain + (node.name,))

        for root in self._prof.profiler.kineto_results.experimental_event_tree():
            walk(root, ())
        allocs.sort(key=lambda a: a[0])
        self._allocs = allocs
        times = [a[0] for a in allocs]
        live, run = [], 0
        for a in allocs:
            run += a[2]
            live.append(run)
        for name, (t0, t1) in windows.items():
            lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
            start = live[lo - 1] if lo else 0
            seg = live[lo:hi]
            peak = max(seg + [start])
            at = lo + seg.index(peak) if seg and peak > start else lo - 1
            self._windows[name] = dict(start=start, peak=peak, end=live[hi - 1] if hi else 0, peak_index=at,
                                       where=_site(allocs[at][3]) if at >= 0 else "")

    def live_at_peak(self, name: str, top: int = 10) -> list[tuple[int, int, str]]:
        """CPU: what is live when window ``name`` peaks: ``(bytes, count, allocated in)`` per
        allocation site (the window, labelled ranges and ops it was allocated under), largest first."""
        upto = self._windows[name]["peak_index"]
        alive: dict[int, tuple[int, tuple]] = {}
        for _, ptr, size, chain in self._allocs[: upto + 1]:
            if size > 0:
                alive[ptr] = (size, chain)
            else:
                alive.pop(ptr, None)
        sites: dict[str, list[int]] = {}
        for size, chain in alive.values():
            slot = sites.setdefault(_site(chain), [0, 0])
            slot[0] += size
            slot[1] += 1
        return sorted(((b, n, site) for site, (b, n) in sites.items()), reverse=True)[:top]

    def result(self, name: str) -> dict:
        """``{"start", "peak", "end", "where"}`` bytes of window ``name`` (CUDA: and ``"reserved_peak"``)."""
        return self._windows[name]


_COPYISH = ("aten::copy_", "aten::cat", "aten::sum", "aten::_chunk_cat", "aten::split_with_sizes_copy", "aten::zero_",
            "aten::fill_", "aten::masked_fill_")


@contextlib.contextmanager
def ragged_labels():
    """Adds ``record_function`` labels around ragged's FSDP step internals (bench only)."""
    from torch.profiler import record_function

    from ragged.fsdp import _grad, _reducing, _runtime, _step

    targets = {
        (_runtime.Run, "_gather_unit_start"): "ragged::all_gather_start",
        (_runtime.Run, "_wait"): "ragged::all_gather_wait",
        (_runtime.Run, "grad_ready"): "ragged::grad_copy_in",
        (_reducing.Gradients, "reduce"): "ragged::reduce_scatter_start",
        (_reducing.Gradients, "finish_oldest"): "ragged::reduce_scatter_wait+sum",
        (_grad, "check_plans"): "ragged::agree_start",  # the start-of-call agreement (and the ranks' wait for each other)
        (_grad, "_agree"): "ragged::agree_end",
    }
    saved = {}
    for (cls, attr), label in targets.items():
        orig = getattr(cls, attr)
        saved[cls, attr] = orig

        def wrapped(*a, _orig=orig, _label=label, **k):
            with record_function(_label):
                return _orig(*a, **k)

        setattr(cls, attr, wrapped)
    step_call = _step.Step.__call__

    def call(self, *a, **k):
        with record_function("ragged::step"):
            return step_call(self, *a, **k)

    _step.Step.__call__ = call
    try:
        yield
    finally:
        for (cls, attr), orig in saved.items():
            setattr(cls, attr, orig)
        _step.Step.__call__ = step_call
