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

import os
import pickle
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ragged as rg
from ragged import fsdp
from ragged._cli import UsageError
from ragged._console import console as make_console
from ragged.examples import hf
from ragged.examples._recipe import no_decay_types, optimizer, policy_for, specs_for
from ragged.examples._train_args import EXPERTS, TOP_K, build_parser, check_args, launched_by_torchrun
from ragged.examples._train_args import backend as pick_backend
from ragged.examples._train_loop import announce, finish, job_checkpoints, resumed, run_steps, summarize
from ragged.examples.data import SyntheticLM
from ragged.examples.gpt import GPT, GPTConfig, loss_fn

__all__ = ["build_parser", "configure", "check_args", "main", "main_from_args", "train"]


def configure(parser) -> None:
    """Registers the ``train`` subcommand of ``python -m ragged`` (see [Note: adding a subcommand] in
    ``ragged/__main__.py``)."""
    build_parser(parser)
    parser.set_defaults(func=main_from_args)


def train(args) -> dict:
    """Runs the job in an initialised process group; returns the summary (every rank), whose
    ``"verdict"`` is the task's judgement of the losses (:meth:`SyntheticLM.verdict`)."""
    if args.hf:
        return hf.train(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    comm = rg.collectives.from_torch()
    cfg = GPTConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                    ffn_dim=args.ffn, max_seq_len=args.seq, num_experts=(args.experts or EXPERTS) if args.moe else 0,
                    top_k=(args.top_k or TOP_K) if args.moe else TOP_K)
    model = GPT(cfg, device=device)
    model.reset_parameters(torch.Generator().manual_seed(args.seed))  # same weights on every rank (drawn on CPU)
    units = fsdp.make_units(model, world_size=world, specs=specs_for(args))
    opt = optimizer(args, comm, units, no_decay_types(model))
    state = fsdp.init(units, model, opt, comm)  # the module now holds placeholders: every rank keeps only its shards
    step = fsdp.make_step(units, loss_fn(model, checkpoint=args.activation_checkpointing), opt, comm,
                          micro_batches=args.micro_batches, chunks=args.chunks, policy=policy_for(args),
                          prefetch=not args.no_prefetch, reshard_after_forward=not args.no_reshard)  # donates as opt does
    task = SyntheticLM(cfg.vocab_size, args.seq, seed=args.seed + 1)
    console = make_console() if rank == 0 else None
    if console is not None:
        announce(console, args, f"GPT{f' MoE ({cfg.num_experts} experts, top-{cfg.top_k})' if args.moe else ''}",
                 units, task)
    checkpoints = job_checkpoints(args, comm, units, model)
    state, history, seconds = run_steps(args, step, state, task, device, console, checkpoints)
    summary = summarize(args, history, seconds, task, units, **resumed(checkpoints, args.chunks))
    if console is not None:
        finish(console, args, summary, history)
    return summary


def _init_process_group(backend: str, local_ranks: int):
    backend = pick_backend(backend, local_ranks)
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
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    _init_process_group(args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    try:
        summary = train(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return summary["exit_status"]


def main_from_args(args) -> int:
    """Checks the options, then trains: in this process under torchrun, else in
    ``--nproc-per-node`` spawned processes. Returns 0, or 1 when the loss did not fall or a
    rank failed (raises ``ragged._cli.UsageError`` for bad options, before any process starts)."""
    check_args(args)
    if launched_by_torchrun():
        return _run_in_group(args)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return main_from_args(args)
    except UsageError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
