"""The per-call cost of the flat all-gather / reduce-scatter at W=1 (NCCL on one GPU, gloo on a CPU).

For a few buffer sizes, the median time of the raw collective (``ragged._compat``'s
``all_gather_single`` / ``reduce_scatter_single``: torch 2.13's names, 2.11's before) and of
``rg.gather`` / ``rg.reduce_scatter`` on the same bytes, one JSON line per (collective, size)
with ``--json``. At W=1 ``rg.gather`` / ``rg.reduce_scatter`` issue no collective (one local
copy): their column is ragged's per-call wrapper plus that copy.

What one GPU can calibrate: the fixed cost of one collective call (launch, NCCL's bookkeeping,
ragged's wrapper on top) and the on-device copy a W=1 collective is. What it cannot: anything
that crosses a link. At W=1 NCCL moves no byte between GPUs, so no bandwidth or latency of
NVLink, PCIe or the network comes out of it; those need W>=2 on one host (NVLink) and on two
hosts (the network).

    python3 bench/calibrate.py [--sizes-mib 1 16 256] [--iters 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._launch import launch  # noqa: E402


def _worker(rank, m, backend, sizes_mib, iters):
    import torch

    import ragged as rg
    from ragged import _compat

    cuda = backend == "nccl"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    comm = rg.collectives.from_torch()

    def timed(fn):
        ts = []
        for i in range(iters + 2):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:  # two warm-up calls
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    rows = []
    for mib in sizes_mib:
        n = mib * 2**20 // 4
        params = {"w": torch.randn(n, device=dev)}
        plan = rg.make_plan(params, world_size=m)
        d = rg.shard(plan, params, comm)
        out = torch.empty(plan.buffer_numel, device=dev)
        grad = torch.randn(plan.buffer_numel, device=dev)
        rs_out = torch.empty(plan.shard_size, device=dev)
        cases = {
            "all_gather": (lambda: _compat.all_gather_single(out, d.data), lambda: rg.gather(d, comm, out=out)),
            "reduce_scatter": (lambda: _compat.reduce_scatter_single(rs_out, grad),
                               lambda: rg.reduce_scatter(plan, grad, comm, op="sum", out=rs_out)),
        }
        for kind, (raw, wrapped) in cases.items():
            rows.append({"backend": backend, "world": m, "collective": kind, "mib": mib, "device": str(dev),
                         "torch": torch.__version__, "raw_us": timed(raw), "ragged_us": timed(wrapped)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", default=None, help="gloo or nccl (default: nccl iff a GPU is visible)")
    ap.add_argument("--json", default=None, help="append one line per (collective, size) to this file")
    args = ap.parse_args(argv)
    rows = launch(1, _worker, args.sizes_mib, args.iters, backend=args.backend, timeout=600)[0]
    print("| backend | collective | MiB | raw us | ragged us | raw GB/s (bytes/time) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} W={r['world']} | {r['collective']} | {r['mib']} | {r['raw_us']:.0f} | "
              f"{r['ragged_us']:.0f} | {r['mib'] * 2**20 / (r['raw_us'] * 1e3):.1f} |")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
