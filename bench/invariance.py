"""What the same numbers at every world size cost: ``fsdp.make_step(..., chunks=C)`` against the
default step at the same world size and micro-batches, side by side in one run; and the choice
of its reduction (a fixed tree over the ranks, against sums in exact integers).

* ``step``: the GPT of ``bench/step.py`` (``--model dense``, ``moe``), AdamW with global-norm
  clipping, ``--micro-batches`` M per rank: **default** (``micro_batches=M``, each rank its
  contiguous rows) and **chunked** (``chunks=M * W``, each rank its ``fsdp.local_chunks``), the
  same global batch. Each repeat runs one step of each on the same batch, the order alternating;
  warm-up excluded; times are the max over ranks (``bench/_measure.py``); the paired ratio is the
  median over repeats of chunked / default with a bootstrap 95% interval. Memory: one profiled step
  of each (the largest rise of allocated CPU bytes during the step), ``step.lower()``'s peak (no
  activations: the same in both) and the step's ``peak_shard_bytes`` metric (the reduced gradient
  shards alive at once: the accumulation buffers) next to the lowering's prediction of it.
* ``reduction`` (``--reduction``): one unit's flat fp32 gradient (the largest unit of the model)
  reduced over W ranks by gloo's native reduce-scatter, by the chunked step's tree (an all-to-all of
  the same bytes, the owner adding the rows over a fixed tree), and by exact int64 sums (an
  all-reduce of the max, every element cut to 62-bit fixed point under it, an all-to-all of twice
  the bytes, the owner adding integers: associative, so it would serve every W, not only powers of
  two). Interleaved like the steps; paired ratios against the native reduce-scatter.

Usage (CPU, gloo)::

    python3 bench/invariance.py --model dense moe --world 2 4 --reduction   # the tables (~10 minutes quiet)
    python3 bench/invariance.py --model tiny tiny-moe --world 2 --repeats 2  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

METHODS = ("default", "chunked")


def _build(name, cfg, comm, *, device, micro, lr):
    import ragged as rg
    from ragged import fsdp

    from bench._methods import build_model, ragged_loss

    model = build_model(cfg, 0, device)
    units = fsdp.make_units(model, world_size=comm.world_size)
    opt = rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=comm), rg.optim.adamw(lr, weight_decay=0.1))
    state = fsdp.init(units, model, opt, comm)
    kw = dict(chunks=micro * comm.world_size) if name == "chunked" else dict(micro_batches=micro)
    return fsdp.make_step(units, ragged_loss(cfg, model, False), opt, comm, **kw), state


def _steps(rank, world, backend, opts):
    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import SyntheticLM, rank_slice

    from bench._launch import device_for
    from bench._measure import Timer, profile_step
    from bench.step import model_config

    device = device_for(backend, rank)
    cfg, micro = model_config(opts["cfg"]), opts["micro"]
    comm = rg.collectives.from_torch(**opts["transport"])
    built = {n: _build(n, cfg, comm, device=device, micro=micro, lr=opts["lr"]) for n in METHODS}
    states = {n: s for n, (_, s) in built.items()}
    task = SyntheticLM(opts["cfg"]["vocab_size"], opts["cfg"]["max_seq_len"], seed=0)
    timer = Timer(device)
    times, losses, metrics = {n: [] for n in METHODS}, {n: [] for n in METHODS}, {}

    def run(name, batch):
        step = built[name][0]
        rows = fsdp.local_chunks(batch, micro * world, comm) if name == "chunked" else rank_slice(batch, rank, world)
        states[name], metrics[name] = step(states[name], tuple(t.to(device) for t in rows))
        return metrics[name]["loss"]

    for r in range(opts["warmup"] + opts["repeats"]):
        batch = task.batch(r, opts["batch"] * world)
        for name in METHODS if r % 2 == 0 else METHODS[::-1]:
            dt, loss = timer(lambda: run(name, batch))
            losses[name].append(loss)
            if r >= opts["warmup"]:
                times[name].append(dt)
    if opts["profile"]:  # one more step of one method, under the profiler: its memory (see _memory)
        name = opts["profile"]
        return profile_step(lambda: run(name, task.batch(0, opts["batch"] * world)), device=device)[0]
    memory = {}
    for name in METHODS:
        mem = built[name][0].lower().memory_analysis()
        memory[name] = dict(predicted_peak=mem.peak_bytes, predicted_shards=mem.peak_shard_bytes,
                            predicted_shards_low=mem.peak_shard_bytes_low, shards=metrics[name]["peak_shard_bytes"],
                            predicted_scratch=mem.peak_scratch_bytes, state=mem.persistent_bytes)
    return dict(times=times, losses=losses, memory=memory)


def _memory(world, opts, backend) -> dict:
    """The largest rise of allocated bytes during one step of each method (after a warm-up step),
    each method in processes of its own: two steps of a process profiled one after the other
    crashed torch's garbage collection at exit (torch 2.13, CPU)."""
    from bench._launch import launch

    one = dict(opts, repeats=0, warmup=1)
    return {name: max(launch(world, _steps, dict(one, profile=name), backend=backend)) for name in METHODS}


