"""Peak RSS rise per rank during ``fsdp.init`` from an FSDP2 checkpoint (weights and AdamW state),
against the state it creates.

FSDP2 (``fully_shard`` every block and the root of the example GPT, fp32, ``torch.optim.AdamW``)
takes one step on ``--save-world-size`` gloo ranks and saves ``{"model": ..., "optimizer": ...}``
with ``dcp.save``. Then each of ``--world-size`` gloo ranks builds the model on ``meta``, makes the
units, resets its peak RSS (``/proc/self/clear_refs`` 5), runs ``fsdp.init(units,
rg.checkpoint.fsdp2(dir), rg.optim.adamw(...), comm, module=model)`` and reads ``VmHWM``: rise =
peak - RSS before. The state is its shards plus both moments; the bound is 1.2 x state + 64 MiB.

Run:  OMP_NUM_THREADS=1 python3 bench/fsdp2_load.py [--save-world-size 2] [--world-size 4] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._measure import reset_peak_rss, rss  # noqa: E402

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _config(args):
    from ragged.examples.gpt import GPTConfig

    return GPTConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=8, ffn_dim=args.ffn,
                     max_seq_len=64)


def _init(rank, w, port):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=w)


def _save(rank, w, port, args, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from ragged.examples.gpt import GPT

    _init(rank, w, port)
    torch.manual_seed(0)
    model = GPT(_config(args))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x = torch.randint(0, args.vocab, (1, 64))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()


def _load(rank, w, port, args, path, queue):
    import torch.distributed as dist

    import ragged as rg
    from ragged import fsdp
    from ragged.examples.gpt import GPT

    _init(rank, w, port)
    try:
        comm = rg.collectives.from_torch()
        with torch.device("meta"):
            model = GPT(_config(args))
        units = fsdp.make_units(model, world_size=w)
        ckpt = rg.checkpoint.fsdp2(path)
        dist.barrier()
        reset_peak_rss()
        before, t0 = rss()["VmRSS"], time.perf_counter()
        state = fsdp.init(units, ckpt, rg.optim.adamw(1e-3, weight_decay=0.01), comm, module=model)
        seconds, peak = time.perf_counter() - t0, rss()["VmHWM"]
        nbytes = lambda d: d.data.numel() * d.data.element_size() + d.replicated.numel() * d.replicated.element_size()  # noqa: E731
        shards = sum(nbytes(d) for d in state.shards.values())
        moments = sum(nbytes(d) for m in (state.opt_state[0].mu, state.opt_state[0].nu) for d in m.values())
        queue.put((rank, peak - before, shards, moments, seconds))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # the parent waits for every rank: report instead of hanging it
        queue.put((rank, exc.__class__.__name__ + ": " + str(exc)))
        raise


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save-world-size", type=int, default=2)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="fsdp2-load-")
    path = os.path.join(root, "ckpt")
    try:
        mp.spawn(_save, args=(args.save_world_size, 29700 + os.getpid() % 200, args, path), nprocs=args.save_world_size)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = 29900 + os.getpid() % 90
        procs = [ctx.Process(target=_load, args=(r, args.world_size, port, args, path, queue)) for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        rows = sorted(queue.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join()
        failed = [r for r in rows if len(r) == 2]
        if failed:
            raise SystemExit(f"fsdp.init failed: {failed}")
        files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        params = sum(sh for _, _, sh, _, _ in rows) // 4
        print(f"FSDP2 checkpoint (ragged shards: {params / 1e6:.1f}M fp32 elements in all) with AdamW state ({files / 2**20:.0f} MiB) "
              f"saved at W={args.save_world_size}, loaded at W={args.world_size}")
        print("| rank | peak RSS rise during fsdp.init | shards | moments | bound 1.2 x (shards + moments) + 64 MiB "
              "| within | init time |")
        print("|---|---|---|---|---|---|---|")
        mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
        for rank, rise, shards, moments, seconds in rows:
            bound = 1.2 * (shards + moments) + (64 << 20)
            print(f"| {rank} | {mib(rise)} | {mib(shards)} | {mib(moments)} | {mib(bound)} | "
                  f"{'yes' if rise <= bound else 'no'} | {seconds:.1f} s |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
