"""The ``train`` job's options: each value range is checked as it is parsed, the rules across
options by :func:`check_args` before any process starts (see [Note: bad command-line values] in
``ragged/_cli.py``). The job itself: ``train.py``; what rank 0 prints: ``_train_report.py``.
"""

from __future__ import annotations

import argparse
import os

import torch

from ragged._cli import DTYPES, ArgumentParser, UsageError, float_above, float_at_least, int_at_least

__all__ = ["build_parser", "check_args", "launched_by_torchrun", "world_sizes", "backend", "EXPERTS", "TOP_K"]

EXPERTS, TOP_K = 8, 2
FORMAT_NAMES = ("none", "fp8", "int8", "mxfp8")  # ragged.predict._command.GATHER_FORMATS, as plan --predict names them
DESCRIPTION = "The main job: train the small GPT with the functional FSDP step."


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The job's options (every value range is checked here; cross-option rules in
    :func:`check_args`)."""
    p = parser or ArgumentParser(prog="python -m ragged.examples.train", description=DESCRIPTION)
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
                   help=f"experts per MoE block (with --moe or --hf mixtral; default {EXPERTS})")
    g.add_argument("--top-k", type=int_at_least(1), default=None,
                   help=f"experts per token (with --moe or --hf mixtral; default {TOP_K})")
    g.add_argument("--hf", choices=["llama", "mixtral"], default=None,
                   help="a Hugging Face model of these sizes instead (config only, built on meta; ragged.examples.hf)")
    g.add_argument("--save-pretrained", default=None, metavar="DIR",
                   help="with --hf: fsdp.save_pretrained the trained model here, by rank (default: a temporary directory)")
    g.add_argument("--from-pretrained", default=None, metavar="DIR",
                   help="with --hf: start from this Hugging Face directory (its config.json replaces the size flags; "
                        "each rank reads only its own byte ranges)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int_at_least(1), default=300, help="optimizer steps")
    g.add_argument("--batch", type=int_at_least(1), default=32,
                   help="global batch (sequences), split over ranks and micro-batches")
    g.add_argument("--micro-batches", type=int_at_least(1), default=1, help="gradient accumulation steps per rank")
    g.add_argument("--chunks", type=int_at_least(1), default=None, metavar="C",
                   help="the global batch is C chunks and every step gives the same numbers at each world size the "
                        "summary lists (powers of two dividing C, and C); each rank runs C / world chunks as its "
                        "micro-batches (docs/invariance.md)")
    g.add_argument("--optimizer", choices=["adamw", "adamw_8bit", "muon", "sgd", "soap", "shampoo"], default="adamw",
                   help="optimizer")
    g.add_argument("--precondition-block", type=int_at_least(1), default=128,
                   help="soap / shampoo: b x b blocks of the matrices (spec.Blocks(b, b)), each preconditioned where it lives")
    g.add_argument("--precondition-frequency", type=int_at_least(1), default=10,
                   help="soap / shampoo: steps between refreshes of the eigenbases / inverse roots")
    g.add_argument("--lr", type=float_above(0.0), default=3e-3, help="peak learning rate (warmup, then cosine to lr/10)")
    g.add_argument("--warmup", type=int_at_least(0), default=10, help="linear warmup steps")
    g.add_argument("--weight-decay", type=float_at_least(0.0), default=0.1, help="decoupled weight decay")
    g.add_argument("--clip", type=float_at_least(0.0), default=1.0, help="global-norm clipping (0: off)")
    g.add_argument("--compute-dtype", choices=sorted(DTYPES), default="fp32", help="dtype parameters are gathered in")
    g.add_argument("--reduce-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype gradients are reduce-scattered in (default: None, the master dtype fp32: with bf16 "
                        "compute the same bits as --reduce-dtype fp32, not bf16)")
    g.add_argument("--gather-format", choices=FORMAT_NAMES, default="none",
                   help="quantize the all-gather: fp8 in 128 x 128 tiles, int8 in 32 x 32, mxfp8 in 1 x 32 blocks, on "
                        "every matrix the blocks tile (planned with them); the rest travels unquantized "
                        "(docs/quantization.md)")
    g.add_argument("--reduce-format", choices=FORMAT_NAMES, default="none",
                   help="quantize the gradient reduce-scatter, in the same formats and blocks")
    g.add_argument("--no-prefetch", action="store_true", help="do not start the next unit's all-gather early")
    g.add_argument("--no-reshard", action="store_true", help="keep parameters gathered from forward to backward")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward (less memory, one more forward)")
    g.add_argument("--no-donate", action="store_true",
                   help="allocate new shards / optimizer buffers every step instead of updating in place")
    g.add_argument("--seed", type=int, default=0, help="fixes the weights and the data")
    g = p.add_argument_group("checkpoints (see docs/main-job.md, long runs)")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save the training state here in the background and resume from its newest checkpoint")
    g.add_argument("--checkpoint-every", type=int_at_least(1), default=None, metavar="N",
                   help="with --checkpoint-dir: save after every N-th step (and after the last)")
    g.add_argument("--keep", type=int_at_least(1), default=None, metavar="K",
                   help="with --checkpoint-dir: keep the newest K checkpoints (default 2)")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write per-step metrics and the summary here (rank 0)")
    g.add_argument("--quiet", action="store_true", help="no progress bar or progress lines (the summary and verdict stay)")
    g.add_argument("--log-every", type=int_at_least(1), default=None,
                   help="steps between progress lines when stdout is not a terminal (default: steps / 20)")
    return p


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_sizes(args) -> tuple[int, int]:
    """``(world, ranks on this node)``: torchrun's environment, else ``--nproc-per-node``."""
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return args.nproc_per_node, args.nproc_per_node


