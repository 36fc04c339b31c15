"""``bench/predict.py --time``: ``lowered.estimate_time`` against the measured gloo step.

One run (every number the prediction uses is measured in it, none at the W it predicts); every
configuration is measured alone, in its own processes, at W = 1 and at each W:

* W = 1 (one process): the configuration's step, timed in pieces: each block's forward (module hooks
  while the loss runs; the recomputation of checkpointed blocks in backward is not forward), the loss
  (whole forward; "rest" = the loss minus the blocks: embedding, head, cross entropy), the optimizer
  update, the step, and the comm's all-gathers and reduce-scatters (at W = 1 local copies standing in
  for the collectives the Link prices at W) by the block, loss or backward they ran in, which leave
  the compute pieces: backward = step - forward - update - the copies in backward;
* W = 2, 4 (gloo): once per W, the alpha-beta calibration of ragged's own collectives
  (``comm.all_gather_into`` and ``comm.reduce_scatter_into``, the calls the step makes, per-call agreement
  included) at a few sizes, with the CPU seconds each call takes (its share of the wall time:
  ``cpu_share``); then each configuration's step (barrier, then the step; max over ranks), the median
  over repeats;
* the prediction: the same configuration built on ``rg.collectives.abstract(W)`` over a ``meta`` model,
  lowered with the W=1 run's learnt schedule, ``estimate_time(Link(alpha, bandwidth), compute=per-unit
  forward, backward_factor=backward / forward, optimizer_seconds=update / W)``, three ways: the
  collectives overlapping compute (the default), not at all (``overlap=False``), and holding the
  compute's core for their CPU share (``overlap=1 - cpu_share``: the CPU transport's model).

Why alone: with all eight configurations built in one process (their states resident, each idle while
the seven others step) some were measured slower than the same configuration beside one or two others:
the compute of 120m's "2 micro-batches" taken from its W=1 pieces was 5.06 s at W = 2 among eight, 3.96 s
beside "default" alone (predicted +36.7% vs +9.6%); moe's "2 blocks per unit" stepped 1.80 s at W = 2
among eight, 1.59 s beside two others (-22.8% vs -6.8%).

The machine (a 2-core machine shared with other jobs): a rank computes at the share of a core it gets,
which the other jobs and the W ranks themselves decide. So every repeat, at W = 1 and at W, first runs
a fixed compute probe (a 512 x 1408 x 512 matmul, 10 times) on every rank at once (max over ranks), and
the W=1 compute of a configuration is scaled by ``probe at W / probe at W=1`` of its two launches
(medians over repeats; a machine calibration measured in the same run, like alpha and beta). Measured
CPU seconds per step (the process's, max over ranks) are shown beside: wall >> CPU says the rank waited
(for a core or the network).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

# name -> (make_step / make_units options); one model, eight configurations
SETTINGS = {
    "default": {},
    "no prefetch": dict(prefetch=False),
    "no reshard after forward": dict(reshard_after_forward=False),
    "bf16 compute": dict(policy="bf16"),
    "checkpointing": dict(checkpoint=True),
    "2 blocks per unit": dict(pair_blocks=True),
    "2 micro-batches": dict(micro_batches=2),
    "bf16 + checkpointing": dict(policy="bf16", checkpoint=True),
}


def _prefix(cfg) -> str:
    """The name of the model's blocks, less their index (ragged's default units are the blocks)."""
    return "model.layers." if "hf" in cfg else "blocks."


def _pairs(prefix: str, path: str) -> str:
    """The unit of parameter ``path`` with two blocks per unit."""
    return f"{prefix}{int(path[len(prefix):].split('.')[0]) // 2}" if path.startswith(prefix) else "rest"


def runs_on(cfg, name: str) -> bool:
    """Whether configuration ``name`` runs on the model (the HF loss of bench/_methods.py has no checkpointing)."""
    return not ("hf" in cfg and SETTINGS[name].get("checkpoint"))


def _build(cfg, comm, world, opts, *, meta=False, clock=None):
    """The step of one configuration (``clock``: a dict the timed loss / optimizer / block hooks fill)."""
    import functools

    import ragged as rg
    from ragged import fsdp

    from bench._methods import _blocks, build_model, dtypes, ragged_loss
    from bench.step import meta_model, model_config

    model = meta_model(cfg) if meta else build_model(model_config(cfg), 0, torch.device("cpu"))
    groups = functools.partial(_pairs, _prefix(cfg)) if opts.get("pair_blocks") else None
    units = fsdp.make_units(model, world_size=world, groups=groups)
    opt = rg.optim.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, donate=True)
    loss = ragged_loss(model_config(cfg), model, opts.get("checkpoint", False))
    if clock is not None:
        blocks = {f"{_prefix(cfg)}{i}": b for i, b in enumerate(_blocks(model_config(cfg), model))}
        opt, loss = _timed(blocks, opt, loss, comm, clock)
    compute, reduce = dtypes(opts.get("policy", "fp32"))
    step = fsdp.make_step(units, loss, opt, comm, donate=True, prefetch=opts.get("prefetch", True),
                          micro_batches=opts.get("micro_batches", 1),
                          reshard_after_forward=opts.get("reshard_after_forward", True),
                          policy=fsdp.MixedPrecision(compute_dtype=compute, reduce_dtype=reduce))
    return model, units, opt, step


def _timed(blocks, opt, loss, comm, clock):
    """The optimizer and loss wrapped to record their seconds; each block's forward by hooks while the
    loss runs; ``comm``'s all-gathers and reduce-scatters (at W = 1 a local copy standing in for the
    collective that the Link prices at W) by where they ran: ``collective`` in all,
    ``collective:<block>`` inside a block's forward, ``collective:loss`` inside the loss."""
    state = {"in_loss": False, "t0": {}, "block": None}

    def add(key, seconds):
        clock[key] = clock.get(key, 0.0) + seconds

    def pre(mod, args, name):
        if state["in_loss"]:
            state["t0"][name] = time.perf_counter()
            state["block"] = name

    def post(mod, args, out, name):
        if state["in_loss"] and name in state["t0"]:
            add(name, time.perf_counter() - state["t0"].pop(name))
            state["block"] = None

    for name, block in blocks.items():
        block.register_forward_pre_hook(lambda m, a, n=name: pre(m, a, n))
        block.register_forward_hook(lambda m, a, o, n=name: post(m, a, o, n))

    def collective(call):
        def timed_call(*a, **k):
            t0 = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                add("collective", dt)
                if state["in_loss"]:
                    add("collective:loss", dt)
                if state["block"] is not None:
                    add(f"collective:{state['block']}", dt)
        return timed_call

    for name in ("all_gather_into", "all_gather_into_coalesced", "reduce_scatter_into", "reduce_scatter_into_coalesced"):
        setattr(comm, name, collective(getattr(comm, name)))

    def timed_loss(params, batch):
        state["in_loss"] = True
        t0 = time.perf_counter()
        try:
            return loss(params, batch)
        finally:
            state["in_loss"] = False
            add("loss", time.perf_counter() - t0)

    def update(grads, st, params=None):
        t0 = time.perf_counter()
        out = opt.update(grads, st, params)
        add("update", time.perf_counter() - t0)
        return out

    return opt._replace(update=update), timed_loss