def _fixed_point_start(comm, flat, out):
    """Exact int64 sums: the max agreed, every element to 62-bit fixed point under it (headroom for
    the ranks' sum), an all-to-all of the integers; ``finish()`` adds them and converts back."""
    m, n = comm.world_size, out.numel()
    top = flat.abs().amax().reshape(1).double()
    comm.all_reduce(top, op="max")
    shift = (62 - (m - 1).bit_length()) - torch.frexp(top).exponent.to(torch.float64)
    ints = torch.ldexp(flat.double(), shift).round_().to(torch.int64)
    rows = torch.empty(m * n, dtype=torch.int64)
    comm.all_to_all(rows, ints, [n] * m, [n] * m)
    return lambda: out.copy_(torch.ldexp(rows.view(m, n).sum(0).double(), -shift))


def _reduction(rank, world, backend, opts):
    """One flat gradient of ``numel`` elements reduced by each way (see the module docstring)."""
    import ragged as rg
    from ragged.transforms._flat import _reduce_scatter_flat_start, _tree_reduce_scatter_flat_start

    from bench._measure import Timer

    comm = rg.collectives.from_torch(**opts["transport"])
    plan = rg.make_plan({"g": torch.empty(opts["numel"])}, world_size=world)
    flat = torch.randn(plan.buffer_numel, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(plan.shard_size)
    ways = {
        "native reduce-scatter": lambda: _reduce_scatter_flat_start(plan, out, flat, comm).wait(),
        "tree (all-to-all; the step's from 3 ranks)": lambda: _tree_reduce_scatter_flat_start(plan, out, flat, comm).wait(),
        "exact int64": lambda: _fixed_point_start(comm, flat, out)(),
    }
    timer = Timer(torch.device("cpu"))
    times = {w: [] for w in ways}
    names = list(ways)
    for r in range(opts["warmup"] + opts["repeats"]):
        for name in names if r % 2 == 0 else names[::-1]:
            dt = timer.seconds(ways[name])
            if r >= opts["warmup"]:
                times[name].append(dt)
    return dict(times=times, numel=plan.buffer_numel)


def summarize_steps(model, world, micro, results, rises) -> dict:
    from bench._measure import median_ci

    r0 = results[0]
    t = r0["times"]
    ratios = [c / d for c, d in zip(t["chunked"], t["default"])]
    mem = {n: dict(max((r["memory"][n] for r in results), key=lambda x: x["predicted_peak"]), rise=rises[n])
           for n in METHODS}
    return dict(model=model, world=world, micro_batches=micro, chunks=micro * world, times=t,
                median_s={n: statistics.median(v) for n, v in t.items()}, paired=statistics.median(ratios),
                ci=median_ci(ratios), memory=mem, losses=r0["losses"],
                shard_bytes_predicted=all(r["memory"][n]["predicted_shards_low"] <= r["memory"][n]["shards"]
                                          <= r["memory"][n]["predicted_shards"] for r in results for n in METHODS))


def summarize_reduction(world, results) -> dict:
    from bench._measure import median_ci

    t = results[0]["times"]
    base = t["native reduce-scatter"]
    out = {"world": world, "numel": results[0]["numel"], "ways": {}}
    for name, v in t.items():
        ratios = [a / b for a, b in zip(v, base)]
        out["ways"][name] = dict(median_s=statistics.median(v), paired=statistics.median(ratios), ci=median_ci(ratios))
    return out


def _mib(x) -> str:
    return f"{x / 2**20:,.2f}"


def markdown(result) -> list[str]:
    """The step table and the reduction table."""
    n = len(result["steps"][0]["times"]["default"]) if result["steps"] else 0
    lines = [f"One step each, {n} alternating repeats (median ms, max over ranks); paired = median of chunked / default "
             f"in one repeat [bootstrap 95%]; transport: {result['transport']}", "",
             "| model | W | micro-batches | chunks | default ms | chunked ms | paired | rise default MiB | "
             "rise chunked MiB | predicted peak + MiB | accumulation buffers MiB (within the prediction) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["steps"]:
        m, d, c = s["memory"], s["memory"]["default"], s["memory"]["chunked"]
        exact = "yes" if s["shard_bytes_predicted"] else "NO"
        lines.append(
            f"| {s['model']} | {s['world']} | {s['micro_batches']} | {s['chunks']} | {s['median_s']['default'] * 1e3:,.0f} | "
            f"{s['median_s']['chunked'] * 1e3:,.0f} | {s['paired']:.3f} [{s['ci'][0]:.3f}-{s['ci'][1]:.3f}] | "
            f"{_mib(d['rise'])} | {_mib(c['rise'])} | {_mib(c['predicted_peak'] - d['predicted_peak'])} | "
            f"{_mib(d['shards'])} -> {_mib(c['shards'])} ({exact}) |")
        del m
    tables = ["\n".join(lines)]
    if result.get("reduction"):
        rows = ["One unit's fp32 gradient reduced over W ranks, alternating repeats (median ms, max over ranks); paired = "
                "median of way / native reduce-scatter in one repeat [bootstrap 95%]", "",
                "| W | elements | way | ms | paired |", "|---|---|---|---|---|"]
        for cell in result["reduction"]:
            for name, w in cell["ways"].items():
                rows.append(f"| {cell['world']} | {cell['numel']:,} | {name} | {w['median_s'] * 1e3:,.1f} | "
                            f"{w['paired']:.3f} [{w['ci'][0]:.3f}-{w['ci'][1]:.3f}] |")
        tables.append("\n".join(rows))
    return tables


def main(argv=None) -> int:
    from bench._launch import launch
    from bench.step import CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["dense", "moe"], choices=sorted(CONFIGS))
    ap.add_argument("--world", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--micro-batches", type=int, default=2, help="per rank (the chunked step's chunks: this x W)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank (a multiple of --micro-batches)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--nccl-shaped", action="store_true", help="NCCL's transport (native collectives, deferred "
                    "ledger) instead of gloo's default")
    ap.add_argument("--reduction", action="store_true", help="also time the three reductions of one unit's gradient")
    ap.add_argument("--reduction-only", action="store_true", help="only the reductions (no steps)")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    transport = {"handshake": "deferred"} if args.nccl_shaped else {}
    result = {"transport": "nccl-shaped" if args.nccl_shaped else "gloo-default", "steps": [], "reduction": []}
    for model in [] if args.reduction_only else args.model:
        for world in args.world:
            opts = dict(cfg=CONFIGS[model], micro=args.micro_batches, batch=args.batch, repeats=args.repeats,
                        warmup=args.warmup, lr=args.lr, transport=transport)
            cell = summarize_steps(model, world, args.micro_batches, launch(world, _steps, dict(opts, profile=None),
                                                                            backend=args.backend),
                                   _memory(world, opts, args.backend))
            result["steps"].append(cell)
            print(f"{model} W={world}: chunked / default {cell['paired']:.3f} [{cell['ci'][0]:.3f}-{cell['ci'][1]:.3f}]",
                  flush=True)
    if args.reduction or args.reduction_only:
        from bench.step import meta_model

        from ragged import fsdp

        units = fsdp.make_units(meta_model(CONFIGS[args.model[0]]), world_size=1)
        numel = max(u.plan.numel for u in units)
        for world in args.world:
            opts = dict(numel=numel, repeats=args.repeats, warmup=args.warmup, transport=transport)
            result["reduction"].append(summarize_reduction(world, launch(world, _reduction, opts, backend=args.backend)))
    for table in markdown(result):
        print(table, "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