def backend(requested: str, local_ranks: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def check_args(args) -> None:
    """Rules across options, checked before any process starts (one line each, see
    [Note: bad command-line values] in ``ragged._cli``); fills in the MoE defaults.

    Raises:
        ragged._cli.UsageError: the first rule broken, with the fix.
    """
    world, local = world_sizes(args)
    if args.hf and args.moe:
        raise UsageError(f"--moe makes the example GPT an MoE; with --hf {args.hf} drop it (--hf mixtral is the "
                         "Hugging Face MoE).")
    if args.hf and args.activation_checkpointing:
        raise UsageError("--activation-checkpointing is not supported with --hf (HF gradient checkpointing inside "
                         "the model does not mix with functional_call).")
    if args.save_pretrained and not args.hf:
        raise UsageError("--save-pretrained saves a Hugging Face model: add --hf llama|mixtral (or drop it).")
    if args.from_pretrained and not args.hf:
        raise UsageError("--from-pretrained loads a Hugging Face model: add --hf llama|mixtral (or drop it).")
    experts_used = args.moe or args.hf == "mixtral"
    if not experts_used and (args.experts is not None or args.top_k is not None):
        raise UsageError("--experts and --top-k set up MoE blocks: add --moe (or --hf mixtral), or drop them.")
    args.experts = EXPERTS if args.experts is None else args.experts
    args.top_k = min(TOP_K, args.experts) if args.top_k is None else args.top_k
    if experts_used and args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k} is more than --experts {args.experts}: each token picks top-k "
                         "distinct experts; use --top-k <= --experts.")
    if args.moe and args.layers < 2:
        raise UsageError(f"--moe makes every 2nd block an MoE block, and --layers {args.layers} has no 2nd block; "
                         "use --layers >= 2.")
    if args.dim % args.heads:
        raise UsageError(f"--dim {args.dim} must be a multiple of --heads {args.heads} (each head gets dim / heads).")
    if args.chunks is not None:
        _check_chunks(args, world)
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
    # the formats' blocks live with the job's recipe (ragged.predict's formats): imported when checking, not at --help
    from ragged.examples._recipe import blocks_conflict

    if (conflict := blocks_conflict(args)) is not None:
        raise UsageError(conflict)
    if args.from_pretrained:
        _check_pretrained_dir(args.from_pretrained)
    if args.checkpoint_dir:
        _check_output_dir("--checkpoint-dir", args.checkpoint_dir)
    if args.checkpoint_dir or args.checkpoint_every or args.keep:
        # reads the newest checkpoint's manifest (ragged.checkpoint loads torch.distributed.checkpoint): only then
        from ragged.examples._train_checkpoint import check_checkpoint_args

        check_checkpoint_args(args)
    if args.save_pretrained:
        _check_output_dir("--save-pretrained", args.save_pretrained)


def _check_chunks(args, world: int) -> None:
    """``--chunks C``: what ``make_step(chunks=C)`` refuses, refused here before any process starts;
    sets ``--micro-batches`` to C / world."""
    # the step's own rule, asked of a comm without processes
    from ragged.collectives import abstract
    from ragged.fsdp._chunks import chunked_micro_batches

    if args.batch % args.chunks:
        raise UsageError(f"--batch {args.batch} must split into --chunks {args.chunks} equal chunks; use --batch "
                         f"{max(args.chunks, args.batch // args.chunks * args.chunks)}.")
    given = None if args.micro_batches == 1 else args.micro_batches
    try:
        args.micro_batches = chunked_micro_batches(args.chunks, abstract(world), given, "--chunks")
    except ValueError as err:
        raise UsageError(str(err).replace("micro_batches=", "--micro-batches ").replace("micro_batches", "--micro-batches")) from None


def _check_pretrained_dir(path: str) -> None:
    """``--from-pretrained``: a Hugging Face directory, its index and headers read here, in the
    parent (what every rank would refuse, refused once before any rank starts)."""
    # ragged.checkpoint loads torch.distributed.checkpoint: only when --from-pretrained is given
    from ragged.checkpoint import CheckpointError, pretrained

    try:
        pretrained(path)
    except CheckpointError as err:
        raise UsageError(f"--from-pretrained {path}: {err}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--from-pretrained {path}: it has no config.json (the model's config, which sets its sizes).")


def _check_output_dir(option: str, path: str) -> None:
    """A directory the job may create or write into: not a file, and its nearest existing
    ancestor a writable directory."""

    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise UsageError(f"{option} {path}: it exists and is not a directory.")
    parent = target
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path}: {parent} is a file, so the directory cannot be made.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: {parent} is not writable.")
