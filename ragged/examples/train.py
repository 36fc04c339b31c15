"""The main job: train the small GPT with the functional FSDP step.

Run it with ``torchrun --nproc-per-node 2 -m ragged.examples.train`` (gloo on CPU, NCCL when
CUDA is present), or ``python -m ragged train --nproc-per-node 2`` which starts the processes
itself. Rank 0 prints the plan summary, a rich progress bar (loss, tokens/s, memory) and a final
summary; ``--json PATH`` writes the per-step metrics.

Examples:
    >>> from ragged.examples.train import build_parser
    >>> args = build_parser().parse_args(["--steps", "3", "--moe"])
    >>> args.steps, args.moe, args.optimizer
    (3, True, 'adamw')
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import sys
import time

import torch

__all__ = ["build_parser", "configure", "main", "train"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="ragged.examples.train", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("launch")
    g.add_argument("--nproc-per-node", type=int, default=2,
                   help="processes to start when not launched by torchrun (default 2)")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--dim", type=int, default=128)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--ffn", type=int, default=352)
    g.add_argument("--vocab", type=int, default=256)
    g.add_argument("--seq", type=int, default=64)
    g.add_argument("--moe", action="store_true", help="every 2nd block is a top-k MoE with fused experts")
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--top-k", type=int, default=2)
    g.add_argument("--hf", choices=["llama", "mixtral"], default=None,
                   help="a Hugging Face model of these sizes instead (config only, built on meta; ragged.examples.hf)")
    g.add_argument("--save-pretrained", default=None, metavar="DIR",
                   help="with --hf: save_pretrained the trained model here (default: a temporary directory)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300)
    g.add_argument("--batch", type=int, default=32, help="global batch (sequences), split over ranks")
    g.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per rank")
    g.add_argument("--optimizer", choices=["adamw", "adamw_8bit", "muon", "sgd"], default="adamw")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: off)")
    g.add_argument("--compute-dtype", choices=sorted(_DTYPES), default="fp32")
    g.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default=None)
    g.add_argument("--no-prefetch", action="store_true")
    g.add_argument("--no-reshard", action="store_true", help="keep parameters gathered from forward to backward")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward (less memory, one more forward)")
    g.add_argument("--no-donate", action="store_true",
                   help="allocate new shards / optimizer buffers every step instead of updating in place")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write per-step metrics and the summary here (rank 0)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def configure(parser: argparse.ArgumentParser) -> None:
    """Registers the ``train`` subcommand of ``python -m ragged`` (see ``ragged._cli``)."""
    build_parser(parser)
    parser.set_defaults(func=main_from_args)


def _specs_for(optimizer: str):
    if optimizer != "adamw_8bit":
        return None
    from ragged import spec

    def specs(name, t):  # 32x32 quantization blocks that no rank boundary cuts
        if t.dim() >= 2 and t.shape[-1] % 32 == 0 and t.shape[-2] % 32 == 0:
            return spec.Blocks(32, 32)
        return None

    return specs


def _optimizer(args, comm):
    import ragged as rg

    steps = max(args.steps, args.warmup + 1)
    lr = rg.optim.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, steps, end_value=args.lr / 10)
    if args.optimizer == "adamw":
        core = rg.optim.adamw(lr, b2=0.98, weight_decay=args.weight_decay, donate=not args.no_donate)
    elif args.optimizer == "adamw_8bit":
        core = rg.optim.adamw_8bit(lr, b2=0.98, weight_decay=args.weight_decay, donate=not args.no_donate)
    elif args.optimizer == "sgd":
        core = rg.optim.sgd(lr, momentum=0.9)
    else:
        def matrices(leaf):
            return len(leaf.shape) in (2, 3) and "emb" not in leaf.path and "head" not in leaf.path

        core = rg.optim.muon(0.02, comm=comm, weight_decay=args.weight_decay, muon_filter=matrices,
                             adam=rg.optim.adamw(lr, b2=0.98, weight_decay=args.weight_decay))
    if args.clip > 0:
        return rg.optim.chain(rg.optim.clip_by_global_norm(args.clip, comm=comm), core)
    return core


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(args) -> dict:
    """Runs the job in an initialised process group; returns the summary (every rank)."""
    import torch.distributed as dist

    import ragged as rg
    from ragged import fsdp
    from ragged.examples.data import SyntheticLM, rank_slice
    from ragged.examples.gpt import GPT, GPTConfig, loss_fn

    if args.hf:
        from ragged.examples.hf import train as train_hf

        return train_hf(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    comm = rg.collectives.from_torch()
    cfg = GPTConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                    ffn_dim=args.ffn, max_seq_len=args.seq, num_experts=args.experts if args.moe else 0,
                    top_k=args.top_k)
    if args.batch % world or (args.batch // world) % args.micro_batches:
        raise SystemExit(f"--batch {args.batch} must split into {world} ranks x {args.micro_batches} micro-batches.")
    model = GPT(cfg, device=device)
    model.reset_parameters(torch.Generator().manual_seed(args.seed))  # same weights on every rank (drawn on CPU)
    units = fsdp.make_units(model, world_size=world, specs=_specs_for(args.optimizer))
    opt = _optimizer(args, comm)
    state = fsdp.init(units, model, opt, comm)  # the module now holds placeholders: every rank keeps only its shards
    step = fsdp.make_step(units, loss_fn(model, checkpoint=args.activation_checkpointing), opt, comm,
                          micro_batches=args.micro_batches,
                          compute_dtype=_DTYPES[args.compute_dtype],
                          reduce_dtype=_DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                          prefetch=not args.no_prefetch, reshard_after_forward=not args.no_reshard,
                          donate=not args.no_donate)
    task = SyntheticLM(cfg.vocab_size, args.seq, seed=args.seed + 1)
    n_params = sum(u.plan.numel for u in units)
    console = None
    if rank == 0:
        from rich.console import Console

        console = Console(stderr=False)
        console.print(f"[bold]ragged FSDP[/] · {world} ranks ({dist.get_backend()}) · GPT "
                      f"{'MoE ' if args.moe else ''}{n_params / 1e6:.2f}M params · optimizer {args.optimizer} · "
                      f"compute {args.compute_dtype} · micro-batches {args.micro_batches}")
        console.print(units)
        console.print(f"task: Markov(vocab {cfg.vocab_size}, branching {task.branching}) then copy; "
                      f"loss starts near ln(vocab) = {math.log(cfg.vocab_size):.2f}, a perfect model reaches "
                      f"{task.floor:.2f}")

    history, tokens_per_step = [], args.batch * args.seq
    progress = None
    if rank == 0 and not args.quiet:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                            TextColumn("gathered {task.fields[gath]:.1f}/{task.fields[model]:.1f} MB"),
                            TextColumn("rss {task.fields[rss]:.0f} MB"), TimeElapsedColumn(), console=console)
        progress.start()
        bar = progress.add_task("train", total=args.steps, loss=float("nan"), tps=0.0, gath=0.0, model=0.0, rss=0.0)
    t_start = time.perf_counter()
    try:
        for s in range(args.steps):
            batch = rank_slice(task.batch(s, args.batch), rank, world)
            batch = tuple(x.to(device) for x in batch)
            t0 = time.perf_counter()
            state, m = step(state, batch)
            dt = time.perf_counter() - t0
            rec = {"step": s, "loss": m["loss"], "step_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "peak_gathered_bytes": m["peak_gathered_bytes"], "model_bytes": m["model_bytes"],
                   "largest_unit_bytes": m["largest_unit_bytes"], "num_gathers": m["num_gathers"],
                   "rss_mb": _rss_mb()}
            history.append(rec)
            if progress is not None:
                progress.update(bar, advance=1, loss=m["loss"], tps=rec["tokens_per_s"],
                                gath=m["peak_gathered_bytes"] / 2**20, model=m["model_bytes"] / 2**20, rss=rec["rss_mb"])
    finally:
        if progress is not None:
            progress.stop()
    total = time.perf_counter() - t_start
    steady = history[min(3, len(history) - 1):]
    summary = {
        "world_size": world, "backend": dist.get_backend(), "params": n_params, "steps": args.steps,
        "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
        "min_loss": min(h["loss"] for h in history), "ln_vocab": math.log(cfg.vocab_size), "floor": task.floor,
        "median_step_s": sorted(h["step_s"] for h in steady)[len(steady) // 2],
        "tokens_per_s": tokens_per_step * len(history) / total,
        "peak_gathered_bytes": max(h["peak_gathered_bytes"] for h in history),
        "largest_unit_bytes": history[-1]["largest_unit_bytes"], "model_bytes": history[-1]["model_bytes"],
        "max_rss_mb": _rss_mb(), "args": vars(args) | {"func": None},
    }
    if rank == 0:
        from rich.table import Table

        t = Table(title="summary (rank 0)")
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_row("loss: first -> last (min)", f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
                                               f"({summary['min_loss']:.3f})")
        t.add_row("ln(vocab) / task floor", f"{summary['ln_vocab']:.3f} / {summary['floor']:.3f}")
        t.add_row("median step", f"{summary['median_step_s'] * 1e3:.1f} ms")
        t.add_row("tokens/s (whole run)", f"{summary['tokens_per_s']:,.0f}")
        t.add_row("peak gathered params", f"{summary['peak_gathered_bytes'] / 2**20:.2f} MB "
                  f"= {summary['peak_gathered_bytes'] / summary['largest_unit_bytes']:.2f} x largest unit, "
                  f"{summary['peak_gathered_bytes'] / summary['model_bytes']:.0%} of the model "
                  f"({summary['model_bytes'] / 2**20:.2f} MB)")
        t.add_row("max RSS (rank 0)", f"{summary['max_rss_mb']:.0f} MB")
        console.print(t)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"summary": summary, "history": history}, f, indent=1, default=str)
    return summary


def _init_process_group(backend: str):
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    _run_in_group(args)


def _run_in_group(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    _init_process_group(args.backend)
    try:
        train(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main_from_args(args) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        _run_in_group(args)
        return 0
    world = args.nproc_per_node
    if world < 1:
        raise SystemExit("--nproc-per-node must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(world, port, args), nprocs=world, join=True, start_method="spawn")
    return 0


def main(argv=None) -> int:
    return main_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
