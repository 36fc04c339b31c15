"""gather / reduce_scatter vs raw collectives of the same bytes vs FSDP2's copy-in/copy-out.

One GPT block's parameters (fp32; hidden h, ffn f: qkv, proj, w1, w2, w3, two norms) are laid
out by ``rg.make_plan`` and moved, in the same processes and the same run, by:

all-gather
  * ``rg.gather``                 ragged (default path on gloo: p2p batch_isend_irecv, leaves are views)
  * ``raw all_gather_single``    the native op on a flat buffer of the same m*S elements
  * ``raw p2p``                    the fastest raw path we know (batch_isend_irecv into the output)
  * ``raw all_to_all_single``     all-gather through all_to_all (needs the input replicated m times)
  * ``FSDP2-style``               per-param Shard(0) chunks (dim 0 padded to a multiple of m):
                                  copy-in of every param's shard into one send buffer,
                                  all_gather_single, then ``split_with_sizes_copy`` copy-out
                                  into per-param full tensors (what FSDP2 does)
reduce-scatter
  * ``rg.reduce_scatter (flat)``  gradient already in the plan's flat layout: no copy
  * ``rg.reduce_scatter (tree)``  a pytree of full gradients: one packing copy-in
  * ``raw reduce_scatter_single`` native op on the same m*S elements
  * ``raw all_to_all + sum``      the fastest raw path (all_to_all_single then local sum)
  * ``FSDP2-style``               ``torch._chunk_cat`` copy-in to rank-major + reduce_scatter_single

``rg.gather (fresh buffer)`` allocates its output each call, as does ``raw p2p, fresh output
buffer``: the pair shows what first touch of fresh memory costs (see the Note "reusing gather
buffers" in ragged/transforms/_gather.py); the "fastest raw" reference reuses its buffers, so
the like-for-like comparison is ``rg.gather (out= reused buffer)``.

Each iteration runs every method once (interleaved, so machine noise hits all alike) in a fresh
random order (seeded, the same on every rank): a rotating order keeps each method's neighbour
fixed, and a method that follows one using the same 12-49 MB buffers runs on a warm cache (two
copies of the raw reduce-scatter differed by 3.5% under rotation, by 0.2% in random order), a
barrier before each; the time of an iteration is the max over ranks. Reported: the median over
iterations and its ratio to the fastest raw path (smallest median, reused buffers) of the same
collective; the "paired ratio", the median over iterations of (this method's time / the
reference's time in the same iteration), which cancels the slow load drifts of a shared
machine, with a bootstrap 95% confidence interval of that median; and the min.

The per-call agreement (issue 16): ``rg.gather`` / ``rg.reduce_scatter`` run on the default
comm (``handshake="header"``: every call sends each peer a 4 KiB header and agrees before
the data moves) and on ``bench/_raw.RawCollectives`` (the same verbs over the fastest raw paths,
no per-call check, ``plan_check="first_use"`` only), side by side in every iteration. The table "cost of the
per-call agreement" gives, per W and block, the paired ratio header / raw with its 95% CI
and the median paired difference in ms per call (what the agreement adds). A last table
times the explicit plan-agreement round alone (``plan_check="every_call"``).

Run:  OMP_NUM_THREADS=1 python3 bench/collectives.py [--world-sizes 2 4] [--hidden 512 1024] [--iters 9] [--pairs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._launch import _free_port, launch  # noqa: E402


def block_params(h, f, dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return {
        "attn_norm": r(h), "qkv": r(3 * h, h), "proj": r(h, h),
        "mlp_norm": r(h), "w1": r(f, h), "w3": r(f, h), "w2": r(h, f),
    }


# --pairs: only what the "within 5% of the fastest raw path" criterion compares, so that many
# more iterations fit in the same time (the confidence interval narrows as 1/sqrt(iters))
_PAIRS = ("rg.gather (out= reused buffer)", "rg.gather (out= reused, no per-call check)", "raw p2p (batch_isend_irecv)",
          "rg.reduce_scatter (flat grad, out= reused)", "rg.reduce_scatter (flat, out= reused, no per-call check)",
          "raw all_to_all + sum")
# (method with the per-call agreement, the same without it): see the table "cost of the per-call agreement"
_AGREEMENT = {"ag": ("rg.gather (out= reused buffer)", "rg.gather (out= reused, no per-call check)"),
              "rs": ("rg.reduce_scatter (flat grad, out= reused)", "rg.reduce_scatter (flat, out= reused, no per-call check)")}


def _worker(rank, m, backend, hiddens, iters, pairs=False):
    import torch
    import torch.distributed as dist

    import ragged as rg
    from ragged import _compat  # torch 2.11's or 2.13's name of the flat all-gather / reduce-scatter
    from bench._raw import RawCollectives

    warnings.filterwarnings("ignore")
    comm = rg.collectives.from_torch()  # the defaults: handshake="header", plan_check="first_use"
    comm_none = RawCollectives()  # no per-call check: the baseline of the agreement's cost
    comm_every = rg.collectives.from_torch(plan_check="every_call")
    rows = []
    started = time.perf_counter()
    for h in hiddens:
        f = int(h * 2.75)
        params = block_params(h, f, torch.float32)
        plan = rg.make_plan(params, world_size=m)
        S = plan.shard_size
        dbuf = rg.shard(plan, params, comm)
        rg.shard(plan, params, comm_none)  # agree the plan on this comm too (first use)
        flat_in = torch.randn(S)
        ag_out = torch.empty(m * S)
        grads = block_params(h, f, torch.float32)
        flat_grad = torch.randn(m * S)
        rs_out = torch.empty(S)
        a2a_tmp = torch.empty(m * S)
        # FSDP2 layout: per-param Shard(0) with dim 0 padded to a multiple of m
        names = sorted(params)
        shard_rows = {n: -(-params[n].shape[0] // m) for n in names}
        inner = {n: params[n][0].numel() if params[n].dim() > 1 else 1 for n in names}
        fs_numel = {n: shard_rows[n] * inner[n] for n in names}
        fs_S = sum(fs_numel.values())
        fs_local = {n: torch.randn(fs_numel[n]) for n in names}
        fs_send = torch.empty(fs_S)
        fs_out = torch.empty(m * fs_S)
        fs_full = {n: torch.empty(m, fs_numel[n]) for n in names}
        fs_grads = {n: torch.randn(m * shard_rows[n], *params[n].shape[1:]) for n in names}
        fs_rs_in = torch.empty(m * fs_S)
        fs_rs_out = torch.empty(fs_S)

        def p2p_ag():
            ops = []
            for j in range(m):
                if j != rank:
                    ops.append(dist.P2POp(dist.isend, flat_in, j))
                    ops.append(dist.P2POp(dist.irecv, ag_out[j * S:(j + 1) * S], j))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            ag_out[rank * S:(rank + 1) * S].copy_(flat_in)

        def p2p_ag_fresh():
            nonlocal ag_out
            keep = ag_out
            ag_out = torch.empty(m * S)
            p2p_ag()
            ag_out = keep

        def a2a_ag():
            a2a_tmp.view(m, S).copy_(flat_in.expand(m, S))
            dist.all_to_all_single(ag_out, a2a_tmp)

        def fsdp2_ag():
            torch.cat([fs_local[n] for n in names], out=fs_send)  # copy-in
            _compat.all_gather_single(fs_out, fs_send)
            torch.split_with_sizes_copy(fs_out.view(m, fs_S), [fs_numel[n] for n in names], dim=1,
                                        out=[fs_full[n] for n in names])  # copy-out

        def a2a_rs():
            dist.all_to_all_single(a2a_tmp, flat_grad)
            chunks = a2a_tmp.view(m, S)
            if m <= 3:  # the fastest local sum on CPU (see ragged/collectives/_torch.py)
                torch.add(chunks[0], chunks[1], out=rs_out)
                for j in range(2, m):
                    rs_out.add_(chunks[j])
            else:
                torch.sum(chunks, 0, out=rs_out)

        def fsdp2_rs():
            torch._chunk_cat([fs_grads[n] for n in names], dim=0, num_chunks=m, out=fs_rs_in.view(m, fs_S))
            _compat.reduce_scatter_single(fs_rs_out, fs_rs_in)

        methods = {
            "ag": {
                "rg.gather (out= reused buffer)": lambda: rg.gather(dbuf, comm, out=ag_out),
                "rg.gather (out= reused, no per-call check)": lambda: rg.gather(dbuf, comm_none, out=ag_out),
                "rg.gather (out= reused, plan_check=every_call)": lambda: rg.gather(dbuf, comm_every, out=ag_out),
                "rg.gather (fresh buffer)": lambda: rg.gather(dbuf, comm),
                "raw all_gather_single": lambda: _compat.all_gather_single(ag_out, flat_in),
                "raw p2p (batch_isend_irecv)": p2p_ag,
                "raw p2p, fresh output buffer": p2p_ag_fresh,
                "raw all_to_all_single": a2a_ag,
                "FSDP2-style (copy-in + AG + copy-out)": fsdp2_ag,
            },
            "rs": {
                "rg.reduce_scatter (flat grad, out= reused)": lambda: rg.reduce_scatter(plan, flat_grad, comm, op="sum", out=rs_out),
                "rg.reduce_scatter (flat, out= reused, no per-call check)": lambda: rg.reduce_scatter(
                    plan, flat_grad, comm_none, op="sum", out=rs_out),
                "rg.reduce_scatter (flat, out= reused, plan_check=every_call)": lambda: rg.reduce_scatter(
                    plan, flat_grad, comm_every, op="sum", out=rs_out),
                "rg.reduce_scatter (flat grad)": lambda: rg.reduce_scatter(plan, flat_grad, comm, op="sum"),
                "rg.reduce_scatter (pytree grads)": lambda: rg.reduce_scatter(plan, grads, comm, op="sum"),
                "raw reduce_scatter_single": lambda: _compat.reduce_scatter_single(rs_out, flat_grad),
                "raw all_to_all + sum": a2a_rs,
                "FSDP2-style (chunk_cat copy-in + RS)": fsdp2_rs,
            },
        }
        for kind, ms in methods.items():
            if pairs:
                ms = {k: v for k, v in ms.items() if k in _PAIRS}
            times = {k: [] for k in ms}
            for _ in range(2):  # warm-up
                for fn in ms.values():
                    dist.barrier(); fn()
            order = list(ms)
            for it in range(iters):
                perm = torch.randperm(len(order), generator=torch.Generator().manual_seed(it)).tolist()
                for name in [order[i] for i in perm]:  # same order on every rank, new each iteration
                    fn = ms[name]
                    dist.barrier()
                    t0 = time.perf_counter(); fn(); dt = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    times[name].append(dt.item())
            for name, ts in times.items():
                rows.append((m, h, plan.buffer_numel * 4 / 2**20, kind, name, [t * 1e3 for t in ts]))
            if rank == 0:  # a long run shows it is alive (a log gets a line per collective and size)
                print(f"progress: W={m} hidden={h} {'all-gather' if kind == 'ag' else 'reduce-scatter'}: "
                      f"{len(ms)} methods x {iters} iterations done, {time.perf_counter() - started:.0f} s", flush=True)
    # the every-call plan agreement alone (see ragged/transforms/_check.py), after a barrier
    from ragged.transforms._check import ranks_agree

    agree = []
    for _ in range(5 * iters):
        dist.barrier()
        t0 = time.perf_counter(); ranks_agree(comm, "bench"); agree.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(agree)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    rows.append((m, None, 0.0, "agree", "plan agreement (all-reduce of 2 int64)", [med.item() * 1e3]))
    return rows if rank == 0 else None


def _overhead(hiddens, reps=2000):
    """Per-call cost of ragged's wrappers beyond the collective: on a 1-rank gloo group the
    collective is one local copy in both paths, so the difference is pure wrapper cost
    (plan check, buffer checks, views, DBuffer). The wrapper's work depends on the number of
    leaves, not their size, so it is measured on the same 7-leaf block at hidden=16 (copies of
    a few KB) where the difference is not drowned by copy noise. Returns {kind: microseconds}."""
    import torch
    import torch.distributed as dist

    import ragged as rg

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    comm = rg.collectives.from_torch()
    res = {}
    for h in (16,):
        params = block_params(h, int(h * 2.75), torch.float32)
        plan = rg.make_plan(params, world_size=1)
        d = rg.shard(plan, params, comm)
        out = torch.empty(plan.buffer_numel)
        g = torch.randn(plan.buffer_numel)
        rs_out = torch.empty(plan.shard_size)
        pairs = {
            "ag": (lambda: rg.gather(d, comm, out=out), lambda: comm.all_gather_into(out, d.data)),
            "rs": (lambda: rg.reduce_scatter(plan, g, comm, op="sum", out=rs_out),
                   lambda: comm.reduce_scatter_into(rs_out, g, op="sum")),
        }
        for kind, (wrapped, raw) in pairs.items():
            diffs = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps // 5):
                    wrapped()
                t1 = time.perf_counter()
                for _ in range(reps // 5):
                    raw()
                t2 = time.perf_counter()
                diffs.append(((t1 - t0) - (t2 - t1)) / (reps // 5))
            res[kind] = statistics.median(diffs) * 1e6
    dist.destroy_process_group()
    return res


def main(argv=None):
    from ragged._console import console as make_console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--pairs", action="store_true",
                    help="only rg gather / reduce_scatter (out= reused) and the fastest raw path: more iterations per minute")
    args = ap.parse_args(argv)
    rows = []
    for m in args.world_sizes:
        print(f"progress: starting {m} gloo ranks (hidden {' '.join(map(str, args.hidden))}, {args.iters} iterations)",
              flush=True)
        rows += launch(m, _worker, args.hidden, args.iters, args.pairs, backend="gloo", timeout=3600)[0]
    table = Table(title="gloo collectives, one GPT block (fp32), median ms (max over ranks)")
    cols = ("W", "hidden", "MB", "collective", "method", "median ms", "GB/s", "vs fastest raw", "paired ratio",
            "95% CI", "min ms")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("collective", "method") else "left")
    agree = {m: ts[0] for m, h, mb, kind, name, ts in rows if kind == "agree"}
    rows = [r for r in rows if r[3] != "agree"]
    ref = {}  # (m, h, kind) -> times of the raw path with the smallest median (reused buffers)
    for m, h, mb, kind, name, ts in rows:
        if name.startswith("raw") and "fresh" not in name:
            key = (m, h, kind)
            if key not in ref or statistics.median(ts) < statistics.median(ref[key]):
                ref[key] = ts
    for m, h, mb, kind, name, ts in rows:
        r = ref[(m, h, kind)]
        med = statistics.median(ts)
        ratios = [a / b for a, b in zip(ts, r)]
        lo, hi = _median_ci(ratios)
        table.add_row(str(m), str(h), f"{mb:.1f}", {"ag": "all-gather", "rs": "reduce-scatter"}[kind], name,
                      f"{med:.1f}", f"{mb / 1024 / (med / 1e3):.2f}", f"{med / statistics.median(r):.2f}x",
                      f"{statistics.median(ratios):.3f}x", f"{lo:.3f}-{hi:.3f}", f"{min(ts):.1f}")
    make_console(min_width=200).print(table)
    t_cost = Table(title="cost of the per-call agreement: handshake='header' (default) vs raw calls (bench/_raw.py), "
                         "same iterations")
    for col in ("W", "hidden", "MB", "collective", "header median ms", "raw median ms", "paired ratio", "95% CI",
                "added ms/call (median paired diff)", "95% CI "):
        t_cost.add_column(col, justify="left" if col == "collective" else "right")
    by_name = {(m, h, kind, name): (mb, ts) for m, h, mb, kind, name, ts in rows}
    for (m, h, kind, name), (mb, ts) in sorted(by_name.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if name != _AGREEMENT[kind][0] or (m, h, kind, _AGREEMENT[kind][1]) not in by_name:
            continue
        base = by_name[(m, h, kind, _AGREEMENT[kind][1])][1]
        ratios = [a / b for a, b in zip(ts, base)]
        diffs = [a - b for a, b in zip(ts, base)]
        lo, hi = _median_ci(ratios)
        dlo, dhi = _median_ci(diffs)
        t_cost.add_row(str(m), str(h), f"{mb:.1f}", {"ag": "all-gather", "rs": "reduce-scatter"}[kind],
                       f"{statistics.median(ts):.2f}", f"{statistics.median(base):.2f}",
                       f"{statistics.median(ratios):.3f}x", f"{lo:.3f}-{hi:.3f}", f"{statistics.median(diffs):+.3f}",
                       f"{dlo:+.3f} to {dhi:+.3f}")
    make_console(min_width=200).print(t_cost)
    print("progress: timing ragged's own per-call cost on a 1-rank group", flush=True)
    over = _overhead(args.hidden)
    t2 = Table(title="ragged wrapper cost per call beyond the collective (7-leaf block, 1-rank gloo group)")
    for col in ("collective", "overhead us/call", "as % of the fastest raw median"):
        t2.add_column(col, justify="right" if col == "overhead us/call" else "left")
    for kind, us in over.items():
        pct = ", ".join(f"W={m} h={h}: {100 * us / 1e3 / statistics.median(r):.2f}%" for (m, h, k), r in sorted(ref.items()) if k == kind)
        t2.add_row({"ag": "gather", "rs": "reduce_scatter (flat grad)"}[kind], f"{us:.0f}", pct)
    make_console(min_width=200).print(t2)
    t3 = Table(title="explicit plan agreement round per transform call (plan_check='every_call'), median after a barrier")
    for col in ("W", "us/call", "as % of the fastest raw median"):
        t3.add_column(col, justify="right" if col != "as % of the fastest raw median" else "left")
    for m, ms in sorted(agree.items()):
        pct = ", ".join(f"{k} h={h}: {100 * ms / statistics.median(r):.2f}%" for (w, h, k), r in sorted(ref.items()) if w == m)
        t3.add_row(str(m), f"{ms * 1e3:.0f}", pct)
    make_console(min_width=200).print(t3)


def _median_ci(xs, level=0.95, resamples=2000):
    """Bootstrap confidence interval of the median of ``xs`` (seeded: the same data give the
    same interval)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = np.asarray(xs, dtype=float)
    meds = np.median(a[rng.integers(0, len(a), size=(resamples, len(a)))], axis=1)
    return tuple(np.quantile(meds, [(1 - level) / 2, (1 + level) / 2]))


if __name__ == "__main__":
    main()