def _calibrate(comm, world, sizes_mib, iters):
    """``{kind: [(full buffer bytes, seconds, CPU seconds)]}`` of ragged's collectives: medians over
    calls of the max over ranks; CPU seconds are the process's (gloo's threads and the kernel's socket
    copies included), the part of the call that takes a core."""
    import torch.distributed as dist

    out = {"all_gather": [], "reduce_scatter": []}
    for mib in sizes_mib:
        n = (mib * 2**20 // 4) // world * world
        full, shard = torch.randn(n), torch.randn(n // world)
        calls = {"all_gather": lambda: comm.all_gather_into(full, shard),
                 "reduce_scatter": lambda: comm.reduce_scatter_into(shard, full, op="sum")}
        for kind, fn in calls.items():
            ts, cs = [], []
            for it in range(iters + 1):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if it:
                    ts.append(dt[0].item())
                    cs.append(dt[1].item())
            out[kind].append((n * 4, statistics.median(ts), statistics.median(cs)))
    return out


def _probe(a=torch.ones(512, 1408), b=torch.ones(1408, 512)) -> float:
    """Seconds of a fixed compute kernel on this rank (after a barrier: every rank at once)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def worker(rank, world, backend, opts):
    """Every configuration's step timed at ``world`` (W=1: in pieces, and the learnt schedules)."""
    import torch.distributed as dist

    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import SyntheticLM, rank_slice

    cfg = opts["cfg"]
    comm = rg.collectives.from_torch()
    calib = _calibrate(comm, world, opts["sizes_mib"], opts["iters"]) if opts.get("calibrate") else None
    task = SyntheticLM(cfg["vocab_size"], cfg["max_seq_len"], seed=0)
    runs, clocks = {}, {}
    for name in opts["settings"]:
        clocks[name] = {}
        timed = world == 1  # its own comm: _timed wraps the comm's collectives with this configuration's clock
        own = rg.collectives.from_torch() if timed else comm
        model, units, opt, step = _build(cfg, own, world, SETTINGS[name], clock=clocks[name] if timed else None)
        runs[name] = [step, fsdp.init(units, model, opt, own)]
    names = list(runs)
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    pieces = {n: [] for n in names}
    probes = []
    for r in range(opts["warmup"] + opts["repeats"]):
        x, y = rank_slice(task.batch(r, opts["batch"] * world), rank, world)
        probes.append(_probe())
        for name in names if r % 2 == 0 else names[::-1]:
            step, state = runs[name]
            clocks[name].clear()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            runs[name][1], _ = step(state, (x, y))
            dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r >= opts["warmup"]:
                times[name].append(dt[0].item())
                cpu[name].append(dt[1].item())
                pieces[name].append(dict(clocks[name], step=dt[0].item()))
    if rank:
        return None
    out = dict(calib=calib, times=times, cpu=cpu, probe=statistics.median(probes[opts["warmup"]:]))
    if world == 1:
        out["pieces"] = {n: {k: statistics.median(p[k] for p in ps) for k in ps[0]} for n, ps in pieces.items()}
        out["schedules"] = {n: runs[n][0].value_and_grad.memo.schedule for n in names}
    return out


def fit(points, world):
    """Least squares ``seconds = alpha + (W - 1) / W * bytes / bandwidth`` through ``(bytes, seconds, ...)``,
    in relative error (the sizes span three decades)."""
    import numpy as np

    x = np.array([(world - 1) / world * b for b, *_ in points], dtype=float)
    y = np.array([s for _, s, *_ in points], dtype=float)
    slope, alpha = np.polyfit(x, y, 1, w=1 / y)  # relative residuals: the 1 MiB points set alpha, not noise at 128 MiB
    return float(alpha), float(1 / slope)


def predict(cfg, name, world, pieces, schedule, link, *, share, overlap):
    """``estimate_time`` of configuration ``name`` at ``world`` from the W=1 pieces, their compute
    times ``share`` (the slowdown of a rank's compute at W; see the module's docstring)."""
    import ragged as rg

    _, units, _, step = _build(cfg, rg.collectives.abstract(world), world, SETTINGS[name], meta=True)
    lowered = step.lower(schedule=schedule)
    names = [lay.name for lay in lowered.layouts]
    entries = {u: lowered.schedule.forward.count(i) for i, u in enumerate(names)}
    blocks = [f"{_prefix(cfg)}{i}" for i in range(cfg["num_layers"])]
    unit_of = {b: (_pairs(_prefix(cfg), b) if SETTINGS[name].get("pair_blocks") else b) for b in blocks}
    # compute = the W=1 pieces less the W=1 collectives' local copies in them (the Link prices the collectives at W)
    own = {b: pieces[b] - pieces.get(f"collective:{b}", 0.0) for b in unit_of}
    forward = pieces["loss"] - pieces.get("collective:loss", 0.0)
    fwd = {u: 0.0 for u in names}
    for block, u in unit_of.items():
        fwd[u] += own[block]
    fwd["rest"] += forward - sum(own.values())
    compute = {u: share * s / max(1, entries[u]) / step.micro_batches for u, s in fwd.items()}  # per entry, micro-batch
    backward = pieces["step"] - pieces["loss"] - pieces["update"] - (pieces.get("collective", 0.0)
                                                                     - pieces.get("collective:loss", 0.0))
    t = lowered.estimate_time(link, compute=compute, backward_factor=backward / forward,
                              optimizer_seconds=share * pieces["update"] / world, overlap=overlap)
    return t


def cpu_share(points) -> float:
    """The share of the collectives' wall time their CPU work takes, over ``(bytes, seconds, CPU
    seconds)`` points (time-weighted): on a CPU transport that part holds the compute's core, the
    rest (waiting for the peers) can run beside compute (``estimate_time(overlap=1 - share)``)."""
    return min(1.0, sum(c for *_, c in points) / sum(s for _, s, _ in points))


def kendall_tau(a, b) -> float:
    """Kendall's tau-a of two equally long sequences (ties count 0); NaN under two elements (no pair)."""
    n, s = len(a), 0
    if n < 2:
        return float("nan")
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return 2 * s / (n * (n - 1))


MODELS = ("overlap", "no overlap", "CPU share held")  # estimate_time(overlap=True / False / 1 - cpu_share)


def run(model, worlds, settings, *, repeats, warmup, batch, sizes_mib, iters) -> dict:
    """Measures and predicts one model; returns plain values (``--json``; :func:`markdown` renders them)."""
    from bench._launch import launch
    from bench.step import CONFIGS
    from ragged.predict import Link

    cfg = CONFIGS[model]
    skipped = [n for n in settings if not runs_on(cfg, n)]
    settings = [n for n in settings if runs_on(cfg, n)]
    opts = dict(cfg=cfg, settings=settings, repeats=repeats, warmup=warmup, batch=batch, sizes_mib=sizes_mib,
                iters=iters)

    def alone(world, name):  # one configuration in its own processes (see the module's docstring)
        return launch(world, worker, dict(opts, settings=[name]), backend="gloo", timeout=3600)[0]

    one = {name: alone(1, name) for name in settings}
    for name in settings:
        print(f"{model} {name} W=1 pieces (median s): {one[name]['pieces'][name]}; probe "
              f"{one[name]['probe'] * 1e3:.1f} ms", flush=True)
    out = dict(model=model, cores=len(os.sched_getaffinity(0)), skipped=skipped, links=[], rows=[])
    for world in worlds:
        calib = launch(world, worker, dict(opts, settings=[], calibrate=True), backend="gloo", timeout=3600)[0]["calib"]
        both = calib["all_gather"] + calib["reduce_scatter"]
        for kind, pts in [*calib.items(), ("both", both)]:
            out["links"].append(dict(world=world, kind=kind, fit=fit(pts, world), cpu_share=cpu_share(pts), points=pts))
        link, held = Link(*fit(both, world)), cpu_share(both)
        probes = []
        for name in settings:
            res = alone(world, name)
            probes.append((res["probe"], one[name]["probe"]))
            args = (cfg, name, world, one[name]["pieces"][name], one[name]["schedules"][name], link)
            t = [predict(*args, share=res["probe"] / one[name]["probe"], overlap=o) for o in (True, False, 1.0 - held)]
            out["rows"].append(dict(configuration=name, world=world, measured=res["times"][name],
                                    cpu=statistics.median(res["cpu"][name]), predicted=[x.seconds for x in t],
                                    compute=t[1].parts["compute"], comm=sum(t[1].parts["comm"].values())))
        out["links"].append(dict(world=world, kind="probe", probe=statistics.median(p for p, _ in probes),
                                 probe_w1=statistics.median(q for _, q in probes)))
    return out


def markdown(result: dict) -> list[str]:
    """The three tables of one model's ``run``: the calibration, prediction vs measurement, the rankings."""
    model = result["model"]
    calib = ["| W | collective | alpha ms | bandwidth GB/s | CPU share | points (MiB: ms) |", "|---|---|---|---|---|---|"]
    for c in result["links"]:
        if c["kind"] == "probe":
            calib.append(f"| {c['world']} | compute probe: {c['probe'] * 1e3:.1f} ms at W vs {c['probe_w1'] * 1e3:.1f} ms "
                         f"at W=1: compute x {c['probe'] / c['probe_w1']:.2f} | | | | |")
            continue
        (a, bw), name = c["fit"], "both (the Link used)" if c["kind"] == "both" else c["kind"]
        calib.append(f"| {c['world']} | {name} | {a * 1e3:.2f} | {bw / 1e9:.2f} | {c['cpu_share']:.2f} | "
                     + ", ".join(f"{b / 2**20:.0f}: {s * 1e3:.1f}" for b, s, _ in c["points"]) + " |")
    table = ["| model | configuration | W | measured s (median, min-max) | "
             + " | ".join(f"predicted s ({m}) | err" for m in MODELS)
             + " | compute s (pred) | comm s (pred, busy) | measured CPU s/step |", "|" + "---|" * 13]
    ranking = {}
    for r in result["rows"]:
        med = statistics.median(r["measured"])
        ranking.setdefault(r["world"], []).append((r["configuration"], r["predicted"], med))
        table.append(f"| {model} | {r['configuration']} | {r['world']} | {med:.3f} ({min(r['measured']):.3f}-"
                     f"{max(r['measured']):.3f}) | "
                     + " | ".join(f"{p:.3f} | {(p - med) / med:+.1%}" for p in r["predicted"])
                     + f" | {r['compute']:.3f} | {r['comm']:.3f} | {r['cpu']:.3f} |")
    tau = ["| W | " + " | ".join(f"Kendall tau ({m})" for m in MODELS) + " | cells within 15% ("
           + " / ".join(MODELS) + ") | measured order (fastest first) |", "|---|---|---|---|---|---|"]
    for world, rows in ranking.items():
        meas = [r[2] for r in rows]
        order = " < ".join(r[0] for r in sorted(rows, key=lambda r: r[2]))
        within = [sum(abs(r[1][k] - r[2]) <= 0.15 * r[2] for r in rows) for k in range(len(MODELS))]
        tau.append(f"| {world} | " + " | ".join(f"{kendall_tau([r[1][k] for r in rows], meas):.2f}"
                                                for k in range(len(MODELS)))
                   + " | " + " / ".join(f"{w}/{len(rows)}" for w in within) + f" | {order} |")
    notes = [f"{model}: not run (no activation checkpointing in its loss): {', '.join(result['skipped'])}"] \
        if result["skipped"] else []
    return notes + ["\n".join(calib), "\n".join(table), "\n".join(tau)]
