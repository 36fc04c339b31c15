"""The main job: train the small GPT with the functional FSDP step.

Run it with ``torchrun --nproc-per-node 2 -m ragged.examples.train`` (gloo on CPU, NCCL when
CUDA is present), or ``python -m ragged train --nproc-per-node 2`` which starts the processes
itself. Rank 0 prints the plan summary, a rich progress bar in a terminal (plain progress lines
in a log: loss, tokens/s, memory), a final summary and a verdict line (learnt or not, by
:meth:`ragged.examples.data.SyntheticLM.verdict`); the exit status is 1 when the loss did not
fall. ``--json PATH`` writes the per-step metrics.

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
    """The job's options (every value range is checked here; cross-option rules in
    :func:`check_args`)."""
    from ragged._cli import ArgumentParser, float_above, float_at_least, int_at_least

    p = parser or ArgumentParser(prog="python -m ragged.examples.train", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("launch")
    g.add_argument("--nproc-per-node", type=int_at_least(1), default=2,
                   help="processes to start when not launched by torchrun")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="auto: nccl when there is a CUDA GPU per rank, else gloo")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int_at_least(1), default=4, help="decoder blocks")
    g.add_argument("--dim", type=int_at_least(1), default=128, help="model width (a multiple of --heads)")
    g.add_argument("--heads", type=int_at_least(1), default=4, help="attention heads")
    g.add_argument("--ffn", type=int_at_least(1), default=352, help="MLP hidden size")
    g.add_argument("--vocab", type=int_at_least(2), default=256, help="vocabulary of the synthetic task")
    g.add_argument("--seq", type=int_at_least(2), default=64, help="tokens per sequence")
    g.add_argument("--moe", action="store_true", help="every 2nd block is a top-k MoE with fused experts")
    g.add_argument("--experts", type=int_at_least(1), default=None,
                   help=f"experts per MoE block (with --moe or --hf mixtral; default {_EXPERTS})")
    g.add_argument("--top-k", type=int_at_least(1), default=None,
                   help=f"experts per token (with --moe or --hf mixtral; default {_TOP_K})")
    g.add_argument("--hf", choices=["llama", "mixtral"], default=None,
                   help="a Hugging Face model of these sizes instead (config only, built on meta; ragged.examples.hf)")
    g.add_argument("--save-pretrained", default=None, metavar="DIR",
                   help="with --hf: save_pretrained the trained model here (default: a temporary directory)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int_at_least(1), default=300, help="optimizer steps")
    g.add_argument("--batch", type=int_at_least(1), default=32,
                   help="global batch (sequences), split over ranks and micro-batches")
    g.add_argument("--micro-batches", type=int_at_least(1), default=1, help="gradient accumulation steps per rank")
    g.add_argument("--optimizer", choices=["adamw", "adamw_8bit", "muon", "sgd"], default="adamw", help="optimizer")
    g.add_argument("--lr", type=float_above(0.0), default=3e-3, help="peak learning rate (warmup, then cosine to lr/10)")
    g.add_argument("--warmup", type=int_at_least(0), default=10, help="linear warmup steps")
    g.add_argument("--weight-decay", type=float_at_least(0.0), default=0.1, help="decoupled weight decay")
    g.add_argument("--clip", type=float_at_least(0.0), default=1.0, help="global-norm clipping (0: off)")
    g.add_argument("--compute-dtype", choices=sorted(_DTYPES), default="fp32", help="dtype parameters are gathered in")
    g.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default=None,
                   help="dtype gradients are reduce-scattered in (default: the compute dtype)")
    g.add_argument("--no-prefetch", action="store_true", help="do not start the next unit's all-gather early")
    g.add_argument("--no-reshard", action="store_true", help="keep parameters gathered from forward to backward")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward (less memory, one more forward)")
    g.add_argument("--no-donate", action="store_true",
                   help="allocate new shards / optimizer buffers every step instead of updating in place")
    g.add_argument("--seed", type=int, default=0, help="fixes the weights and the data")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write per-step metrics and the summary here (rank 0)")
    g.add_argument("--quiet", action="store_true", help="no progress bar or progress lines (the summary and verdict stay)")
    g.add_argument("--log-every", type=int_at_least(1), default=None,
                   help="steps between progress lines when stdout is not a terminal (default: steps / 20)")
    return p


_EXPERTS, _TOP_K = 8, 2


def configure(parser: argparse.ArgumentParser) -> None:
    """Registers the ``train`` subcommand of ``python -m ragged`` (see ``ragged._cli``)."""
    build_parser(parser)
    parser.set_defaults(func=main_from_args)


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _world_sizes(args) -> tuple[int, int]:
    """``(world, ranks on this node)``: torchrun's environment, else ``--nproc-per-node``."""
    if _launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return args.nproc_per_node, args.nproc_per_node


