"""The ``python -m ragged`` command line: subcommand dispatch and ``plan``.

[Note: adding a subcommand]
Add one entry to :data:`SUBCOMMANDS`: ``name -> (help, "module:configure")``. ``configure``
receives the subcommand's ``argparse`` parser, adds its options and calls
``parser.set_defaults(func=handler)``; ``handler(args) -> int`` is the exit status. Modules
are imported only when their subcommand runs (or ``--help`` lists it), so a heavy
subcommand costs nothing to the others.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
import time

__all__ = ["run", "build_parser", "parse_granularity", "unit_specs", "SUBCOMMANDS"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan every FSDP unit of a model and compare padding with FSDP2/FSDP1/ZeRO-3/Megatron-FSDP",
             "ragged._cli:configure_plan"),
    "train": ("train the example GPT (dense or --moe) with the functional FSDP step on gloo/NCCL ranks",
              "ragged.examples.train:configure"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ragged", description="ragged: RaggedShard planning and FSDP tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, target) in SUBCOMMANDS.items():
        module, func = target.split(":")
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(module), func)(p)
    return parser


def run(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


# ---- granularities -----------------------------------------------------------------------
_GRAN_RE = re.compile(r"^(rows|elements|blocks):(\d+)(?:x(\d+))?$")


def parse_granularity(text: str):
    """``rows:N``, ``elements:N`` or ``blocks:RxC`` -> a granularity.

    Examples:
        >>> parse_granularity("rows:16"), parse_granularity("blocks:128x128")
        (Rows(n=16), Blocks(r=128, c=128))
    """
    from ragged import spec

    m = _GRAN_RE.match(text.strip().lower())
    if not m or (m.group(1) == "blocks") != (m.group(3) is not None) or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(
            f"granularity {text!r} is not one of rows:N, elements:N, blocks:RxC (e.g. rows:16, blocks:128x128)."
        )
    kind, a = m.group(1), int(m.group(2))
    if kind == "rows":
        return spec.Rows(a)
    if kind == "elements":
        return spec.Elements(a)
    return spec.Blocks(a, int(m.group(3)))


def unit_specs(params, granularity):
    """A spec tree applying ``granularity`` to every leaf of ``params`` where it can apply.

    ``Blocks(r, c)`` only tiles 2-D and higher leaves: 1-D leaves (norms, biases) get
    ``Rows(1)`` (they are not block-quantized), and stacked matrices whose row count is not a
    multiple of ``r`` (GPT-OSS experts: 2880 rows, r=128) get whole matrices
    ``Rows(shape[-2])``, the finest cut that keeps every tile whole.

    Returns:
        ``(specs, notes)``: the spec tree and a list of human-readable fallbacks taken.
    """
    from ragged import spec
    from ragged._pytree import pytree

    if not isinstance(granularity, spec.Blocks):
        return granularity, []
    leaves, treedef = pytree.flatten(params)
    specs, notes = [], {}
    for leaf in leaves:
        shape = tuple(leaf.shape)
        if len(shape) < 2:
            specs.append(spec.Rows(1))
            notes.setdefault("1-D leaves use Rows(1) (not block-tiled)", 0)
            notes["1-D leaves use Rows(1) (not block-tiled)"] += 1
        elif len(shape) >= 3 and math.prod(shape[:-2]) > 1 and shape[-2] % granularity.r:
            specs.append(spec.Rows(shape[-2]))
            key = f"stacked {shape} has {shape[-2]} rows per matrix, not a multiple of {granularity.r}: whole matrices Rows({shape[-2]})"
            notes[key] = notes.get(key, 0) + 1
        else:
            specs.append(granularity)
    return pytree.unflatten(treedef, specs), [f"{k} [{n} leaves]" for k, n in notes.items()]


# ---- plan ----------------------------------------------------------------------------------
def configure_plan(p: argparse.ArgumentParser) -> None:
    from ragged._models import MODELS

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=MODELS, help="a bundled model")
    src.add_argument("--shapes", metavar="JSON", help="your own shapes file (format: ragged.models docs)")
    p.add_argument("--world-size", "-m", type=_world_sizes, nargs="+", required=True, metavar="N",
                   help="shard group size(s) m, e.g. 64 256 1024, or A..B for the powers of two from A to B")
    p.add_argument("--granularity", "-g", type=parse_granularity, default="rows:1",
                   help="rows:N | elements:N | blocks:RxC (default rows:1)")
    p.add_argument("--strategy", choices=("dp", "exact", "naive"), default="dp")
    p.add_argument("--max-buffers", type=_max_buffers, default="auto", metavar="K|auto",
                   help="buffers per unit: auto (default; up to 8, see README Planning) or an int (1: one buffer)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16", help="buffer dtype (default bf16)")
    p.add_argument("--align", type=int, default=None, help="offset alignment in elements (default 16 bytes)")
    p.add_argument("--layers-per-unit", type=int, default=1, help="decoder layers per FSDP unit (default 1)")
    p.add_argument("--warn-above", type=float, default=3.0, metavar="PCT",
                   help="explain units whose padding exceeds this percentage (default 3)")
    p.add_argument("--visualize", action="store_true", help="draw the plan of one unit of each kind")
    p.add_argument("--width", type=int, default=None, help="console width")
    p.set_defaults(func=run_plan)


_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def _world_sizes(text: str) -> list[int]:
    """``"64"`` -> [64]; ``"8..64"`` -> [8, 16, 32, 64] (powers of two from A to B)."""
    try:
        if ".." in text:
            a, b = (int(x) for x in text.split(".."))
            if a < 1 or b < a:
                raise ValueError
            out, m = [], a
            while m <= b:
                out.append(m)
                m *= 2
            return out
        m = int(text)
        if m < 1:
            raise ValueError
        return [m]
    except ValueError:
        raise argparse.ArgumentTypeError(f"world size {text!r} must be a positive int or A..B (1 <= A <= B).") from None


def _max_buffers(text: str):
    if text == "auto":
        return text
    try:
        k = int(text)
        if k >= 1:
            return k
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"max buffers {text!r} must be 'auto' or a positive int.")


def _lower_bound(plan) -> int:
    lo = -(-plan.numel // plan.world_size)
    return -(-lo // plan.align) * plan.align


def forcing_leaves(plan, leaves=None):
    """Leaves (of ``leaves``, default all: one buffer) too long to cross only one rank boundary
    at their buffer's ideal shard size ``ceil(numel / m)``: each forces S to a multiple of its
    granule (see ``_search`` note).

    Returns:
        ``(leaves, step)``: the forcing leaves and the lcm of ``align`` and their granules.
    """
    leaves = plan.leaves if leaves is None else leaves
    S = max(-(-(-(-sum(l.numel for l in leaves) // plan.world_size)) // plan.align) * plan.align, 1)
    forced, step = [], plan.align
    for leaf in leaves:
        L = math.lcm(leaf.granule, plan.align)
        if leaf.numel > leaf.granule and leaf.numel > S + (S // L) * L:
            forced.append(leaf)
            step = math.lcm(step, leaf.granule)
    return forced, step


def _merged(params, k: int):
    return {f"layer{i}": params for i in range(k)}


def explain_padding(unit, plan, specs, *, granularity, strategy, align, repeated: int, threshold: float,
                    max_buffers=1):
    """Why a unit's padding is large and what would fix it, with numbers.

    Args:
        repeated: how many identical units of this kind the model has (merging up to that
            many layers per unit is offered as a fix).

    Returns:
        ``(why_lines, fixes)``.
    """
    from ragged.spec import Rows, make_plan

    m = plan.world_size
    lines = []
    if plan.num_buffers > 1:
        for b, (_, size) in enumerate(plan.buffers):
            members = [l for l in plan.leaves if plan.buffer_index(l.offset) == b]
            forced, step = forcing_leaves(plan, members)
            lines.append(f"buffer {b} ({len(members)} leaves, S_b={size}): "
                         + (f"{len(forced)} leaves longer than 2*S_b force S_b to a multiple of {step}" if forced
                            else "no leaf forces S_b"))
        forced = ()
    else:
        forced, step = forcing_leaves(plan)
    ideal = _lower_bound(plan)
    if plan.num_buffers > 1:
        pass  # one line per buffer above
    elif forced:
        shown = sorted(forced, key=lambda l: (-l.granule, l.path))[:4]
        listing = ", ".join(f"{l.path} {l.shape} granule {l.granule}" for l in shown)
        more = f", +{len(forced) - len(shown)} more" if len(forced) > len(shown) else ""
        lines.append(
            f"{len(forced)} leaves are longer than 2*S (S~{ideal}), so S must be a multiple of the lcm of their "
            f"granules = {step} elements ({listing}{more}); S={plan.shard_size} is {plan.shard_size / ideal:.2f}x "
            "the ideal."
        )
        from ragged.spec import _search

        lb = _search.order_free_lower_bound([l.numel for l in plan.leaves], [l.granule for l in plan.leaves],
                                            plan.align, m)
        if plan.shard_size == lb:
            lines.append("this S is the order-free lower bound: no leaf order and no planner pads less here.")
    else:
        lines.append(f"no leaf forces S (S={plan.shard_size}, ideal {ideal}); large granules relative to S cost the rest.")
    fixes = []
    # Smaller shard groups (HSDP: m = replicas x shard group), halving until under threshold.
    hsdp, d = [], 2
    while m % d == 0 and m // d >= 1:
        p2 = make_plan(unit.params, specs, world_size=m // d, strategy=strategy, align=align, max_buffers=max_buffers)
        hsdp.append(f"{m // d} ({d} replicas): {p2.overhead:.2%}")
        if p2.overhead * 100 <= threshold:
            break
        d *= 2
    if hsdp:
        fixes.append("shard group " + ", ".join(hsdp[:2] + (["..."] if len(hsdp) > 3 else []) + hsdp[2:][-1:]))
    if repeated > 1:
        per_unit = []
        for k in (k for k in (2, 4, 8, 16) if k <= repeated):
            p3 = make_plan(_merged(unit.params, k), _merged(specs, k) if not _is_leaf_spec(specs) else specs,
                           world_size=m, strategy=strategy, align=align, max_buffers=max_buffers)
            per_unit.append(f"{k}: {p3.overhead:.2%}")
            if p3.overhead * 100 <= threshold:
                break
        fixes.append(f"layers per unit at m={m} " + ", ".join(per_unit))
    if isinstance(granularity, Rows) and granularity.n > 1:
        p4 = make_plan(unit.params, Rows(1), world_size=m, strategy=strategy, align=align, max_buffers=max_buffers)
        fixes.append(f"granularity rows:1 at m={m}: {p4.overhead:.2%}")
    return lines, fixes


def _is_leaf_spec(specs) -> bool:
    from ragged.spec._granularity import GRANULARITY_TYPES

    return isinstance(specs, GRANULARITY_TYPES)


def run_plan(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from ragged import spec
    from ragged._models import model_units, unit_numel
    from ragged._viz import visualize

    console = Console(width=args.width)
    dtype = getattr(torch, _DTYPES[args.dtype])
    source = args.model or args.shapes
    try:
        units = model_units(source, dtype=dtype, layers_per_unit=args.layers_per_unit)
    except ValueError as err:
        console.print(f"[bold red]error:[/] {err}")
        return 2
    args.world_size = list(dict.fromkeys(m for group in args.world_size for m in group))

    kinds: dict[str, list] = {}
    for unit in units:
        kinds.setdefault(unit.kind, []).append(unit)
    gname = {spec.Rows: "rows", spec.Elements: "elements"}.get(type(args.granularity), "blocks")
    gtext = f"blocks:{args.granularity.r}x{args.granularity.c}" if gname == "blocks" else f"{gname}:{args.granularity.n}"
    console.print(
        f"[bold]{source}[/]: {len(units)} FSDP units ({', '.join(f'{len(v)} {k}' for k, v in kinds.items())}), "
        f"{sum(unit_numel(u) for u in units) / 1e9:.2f}B parameters, granularity {gtext}, strategy {args.strategy}, "
        f"dtype {args.dtype}, max buffers {args.max_buffers}"
    )
    totals = {m: {"numel": 0, "ragged": 0, "time": 0.0, **{p: 0 for p in spec.PEERS}} for m in args.world_size}
    warnings = []
    all_notes = set()
    for kind, members in kinds.items():
        table = Table(title=f"{kind} x{len(members)} ({unit_numel(members[0]) / 1e6:.1f}M elements, "
                            f"{len(__import__('ragged').pytree.leaves(members[0].params))} tensors per unit)",
                      header_style="bold", title_justify="left")
        for col in ("m", "S (ragged)", "buffers", "ragged", *spec.PEERS, "planner time"):
            table.add_column(col, justify="right")
        for m in args.world_size:
            t0 = time.perf_counter()
            plans = []
            for unit in members:
                specs, notes = unit_specs(unit.params, args.granularity)
                all_notes.update(f"{kind}: {n}" for n in notes)
                plans.append(spec.make_plan(unit.params, specs, world_size=m, strategy=args.strategy, align=args.align,
                                            max_buffers=1 if args.strategy == "naive" else args.max_buffers))
            elapsed = time.perf_counter() - t0
            peers = spec.peer_padding(members[0].params, m)
            tot = totals[m]
            tot["time"] += elapsed
            tot["numel"] += sum(p.numel for p in plans)
            tot["ragged"] += sum(p.padding for p in plans)
            for name, pp in peers.items():
                tot[name] += pp.padding * len(members)
            worst = max(plans, key=lambda p: p.overhead)
            style = "bold red" if worst.overhead * 100 > args.warn_above else "green"
            split = f" ({worst.split_blocks} split)" if worst.split_blocks else ""
            table.add_row(str(m), str(worst.shard_size), str(worst.num_buffers), f"[{style}]{worst.overhead:.2%}[/]{split}",
                          *(f"{peers[p].overhead:.2%}" for p in spec.PEERS), f"{elapsed * 1e3:.1f} ms")
            if worst.overhead * 100 > args.warn_above and args.strategy != "naive":
                specs, _ = unit_specs(members[0].params, args.granularity)
                lines, fixes = explain_padding(members[0], worst, specs, granularity=args.granularity,
                                               strategy=args.strategy, align=args.align,
                                               repeated=len(members), threshold=args.warn_above,
                                               max_buffers=args.max_buffers)
                warnings.append((kind, m, worst.overhead, lines, fixes))
        console.print(table)
        if args.visualize:
            specs, _ = unit_specs(members[0].params, args.granularity)
            plan = spec.make_plan(members[0].params, specs, world_size=args.world_size[0], strategy=args.strategy,
                                  align=args.align, max_buffers=1 if args.strategy == "naive" else args.max_buffers)
            console.print(visualize(plan, max_ranks=8))
    summary = Table(title="whole model (padding over all units)", header_style="bold", title_justify="left")
    for col in ("m", "ragged", *spec.PEERS, "planner time (all units)"):
        summary.add_column(col, justify="right")
    for m, tot in totals.items():
        n = tot["numel"] or 1
        summary.add_row(str(m), f"{tot['ragged'] / n:.2%}", *(f"{tot[p] / n:.2%}" for p in spec.PEERS),
                        f"{tot['time']:.3f} s")
    console.print(summary)
    for note in sorted(all_notes):
        console.print(f"[dim]note: {note}[/]")
    console.print("[dim]note: fsdp1 and zero3 cut the flat buffer anywhere (rows and blocks split across ranks); "
                  "fsdp2 pads dim 0 of every tensor to a multiple of m; megatron pads to m x lcm(row sizes).[/]")
    for kind, m, overhead, lines, fixes in warnings:
        console.print(f"[bold yellow]warning:[/] {kind} at m={m} with {gtext}: padding {overhead:.2%}.")
        for line in lines:
            console.print(f"  why: {line}")
        if fixes:
            console.print("  would fix it: " + "; ".join(fixes))
    return 0
