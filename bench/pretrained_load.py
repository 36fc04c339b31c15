"""Peak RSS rise per rank during ``fsdp.init`` from a Hugging Face directory (each rank reads its
own byte ranges), against the state it creates; optionally ``fsdp.save_pretrained`` of that state.

The model: a random-init Llama (transformers ``from_config``) saved by ``save_pretrained`` in bf16,
about 346M parameters at the defaults (hidden 1024, ffn 2816, 24 layers, vocab 32000). Each of W
gloo ranks builds the model on ``meta``, makes the units (fp32 master), resets its peak RSS
(``/proc/self/clear_refs`` 5), runs ``fsdp.init(units, rg.checkpoint.pretrained(dir),
rg.optim.adamw(...), comm)`` and reads ``VmHWM``: rise = peak - RSS before. The state is the bytes
of its shards + optimizer state tensors; the bound is 1.2 x state + 64 MiB.

``--rank0`` then measures, in the same processes, the peers' rank-0 load (rank 0 ``from_pretrained``
(fp32), each unit broadcast from it and sharded by every rank), and ``--compare`` transformers'
own ``from_pretrained`` (fp32) on every rank followed by ``fsdp.init(units, model, ...)``.

Run:  OMP_NUM_THREADS=1 python3 bench/pretrained_load.py [--world-size 4] [--layers 24] [--save] [--rank0] [--compare]
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


def _config(args):
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.ffn,
                                    num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                                    max_position_embeddings=2048)


def _worker(rank, world, port, path, args, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    import ctypes
    import gc

    import torch
    import torch.distributed as dist
    import transformers

    import ragged as rg
    from ragged import fsdp, transforms

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = rg.collectives.from_torch()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(args))
    units = fsdp.make_units(model, world_size=world, dtype=torch.float32)
    weights = rg.checkpoint.pretrained(path)

    def measured(fn):
        """``(fn(), peak RSS rise, seconds)``, from memory given back to the OS (so a later phase's rise
        is its own, not the reuse of what an earlier one freed)."""
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        comm.all_reduce(torch.zeros(1))
        before = rss()["VmRSS"]
        reset_peak_rss()  # VmHWM := VmRSS
        t0 = time.perf_counter()
        result = fn()
        return result, rss()["VmHWM"] - before, time.perf_counter() - t0

    state, rise, seconds = measured(lambda: fsdp.init(units, weights, rg.optim.adamw(1e-4), comm))
    shard_bytes = sum(d.data.nbytes + d.replicated.nbytes for d in state.shards.values())
    opt_bytes = sum(t.nbytes for t in rg.pytree.leaves(state.opt_state) if isinstance(t, torch.Tensor))
    row = {"rank": rank, "rise": rise, "shards": shard_bytes, "opt": opt_bytes, "seconds": seconds,
           "params": sum(u.plan.numel + u.plan.replicated_numel for u in units)}
    if args.save:
        target = os.path.join(os.path.dirname(path), "saved")
        _, row["save_rise"], row["save_seconds"] = measured(
            lambda: fsdp.save_pretrained(units, state.shards, comm, target, dtype=torch.bfloat16))
    by_rank = {n: d.data.clone() for n, d in state.shards.items()}  # to check the rank-0 load, not measured
    del state

    def rank0_load():  # the peers' way: rank 0 loads the whole model, broadcasts each unit, every rank shards it
        shapes = {n: p.shape for n, p in model.named_parameters()}
        full = (dict(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
                if rank == 0 else None)
        shards = {}
        for u in units:
            tensors = {n: full[n].detach() if rank == 0 else torch.empty(shapes[n]) for n in u.paths}
            for t in tensors.values():
                dist.broadcast(t, 0)
            shards[u.name] = transforms.shard(u.plan, tensors, comm)
        opt = rg.optim.adamw(1e-4)
        return fsdp.TrainState(shards, opt.init(shards))

    def transformers_load():  # transformers' own load on every rank, then fsdp.init from the module
        full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return fsdp.init(fsdp.make_units(full, world_size=world), full, rg.optim.adamw(1e-4), comm)

    if args.rank0:
        state, row["rank0_rise"], row["rank0_seconds"] = measured(rank0_load)
        assert all(torch.equal(by_rank[n], d.data) for n, d in state.shards.items()), "rank-0 load != by-rank load"
        del state
    del by_rank
    if args.compare:
        state, row["hf_rise"], row["hf_seconds"] = measured(transformers_load)
        del state
    out.put(row)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--save", action="store_true", help="also time fsdp.save_pretrained (bf16) of the loaded state")
    p.add_argument("--compare", action="store_true",
                   help="also: transformers' from_pretrained (fp32) on every rank + fsdp.init(units, model)")
    p.add_argument("--rank0", action="store_true",
                   help="also: rank 0 loads the whole model (from_pretrained, fp32) and broadcasts each unit, which every "
                        "rank shards (the rank-0 load of FSDP1's sync_module_states / FSDP2's broadcast_from_rank0)")
    p.add_argument("--keep", default=None, help="directory to write the model into (kept); default: a temporary one")
    args = p.parse_args(argv)

    import socket

    import torch
    import torch.multiprocessing as mp
    import transformers

    root = args.keep or tempfile.mkdtemp(prefix="ragged-pretrained-")
    path = os.path.join(root, "model")
    try:
        if not os.path.exists(os.path.join(path, "config.json")):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(_config(args), dtype=torch.bfloat16)
            model.save_pretrained(path, max_shard_size="200MB")
            del model
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, path, args, out))
                 for r in range(args.world_size)]
        for pr in procs:
            pr.start()
        rows = sorted((out.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for pr in procs:
            pr.join()
        mib = 1 << 20
        print(f"model: {rows[0]['params'] / 1e6:.1f}M parameters, bf16, {len(files)} files, {size / mib:.0f} MiB; "
              f"W={args.world_size}, fp32 master, rg.optim.adamw")
        print("| rank | peak RSS rise during fsdp.init | shards | optimizer state | bound 1.2 x (shards + opt) + 64 MiB "
              "| within | init time |" + (" save_pretrained RSS rise | save time |" if args.save else ""))
        print("|---|---|---|---|---|---|---|" + ("---|---|" if args.save else ""))
        for r in rows:
            bound = 1.2 * (r["shards"] + r["opt"]) + 64 * mib
            line = (f"| {r['rank']} | {r['rise'] / mib:.0f} MiB | {r['shards'] / mib:.0f} MiB | {r['opt'] / mib:.0f} MiB "
                    f"| {bound / mib:.0f} MiB | {'yes' if r['rise'] <= bound else 'NO'} | {r['seconds']:.1f} s |")
            if args.save:
                line += f" {r['save_rise'] / mib:.0f} MiB | {r['save_seconds']:.1f} s |"
            print(line)
        if args.rank0 or args.compare:
            print("\n| rank | by rank: peak RSS rise | time |" + (" rank-0 load + broadcast: peak RSS rise | time |" if args.rank0
                  else "") + (" from_pretrained + fsdp.init: peak RSS rise | time |" if args.compare else ""))
            print("|---|---|---|" + "---|---|" * (args.rank0 + args.compare))
            for r in rows:
                print(f"| {r['rank']} | {r['rise'] / mib:.0f} MiB | {r['seconds']:.1f} s |"
                      + (f" {r['rank0_rise'] / mib:.0f} MiB | {r['rank0_seconds']:.1f} s |" if args.rank0 else "")
                      + (f" {r['hf_rise'] / mib:.0f} MiB | {r['hf_seconds']:.1f} s |" if args.compare else ""))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