def _backend(requested: str, local_ranks: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def check_args(args) -> None:
    """Rules across options, checked before any process starts (one line each, see
    [Note: bad command-line values] in ``ragged._cli``); fills in the MoE defaults.

    Raises:
        ragged._cli.UsageError: the first rule broken, with the fix.
    """
    from ragged._cli import UsageError

    world, local = _world_sizes(args)
    if args.hf and args.moe:
        raise UsageError(f"--moe makes the example GPT an MoE; with --hf {args.hf} drop it (--hf mixtral is the "
                         "Hugging Face MoE).")
    if args.hf and args.activation_checkpointing:
        raise UsageError("--activation-checkpointing is not supported with --hf (HF gradient checkpointing inside "
                         "the model does not mix with functional_call).")
    if args.save_pretrained and not args.hf:
        raise UsageError("--save-pretrained saves a Hugging Face model: add --hf llama|mixtral (or drop it).")
    experts_used = args.moe or args.hf == "mixtral"
    if not experts_used and (args.experts is not None or args.top_k is not None):
        raise UsageError("--experts and --top-k set up MoE blocks: add --moe (or --hf mixtral), or drop them.")
    args.experts = _EXPERTS if args.experts is None else args.experts
    args.top_k = min(_TOP_K, args.experts) if args.top_k is None else args.top_k
    if experts_used and args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k} is more than --experts {args.experts}: each token picks top-k "
                         "distinct experts; use --top-k <= --experts.")
    if args.moe and args.layers < 2:
        raise UsageError(f"--moe makes every 2nd block an MoE block, and --layers {args.layers} has no 2nd block; "
                         "use --layers >= 2.")
    if args.dim % args.heads:
        raise UsageError(f"--dim {args.dim} must be a multiple of --heads {args.heads} (each head gets dim / heads).")
    per_step = world * args.micro_batches
    if args.batch % per_step:
        lower, upper = args.batch // per_step * per_step, (args.batch // per_step + 1) * per_step
        pick = f"--batch {upper}" if lower == 0 else f"--batch {lower} or {upper}"
        raise UsageError(f"--batch {args.batch} must split into {world} ranks x {args.micro_batches} micro-batches "
                         f"(a multiple of {per_step}); use {pick}.")
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise UsageError(f"--backend nccl needs CUDA GPUs and this torch ({torch.__version__}) sees none; "
                             "use --backend gloo (or auto).")
        if torch.cuda.device_count() < local:
            raise UsageError(f"--backend nccl runs one rank per GPU: {local} ranks on this node but "
                             f"{torch.cuda.device_count()} GPU(s); use fewer ranks or --backend gloo.")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json}: the directory {os.path.dirname(os.path.abspath(args.json))} "
                         "does not exist.")


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


