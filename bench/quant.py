"""Quantized communication, side by side in one run: bytes at the torch.distributed boundary and
step time of ragged's step with an fp32 / bf16 gather and an fp8 / int8 / mxfp8 gather (fp32
compute), an fp8 gather plus an fp8 reduce-scatter, and FSDP2 in bf16; plus a convergence run.

Each repeat runs one step of every method on the same batch (order alternating between repeats),
warm-up excluded; times are the max over ranks; the paired ratio of a method is the median over
repeats of its time / the fp32 gather's time in the same repeat. Bytes: every ProcessGroup call
(``bench/_counts.py``), the full buffer of each collective, rank 0, one step; ragged runs over
NCCL's transport (native collectives, so each call is counted as its kind; ``--header``: gloo's
default, whose point-to-point messages count as send / recv).

Formats: fp8 in 128 x 128 tiles (DeepSeek-V3's), int8 in 32 x 32 tiles, MXFP8 in 1 x 32 blocks;
each quantized method plans its matrices with the format's blocks (``spec.Blocks(r, c)``) and
quantizes every tensor the block tiles (the rest, vectors and e.g. an 8-row MoE router, travels in
fp32 in the same collective).

Usage (CPU, gloo)::

    python3 bench/quant.py --model dense moe --world 2 4                 # the table (a few minutes per cell)
    python3 bench/quant.py --model tiny tiny-moe --world 2 --repeats 2   # smoke test
    python3 bench/quant.py --convergence --steps 300                     # the example GPT: fp32 vs fp8 + fp8 RS
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

METHODS = ("fp32", "bf16", "fp8", "int8", "mxfp8", "fp8+rs", "fsdp2-bf16")


def formats(fp8_block=(128, 128)):
    import ragged as rg

    return {"fp8": rg.quant.fp8(block=fp8_block), "int8": rg.quant.int8(block=(32, 32)), "mxfp8": rg.quant.mxfp8(block=32)}


def tiles(fmt):
    """``leaf -> fmt | None``: the format for every tensor its blocks tile."""
    from ragged.quant._codec import fits_shape

    return lambda leaf: fmt if len(leaf.shape) >= 2 and fits_shape(tuple(leaf.shape), fmt) else None


def specs_for(fmt):
    """The format's blocks as the plan's granule for every matrix whose rows they divide."""
    from ragged import spec

    r, c = fmt.block
    return lambda name, t: spec.Blocks(r, c) if t.dim() >= 2 and t.shape[-2] % r == 0 else None


def build(name, cfg, comm, *, device, lr, fp8_block=(128, 128)):
    from bench._methods import FSDP2Method, RaggedMethod

    kw = dict(seed=0, device=device, lr=lr)
    if name == "fsdp2-bf16":
        return FSDP2Method(cfg, policy="bf16", **kw)
    if name in ("fp32", "bf16"):
        return RaggedMethod(cfg, comm=comm, policy=name, **kw)
    fmt = formats(fp8_block)[name.split("+")[0]]
    return RaggedMethod(cfg, comm=comm, policy="fp32", specs=specs_for(fmt), gather_format=tiles(fmt),
                        reduce_format=tiles(fmt) if name.endswith("+rs") else None, **kw)


def _bench(rank, world, backend, opts):
    import ragged as rg
    from ragged.examples.data import SyntheticLM, rank_slice

    from bench._counts import CommCounter
    from bench._launch import device_for
    from bench._measure import Timer
    from bench.step import model_config

    device = device_for(backend, rank)
    cfg = model_config(opts["cfg"])
    comm = rg.collectives.from_torch(**opts["transport"])
    counter = CommCounter()
    for name in opts["methods"]:
        counter.install_torch(name)
    methods = {n: build(n, cfg, comm, device=device, lr=opts["lr"]) for n in opts["methods"]}
    task = SyntheticLM(opts["cfg"]["vocab_size"], opts["cfg"]["max_seq_len"], seed=0)
    timer, names = Timer(device), list(methods)
    times, losses, comm_bytes = {n: [] for n in names}, {n: [] for n in names}, {}
    for r in range(opts["warmup"] + opts["repeats"]):
        x, y = rank_slice(task.batch(r, opts["batch"] * world), rank, world)
        counter.reset()
        for name in names if r % 2 == 0 else names[::-1]:
            counter.active = name
            dt, loss = timer(lambda: methods[name].step((x.to(device), y.to(device))))
            counter.active = None
            losses[name].append(float(loss))
            if r >= opts["warmup"]:
                times[name].append(dt)
        comm_bytes = {n: counter.per(n) for n in names}
    return dict(times=times, losses=losses, comm=comm_bytes)


def _convergence(rank, world, backend, opts):
    """Every method trains the same model on the same batches for ``steps`` steps: the losses."""
    import ragged as rg
    from ragged.examples.data import SyntheticLM, rank_slice

    from bench._launch import device_for
    from bench.step import model_config

    device = device_for(backend, rank)
    comm = rg.collectives.from_torch()
    cfg = model_config(opts["cfg"])
    methods = {n: build(n, cfg, comm, device=device, lr=opts["lr"], fp8_block=opts["fp8_block"]) for n in opts["methods"]}
    task = SyntheticLM(opts["cfg"]["vocab_size"], opts["cfg"]["max_seq_len"], seed=0)
    losses = {n: [] for n in methods}
    for s in range(opts["steps"]):
        x, y = rank_slice(task.batch(s, opts["batch"] * world), rank, world)
        for name, m in methods.items():
            losses[name].append(float(m.step((x.to(device), y.to(device)))))
    return losses


def summarize(model, world, results) -> dict:
    from bench._measure import paired

    r0 = results[0]
    out = {"model": model, "world": world, "methods": {}}
    for name, t in r0["times"].items():
        out["methods"][name] = dict(median_s=statistics.median(t), times=t, comm=r0["comm"][name],
                                    vs_fp32=paired(t, r0["times"]["fp32"]) if "fp32" in r0["times"] else None,
                                    final_loss=r0["losses"][name][-1])
    return out


def markdown(summary) -> str:
    ms = summary["methods"]
    base = ms.get("fp32", {}).get("comm", {})
    n = len(next(iter(ms.values()))["times"])
    lines = [f"{summary['model']} GPT, W={summary['world']}: one step (median of {n} alternating repeats); bytes at the "
             "torch.distributed boundary, rank 0, one step", "",
             "| method | step ms | paired / fp32 | all-gather MiB | reduce-scatter MiB | all-to-all MiB | "
             "gathered / fp32's | reduced / fp32's |", "|---|---|---|---|---|---|---|---|"]
    for name, m in ms.items():
        c = m["comm"]
        ag, rs, a2a = c.get("all_gather", 0), c.get("reduce_scatter", 0), c.get("all_to_all", 0)
        g_ratio = f"{ag / base['all_gather']:.4f}" if base.get("all_gather") else "-"
        r_ratio = f"{(rs + a2a) / base['reduce_scatter']:.4f}" if base.get("reduce_scatter") else "-"
        paired = "-" if m["vs_fp32"] is None else f"{m['vs_fp32']:.3f}"
        lines.append(f"| {name} | {m['median_s'] * 1e3:,.0f} | {paired} | {ag / 2**20:,.2f} | {rs / 2**20:,.2f} | "
                     f"{a2a / 2**20:,.2f} | {g_ratio} | {r_ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from bench._launch import launch
    from bench.step import CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["dense"], choices=sorted(CONFIGS))
    ap.add_argument("--world", nargs="+", type=int, default=[2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--convergence", action="store_true", help="the example GPT trained by fp32 and fp8+rs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--header", action="store_true",
                    help="ragged over gloo's default transport (data point to point, counted as send / recv); "
                         "default: NCCL's (native collectives, each counted as its kind)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.convergence:
        from ragged.examples._train_args import build_parser

        d = build_parser().parse_args([])  # the example GPT of `python -m ragged train`: its defaults
        cfg = dict(vocab_size=d.vocab, dim=d.dim, num_layers=d.layers, num_heads=d.heads, ffn_dim=d.ffn,
                   max_seq_len=d.seq)
        # its MLP (352) is no multiple of 128: 32 x 32 fp8 tiles quantize every matrix of it
        opts = dict(cfg=cfg, methods=["fp32", "fp8+rs"], steps=args.steps, batch=args.batch, lr=args.lr,
                    fp8_block=(32, 32))
        losses = launch(args.world[0], _convergence, opts, backend=args.backend)[0]
        final = {n: statistics.mean(v[-10:]) for n, v in losses.items()}
        result = {"convergence": dict(world=args.world[0], steps=args.steps, cfg=cfg, fp8_block=[32, 32], losses=losses,
                                      final_mean10=final, rel_diff=final["fp8+rs"] / final["fp32"] - 1)}
        print(f"convergence over {args.steps} steps at W={args.world[0]}: final loss (mean of the last 10) fp32 "
              f"{final['fp32']:.4f}, fp8 gather + fp8 reduce-scatter {final['fp8+rs']:.4f} "
              f"({result['convergence']['rel_diff']:+.2%})")
    else:
        result = {"cells": [], "transport": "header" if args.header else "deferred"}
        for model in args.model:
            for world in args.world:
                opts = dict(cfg=CONFIGS[model], methods=args.methods, repeats=args.repeats, warmup=args.warmup,
                            batch=args.batch, lr=args.lr, transport={} if args.header else {"handshake": "deferred"})
                summary = summarize(model, world, launch(world, _bench, opts, backend=args.backend))
                result["cells"].append(summary)
                print(markdown(summary), "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
