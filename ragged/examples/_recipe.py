"""What both of the ``train`` job's models (the example GPT and ``--hf``) train with: the optimizer
from the job's options, the mixed-precision policy (dtypes, quantized collectives) and the specs
they need."""

from __future__ import annotations

import torch

from ragged import fsdp, optim, spec
from ragged._cli import DTYPES
from ragged.predict._command import GATHER_FORMATS, where_blocks_fit
from ragged.quant._codec import fits_shape

__all__ = ["specs_for", "no_decay_types", "optimizer", "muon_matrices", "policy_for", "formats_for", "blocks_conflict"]

_OPTIMIZER_ROWS = {"adamw_8bit": lambda args: 32, "soap": lambda args: args.precondition_block,
                   "shampoo": lambda args: args.precondition_block}  # the rows of the blocks each one plans


def formats_for(args) -> tuple:
    """``(gather, reduce)``: the ``rg.quant`` formats of ``--gather-format`` and ``--reduce-format``
    (the ones ``plan --predict --gather-format`` names), ``None`` where not quantized."""
    return tuple(None if name == "none" else GATHER_FORMATS[name] for name in (args.gather_format, args.reduce_format))


def blocks_conflict(args) -> str | None:
    """Why ``--optimizer``'s planning blocks would cut a format's blocks (so no matrix could be
    quantized), as the refusal's text; ``None`` when they hold them whole."""
    rows = _OPTIMIZER_ROWS[args.optimizer](args) if args.optimizer in _OPTIMIZER_ROWS else None
    for option, name, fmt in zip(("--gather-format", "--reduce-format"), (args.gather_format, args.reduce_format),
                                 formats_for(args)):
        if rows is not None and fmt is not None and rows % fmt.block[0]:
            r, c = fmt.block
            return (f"{option} {name} quantizes {r} x {c} blocks, but --optimizer {args.optimizer} plans blocks of "
                    f"{rows} rows, which cut them; use {option} int8 or mxfp8 (32 x 32, 1 x 32 blocks)"
                    + (f", or --precondition-block {r}" if args.optimizer in ("soap", "shampoo") else "") + ".")
    return None


def specs_for(args):
    """The specs the job needs: SOAP's / Shampoo's ``--precondition-block`` blocks, 8-bit AdamW's 32 x
    32 quantization blocks, else the tiles of the quantized collectives' formats on the matrices they
    tile (the format with the most rows: its tiles hold every other one's whole); None: the default rows."""
    if args.optimizer in ("soap", "shampoo"):  # b x b blocks, each preconditioned where it lives
        return lambda name, t: _precondition_blocks(t.shape, args.precondition_block) if t.dim() >= 2 else None
    if args.optimizer == "adamw_8bit":
        def specs(name, t):  # 32x32 quantization blocks that no rank boundary cuts
            return spec.Blocks(32, 32) if t.dim() >= 2 and t.shape[-1] % 32 == 0 and t.shape[-2] % 32 == 0 else None

        return specs
    tiled = [f for f in formats_for(args) if f is not None and f.block[0] > 1]
    if not tiled:
        return None  # rows hold whole 1 x c blocks (mxfp8) wherever c divides the row
    fmt = max(tiled, key=lambda f: f.block[0])
    return lambda name, t: spec.Blocks(*fmt.block) if t.dim() >= 2 and fits_shape(tuple(t.shape), fmt) else None


def policy_for(args) -> fsdp.MixedPrecision:
    """The step's policy: ``--compute-dtype``, ``--reduce-dtype`` (None: the master dtype) and the
    quantized collectives, on every matrix whose planned blocks hold the format's whole."""
    gather, reduce = (None if f is None else where_blocks_fit(f) for f in formats_for(args))
    return fsdp.MixedPrecision(compute_dtype=DTYPES[args.compute_dtype],
                               reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                               gather_format=gather, reduce_format=reduce)


def _precondition_blocks(shape, b: int):
    """``Blocks(b, b)``; for a stack of matrices (fused experts) whose rows ``b`` does not divide, ``Blocks(r, b)``
    with ``r`` halved until it does (the bands of consecutive matrices must line up): every matrix is preconditioned."""
    r = b
    while len(shape) > 2 and shape[-2] % r:
        r //= 2
    return spec.Blocks(r, b)


def no_decay_types(model: torch.nn.Module) -> tuple[type, ...]:
    """The module types whose parameters get no weight decay, as in every real recipe: embeddings
    and norms (torch's, and a model's own ``*Norm`` classes such as Hugging Face's ``LlamaRMSNorm``)."""
    own = {type(m) for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))}
    return (torch.nn.Embedding, torch.nn.RMSNorm, torch.nn.LayerNorm, *sorted(own, key=lambda t: t.__qualname__))


def muon_matrices(leaf) -> bool:
    """Muon's leaves in the job: the matrices but the embedding and the head."""
    return len(leaf.shape) in (2, 3) and "emb" not in leaf.path and "head" not in leaf.path


def optimizer(args, comm, units, no_decay: tuple[type, ...]):
    """The job's optimizer from its options: warmup then cosine to lr / 10; AdamW's decay groups (no decay on
    ``no_decay`` modules' parameters), SOAP or Shampoo on the decay group (AdamW on the other), SGD or Muon;
    global-norm clipping when ``--clip`` > 0."""
    steps = max(args.steps, args.warmup + 1)
    lr = optim.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, steps, end_value=args.lr / 10)
    if args.optimizer in ("adamw", "adamw_8bit"):
        make = optim.adamw if args.optimizer == "adamw" else optim.adamw_8bit
        core = optim.multi_transform(
            {"decay": make(lr, b2=0.98, weight_decay=args.weight_decay, donate=not args.no_donate),
             "no_decay": optim.adamw(lr, b2=0.98)},  # norms and embeddings: few or row-wise, fp32 moments
            units.param_groups({no_decay: "no_decay"}, default="decay"), compact=("no_decay",))
    elif args.optimizer in ("soap", "shampoo"):  # norms and embeddings: AdamW without decay, as above
        groups = units.param_groups({no_decay: "no_decay"}, default="decay")
        decayed = lambda leaf: groups(leaf) == "decay"  # noqa: E731
        if args.optimizer == "soap":
            pre = optim.soap(lr, weight_decay=args.weight_decay, precondition_frequency=args.precondition_frequency,
                             precondition_filter=decayed)
        else:
            pre = optim.shampoo(lr, weight_decay=args.weight_decay, precondition_frequency=args.precondition_frequency,
                                grafting_b2=0.98, precondition_filter=decayed)
        core = optim.multi_transform({"decay": pre, "no_decay": optim.adamw(lr, b2=0.98)}, groups, compact=("no_decay",))
    elif args.optimizer == "sgd":
        core = optim.sgd(lr, momentum=0.9, donate=not args.no_donate)
    else:
        core = optim.muon(0.02, comm=comm, weight_decay=args.weight_decay, muon_filter=muon_matrices,
                             adam=optim.adamw(lr, b2=0.98, weight_decay=args.weight_decay, donate=not args.no_donate))
    if args.clip > 0:
        return optim.chain(optim.clip_by_global_norm(args.clip, comm=comm), core)
    return core