def _console():
    """Rank 0's console: rich in a terminal; in a log or CI (not a terminal) plain text that is
    never cut at 80 columns."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=200)
    return console


class _Progress:
    """A rich progress bar in a terminal; elsewhere a plain line every ``every`` steps (and the
    first and last step), flushed at once, so a log shows the run as it goes."""

    def __init__(self, console, steps: int, every: int | None, quiet: bool):
        self.console, self.steps, self.bar = console, steps, None
        self.every = every or max(1, round(steps / 20))
        self.quiet, self.t0 = quiet, time.perf_counter()
        if quiet or not console.is_terminal:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                            TextColumn("gathered {task.fields[gath]:.1f}/{task.fields[model]:.1f} MB"),
                            TextColumn("rss {task.fields[rss]:.0f} MB"), TimeElapsedColumn(), console=console)
        self.bar.start()
        self.task = self.bar.add_task("train", total=steps, loss=float("nan"), tps=0.0, gath=0.0, model=0.0, rss=0.0)

    def update(self, step: int, rec: dict) -> None:
        fields = dict(loss=rec["loss"], tps=rec["tokens_per_s"], gath=rec["peak_gathered_bytes"] / 2**20,
                      model=rec["model_bytes"] / 2**20, rss=rec["rss_mb"])
        if self.bar is not None:
            self.bar.update(self.task, advance=1, **fields)
        elif not self.quiet and (step == 0 or (step + 1) % self.every == 0 or step + 1 == self.steps):
            elapsed = time.perf_counter() - self.t0
            print(f"train step {step + 1}/{self.steps}  loss {fields['loss']:.3f}  {fields['tps']:,.0f} tok/s  "
                  f"gathered {fields['gath']:.1f}/{fields['model']:.1f} MB  rss {fields['rss']:.0f} MB  "
                  f"{elapsed:.1f} s", flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def train(args) -> dict:
    """Runs the job in an initialised process group; returns the summary (every rank), whose
    ``"verdict"`` is the task's judgement of the losses (:meth:`SyntheticLM.verdict`)."""
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
                    ffn_dim=args.ffn, max_seq_len=args.seq, num_experts=(args.experts or _EXPERTS) if args.moe else 0,
                    top_k=(args.top_k or _TOP_K) if args.moe else _TOP_K)
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
        console = _console()
        console.print(f"[bold]ragged FSDP[/] · {world} ranks ({dist.get_backend()}) · GPT "
                      f"{f'MoE ({cfg.num_experts} experts, top-{cfg.top_k}) ' if args.moe else ''}"
                      f"{n_params / 1e6:.2f}M params · optimizer {args.optimizer} · "
                      f"compute {args.compute_dtype} · micro-batches {args.micro_batches}")
        console.print(units)
        console.print(f"task: Markov(vocab {cfg.vocab_size}, branching {task.branching}) then copy; "
                      f"loss starts near ln(vocab) = {math.log(cfg.vocab_size):.2f}; below {task.no_copy_floor:.2f} "
                      f"the model copies (learnt); a perfect model reaches {task.floor:.2f}")

    history, tokens_per_step = [], args.batch * args.seq
    progress = _Progress(console, args.steps, args.log_every, args.quiet) if rank == 0 else None
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
                progress.update(s, rec)
    finally:
        if progress is not None:
            progress.stop()
    total = time.perf_counter() - t_start
    steady = history[min(3, len(history) - 1):]
    verdict = task.verdict([h["loss"] for h in history], min_steps=args.warmup + 10)
    summary = {
        "world_size": world, "backend": dist.get_backend(), "params": n_params, "steps": args.steps,
        "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
        "min_loss": min(h["loss"] for h in history), "ln_vocab": math.log(cfg.vocab_size), "floor": task.floor,
        "no_copy_floor": task.no_copy_floor, "learnt": verdict.learnt, "verdict": verdict.line,
        "exit_status": 0 if verdict.ok else 1,
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
        t.add_row("ln(vocab) / no-copy floor / task floor",
                  f"{summary['ln_vocab']:.3f} / {summary['no_copy_floor']:.3f} / {summary['floor']:.3f}")
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
        print(verdict.line, flush=True)
    return summary


def _init_process_group(backend: str, local_ranks: int):
    import torch.distributed as dist

    backend = _backend(backend, local_ranks)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def _worker(rank: int, world: int, port: int, args, status_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    status = _run_in_group(args)
    if rank == 0:
        with open(status_path, "w") as f:
            f.write(str(status))


def _run_in_group(args) -> int:
    """Trains in a new process group (this process is one rank); returns the exit status."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    _init_process_group(args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    try:
        summary = train(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return summary.get("exit_status", 0)  # the --hf path has no verdict


def main_from_args(args) -> int:
    """Checks the options, then trains: in this process under torchrun, else in
    ``--nproc-per-node`` spawned processes. Returns 0, or 1 when the loss did not fall or a
    rank failed (raises ``ragged._cli.UsageError`` for bad options, before any process starts)."""
    check_args(args)
    if _launched_by_torchrun():
        return _run_in_group(args)
    import tempfile

    import torch.multiprocessing as mp

    world = args.nproc_per_node
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="ragged-train-") as tmp:
        status_path = os.path.join(tmp, "status")
        context = mp.start_processes(_worker, args=(world, port, args, status_path), nprocs=world, join=False,
                                     start_method="spawn")
        try:
            while not context.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # the other ranks are stopped
            _report_failure(context, err, world)
            return 1
        with open(status_path) as f:
            return int(f.read())


def _report_failure(context, err, world: int) -> None:
    """The traceback of the rank that failed first (the others usually fail because it left:
    "Connection closed by peer"), and one line for each other failed rank."""
    import pickle

    traces = []
    for rank, path in enumerate(context.error_files):
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                traces.append((os.stat(path).st_mtime_ns, rank, pickle.load(f)))
            os.unlink(path)
    if not traces:
        print(f"error: rank {err.error_index} of {world} failed: {err}".rstrip(), file=sys.stderr, flush=True)
        return
    traces.sort()
    _, first, trace = traces[0]
    others = "".join(f"\nrank {rank} then failed too: {t.strip().splitlines()[-1]}" for _, rank, t in traces[1:])
    print(f"error: rank {first} of {world} failed first (the other ranks were stopped):\n{trace.rstrip()}{others}",
          file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """``python -m ragged.examples.train`` (under torchrun, or starting its own processes)."""
    from ragged._cli import UsageError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return main_from_args(args)
    except UsageError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
