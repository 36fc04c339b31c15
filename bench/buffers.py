"""What one more buffer per unit costs: gather and reduce_scatter of the same bytes in 1, 2, 4, 8
buffers, side by side on gloo ranks (the constant of the planner's cost model,
``ragged/spec/_buffers.py`` [Note: the buffer cost model]).

A tree of 8 equal fp32 matrices (the unit) is planned once and split with
``rg.testing.with_buffers`` into K buffers of whole leaves (K = 1, 2, 4, 8: the same elements,
padding zero in every case). Every iteration runs ``rg.gather(out=...)`` and a flat-gradient
``rg.reduce_scatter(out=...)`` of every K in a fresh seeded random order; time = max over ranks.
Reported per K: median ms, the paired ratio to K=1 (median over iterations, bootstrap 95% CI),
and the extra time per extra buffer, also as bytes: ``(t_K - t_1) / (K - 1)`` times the K=1
effective bandwidth (gathered bytes / t_1), i.e. how much padding one extra buffer is worth.

Usage::

    python3 bench/buffers.py                          # W=2 and 4, 1 MB and 12 MB units
    python3 bench/buffers.py --world-sizes 2 --mb 12 --iters 61
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

COUNTS = (1, 2, 4, 8)


def _plans(m: int, mb: float):
    import ragged as rg

    cols = 512
    rows = max(m, int(mb * 2**20 / 4 / 8 / cols) // m * m)  # 8 leaves, rows divisible by m: no padding
    params = {f"w{i}": torch.empty(rows, cols, device="meta") for i in range(8)}
    one = rg.make_plan(params, world_size=m)
    paths = [l.path for l in one.leaves]
    return {k: rg.testing.with_buffers(one, [paths[i::k] for i in range(k)]) for k in COUNTS}


def _bench(rank, world, backend, opts):
    import torch.distributed as dist

    import ragged as rg

    comm = rg.collectives.from_torch()
    plans = _plans(world, opts["mb"])
    state = {}
    for k, plan in plans.items():
        d = rg.DBuffer(data=torch.randn(plan.shard_size), replicated=torch.zeros(0), plan=plan, rank=rank)
        state[k] = (d, torch.empty(plan.buffer_numel), torch.randn(plan.buffer_numel), torch.empty(plan.shard_size))
    ops = {}
    for k, (d, out, g, rs_out) in state.items():
        ops[("gather", k)] = lambda d=d, out=out: rg.gather(d, comm, out=out)
        ops[("reduce_scatter", k)] = lambda p=plans[k], g=g, o=rs_out: rg.reduce_scatter(p, g, comm, op="sum", out=o)
    for fn in ops.values():  # warm-up (and the plan check)
        fn()
    times = {key: [] for key in ops}
    rnd = random.Random(1)
    keys = list(ops)
    for _ in range(opts["iters"]):
        rnd.shuffle(keys)
        for key in keys:
            dist.barrier()
            t0 = time.perf_counter()
            ops[key]()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[key].append(float(dt))
    return {"times": times, "bytes": plans[1].buffer_numel * 4}


def _ci(ratios, n=2000):
    rnd = random.Random(0)
    meds = sorted(statistics.median(rnd.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n)]


def main(argv=None) -> int:
    from ragged._console import console as make_console
    from rich.table import Table

    from bench._launch import launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=float, nargs="+", default=[1.0, 12.0], help="unit size in MB (fp32)")
    ap.add_argument("--iters", type=int, default=41)
    args = ap.parse_args(argv)
    table = Table(title="one unit in K buffers (same bytes, one coalesced launch): gloo, time = max over ranks, "
                        f"median of {args.iters} (random order per iteration)", title_justify="left")
    for col in ("W", "MB", "collective", "K", "ms", "paired / K=1 [95% CI]", "extra per buffer", "worth (bytes)"):
        table.add_column(col, justify="right")
    for m in args.world_sizes:
        for mb in args.mb:
            res = launch(m, _bench, dict(mb=mb, iters=args.iters))[0]
            times, nbytes = res["times"], res["bytes"]
            for op in ("gather", "reduce_scatter"):
                base = times[(op, 1)]
                t1 = statistics.median(base)
                for k in COUNTS:
                    t = times[(op, k)]
                    ratios = [a / b for a, b in zip(t, base)]
                    lo, hi = _ci(ratios)
                    extra = (statistics.median(t) - t1) / (k - 1) if k > 1 else None
                    table.add_row(str(m), f"{nbytes / 1e6:.1f}", op, str(k), f"{statistics.median(t) * 1e3:.2f}",
                                  f"{statistics.median(ratios):.3f}x [{lo:.3f}-{hi:.3f}]",
                                  "" if extra is None else f"{extra * 1e6:+.0f} us",
                                  "" if extra is None else f"{extra * nbytes / t1 / 1e3:+,.0f} kB")
    make_console(min_width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
