"""Checkpoint save / load: ragged (DCP, each rank writes its own pieces) vs gather-to-rank-0 +
torch.save, same processes, same run.

State: AdamW training state of a stack of fp32 matrices (params + two moments = 3x the param
bytes) sharded by ``rg.make_plan`` over W gloo ranks on this machine.

Methods (each iteration runs every method once, interleaved; time = max over ranks, barrier
before and after; median over iterations):

  * ``ragged save``              ``rg.checkpoint.save``: every rank writes only its pieces
                                 (DCP files + manifest with sha256, published by rename)
  * ``ragged load``              ``rg.checkpoint.load`` into the same plan (checksums verified)
  * ``ragged load, no verify``   same with ``verify=False``
  * ``ragged load on W/2 ranks`` reshard: the first W/2 ranks load the W-rank checkpoint
  * ``gather + torch.save``      ``rg.gather`` of params and moments, rank 0 ``torch.save``s
                                 the full dict and fsyncs it (what a non-sharded checkpoint
                                 costs); the baseline of the save rows
  * ``torch.load + shard``       every rank ``torch.load``s the full file and ``rg.shard``s it;
                                 the baseline of the load rows

Run:  OMP_NUM_THREADS=1 python3 bench/checkpoint.py [--world-sizes 2 4] [--mparams 16] [--iters 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _params(mparams: float):
    import torch

    g = torch.Generator().manual_seed(0)
    h = 512
    rows = max(1, int(mparams * 1e6 / h / 4))
    # 4 matrices of uneven row counts + a few vectors: ragged pieces on every rank
    return {
        "emb": torch.randn(rows + 7, h, generator=g),
        "w1": torch.randn(rows - 3, h, generator=g),
        "w2": torch.randn(rows + 1, h, generator=g),
        "head": torch.randn(rows, h, generator=g),
        "norm": torch.randn(h, generator=g),
        "bias": torch.randn(3 * h, generator=g),
    }




def _worker(rank, m, backend, mparams, iters, root):
    import torch
    import torch.distributed as dist

    import ragged as rg

    from bench._measure import Timer

    comm = rg.collectives.from_torch()
    timer = Timer(comm.device)  # the steps run in a fixed order: save before the loads
    params = _params(mparams)
    plan = rg.make_plan(params, world_size=m)
    local = rg.shard(plan, params, comm)
    opt = rg.optim.adamw(1e-3)
    state = {"params": local, "opt": opt.init(local), "step": 0}
    gen = torch.Generator().manual_seed(1)  # same gradients on every rank (as after a reduce)
    g = rg.shard(plan, rg.pytree.map(lambda t: torch.randn(t.shape, generator=gen), params), comm)
    _, state["opt"] = opt.update(g, state["opt"], local)  # non-zero moments
    half = dist.new_group(list(range(max(1, m // 2))))
    half_comm = rg.collectives.from_torch(half) if rank < max(1, m // 2) else None
    half_plan = rg.make_plan(params, world_size=max(1, m // 2))
    times: dict[str, list[float]] = {}
    sizes = {}
    for it in range(iters):
        path = os.path.join(root, f"ckpt{it}")
        full_file = os.path.join(root, f"full{it}.pt")

        def save():
            rg.checkpoint.save(path, state, comm)

        def load(verify=True):
            rg.checkpoint.load(path, state, comm, verify=verify)

        def load_half():
            if half_comm is not None:
                like = {
                    "params": rg.shard(half_plan, params, rank=rank),
                    "opt": opt.init(rg.shard(half_plan, params, rank=rank)),
                    "step": 0,
                }
                rg.checkpoint.load(path, like, half_comm)

        def gather_save():
            full = {
                "params": rg.gather(state["params"], comm),
                "mu": rg.gather(state["opt"][0].mu, comm),
                "nu": rg.gather(state["opt"][0].nu, comm),
                "step": 0,
            }
            if rank == 0:
                with open(full_file, "wb") as f:  # durable, like ragged's save (which fsyncs every file)
                    torch.save(full, f)
                    f.flush()
                    os.fsync(f.fileno())

        def load_shard():
            full = torch.load(full_file, weights_only=True)
            rg.shard(plan, full["params"], rank=rank), rg.shard(plan, full["mu"], rank=rank), rg.shard(plan, full["nu"], rank=rank)

        for name, fn in [
            ("ragged save", save),
            ("ragged load", load),
            ("ragged load, no verify", lambda: load(False)),
            (f"ragged load on {max(1, m // 2)} ranks (reshard)", load_half),
            ("gather + torch.save (rank 0)", gather_save),
            ("torch.load + shard (every rank)", load_shard),
        ]:
            times.setdefault(name, []).append(timer.seconds(fn))  # max over ranks
        if rank == 0:
            sizes["ragged"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            sizes["torch.save"] = os.path.getsize(full_file)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
            os.remove(full_file)
        dist.barrier()
    nbytes = 3 * plan.numel * 4
    return {"times": times, "sizes": sizes, "state_bytes": nbytes, "numel": plan.numel}


def main(argv=None):
    from ragged._console import console as make_console
    from rich.table import Table

    from bench._launch import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mparams", type=float, default=16.0, help="millions of parameters (state is 3x)")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    console = make_console()
    root = tempfile.mkdtemp(prefix="ragged-ckpt-bench-")
    try:
        for m in args.world_sizes:
            results = launch(m, _worker, args.mparams, args.iters, root, backend="gloo")
            r0 = results[0]
            table = Table(
                title=f"checkpoint, W={m}, {r0['numel'] / 1e6:.1f}M params, state {r0['state_bytes'] / 2**20:.0f} MiB "
                f"(params + AdamW mu, nu; fp32), median of {args.iters}, max over ranks"
            )
            for col in ("method", "time (s)", "state MiB/s", "vs baseline"):
                table.add_column(col, justify="right" if col != "method" else "left")
            med = {k: statistics.median(max(r["times"][k][i] for r in results) for i in range(args.iters)) for k in r0["times"]}
            base_save = med["gather + torch.save (rank 0)"]
            base_load = med["torch.load + shard (every rank)"]
            for name, t in med.items():
                base = base_save if "save" in name else base_load
                table.add_row(name, f"{t:.3f}", f"{r0['state_bytes'] / 2**20 / t:.0f}", f"{t / base:.2f}x")
            console.print(table)
            console.print(
                f"bytes on disk: ragged {r0['sizes']['ragged'] / 2**20:.1f} MiB, torch.save {r0['sizes']['torch.save'] / 2**20:.1f} MiB"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
