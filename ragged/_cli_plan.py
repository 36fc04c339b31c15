"""``python -m ragged plan``: its options, each checked as it is parsed (see [Note: bad
command-line values] in ``_cli.py``), and the run that plans every unit kind and prints the tables
(why a unit pads, and what would fix it: ``_cli_padding.py``).
"""

from __future__ import annotations

import argparse
import os
import time

from rich.table import Table

from ragged import spec
from ragged._cli import DTYPES, UsageError, float_above, float_at_least, int_at_least, parse_granularity, unit_specs
from ragged._cli_padding import explain_padding
from ragged._console import console as make_console
from ragged._models import MODELS, model_units, unit_numel
from ragged._pytree import pytree
from ragged._viz import visualize
from ragged.predict._command import run_predict
from ragged.predict._hardware import configure_hardware

__all__ = ["configure", "run_plan"]


# ---- options ---------------------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    """Registers the ``plan`` subcommand's options (see [Note: adding a subcommand] in ``__main__.py``)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=MODELS, help="a bundled model")
    src.add_argument("--shapes", metavar="JSON", type=_shapes_file, help="your own shapes file (format: ragged.models docs)")
    p.add_argument("--world-size", "-m", type=_world_sizes, nargs="+", required=True, metavar="N",
                   help="world size(s) m, e.g. 64 256 1024, or A..B for the powers of two from A to B (the shard "
                        "group, except under --mesh hsdp:R: R replica groups of m / R)")
    p.add_argument("--granularity", "-g", type=parse_granularity, default="rows:1",
                   help="rows:N | elements:N | blocks:RxC")
    p.add_argument("--strategy", choices=("dp", "exact", "naive"), default="dp", help="planner")
    p.add_argument("--max-buffers", type=_max_buffers, default="auto", metavar="K|auto",
                   help="buffers per unit: auto (up to 8, docs/planning.md) or an int (1: one buffer per unit)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16", help="buffer dtype")
    p.add_argument("--align", type=int_at_least(1), default=None,
                   help="offset alignment in elements (default: 16 bytes of --dtype)")
    p.add_argument("--layers-per-unit", type=int_at_least(1), default=1, help="decoder layers per FSDP unit")
    p.add_argument("--warn-above", type=float_at_least(0.0), default=3.0, metavar="PCT",
                   help="explain units whose padding exceeds this percentage")
    p.add_argument("--visualize", action="store_true", help="draw the plan of one unit of each kind")
    p.add_argument("--width", type=int_at_least(40), default=None,
                   help="console width (default: the terminal's; in a file or pipe, as wide as each table needs)")
    p.add_argument("--predict", action="store_true",
                   help="lower a training step at each world size: per-rank memory and communication, ragged vs the "
                        "FSDP2 and ZeRO-3 rules (--dtype is then the master dtype)")
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit", "muon", "soap", "shampoo"), nargs="+",
                   default=["adamw"], help="with --predict: one or several (each is lowered); soap and shampoo "
                   "precondition each block of a blocks:RxC granularity (docs/optimizers.md)")
    p.add_argument("--gather-format", choices=("none", "fp8", "int8", "mxfp8"), nargs="+", default=["none"],
                   help="with --predict: quantize the all-gather (several: one configuration each): fp8 in 128 x 128 "
                        "tiles, int8 in 32 x 32, mxfp8 in 1 x 32 blocks, wherever the blocks tile a matrix (docs/quantization.md)")
    p.add_argument("--compute-dtype", choices=("bf16", "fp32", "fp16"), default="bf16",
                   help="with --predict: the gathered (compute) dtype")
    p.add_argument("--mesh", type=_mesh, nargs="+", default=None, metavar="fsdp|hsdp:R",
                   help="with --predict: fsdp (one shard group of m ranks; the default) or hsdp:R (R replica groups "
                        "of m / R ranks); several are each lowered")
    p.add_argument("--seq-len", type=int_at_least(1), default=4096, help="with --predict: tokens per sequence")
    p.add_argument("--batch", type=int_at_least(1), default=1, help="with --predict: sequences per rank per step")
    p.add_argument("--checkpointing", action="store_true",
                   help="with --predict: full activation recomputation of every decoder layer")
    p.add_argument("--sweep", action="store_true",
                   help="predict every world size x mesh x optimizer and rank those whose peak fits --memory by "
                        "predicted step time (implies --predict)")
    p.add_argument("--memory", type=float_above(0.0), default=None, metavar="GIB",
                   help="with --sweep: memory per device in GiB")
    p.add_argument("--json", action="store_true", help="with --predict or --sweep: print the results as JSON")
    configure_hardware(p)
    p.set_defaults(func=run_plan)


def _shapes_file(text: str) -> str:
    """``--shapes``: an existing file (its content is checked by ``ragged.models``)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r} (a shapes JSON; format in help(ragged.models))")
    return text


def _world_sizes(text: str) -> list[int]:
    """``"64"`` -> [64]; ``"8..64"`` -> [8, 16, 32, 64] (powers of two from A to B)."""
    try:
        if ".." in text:
            a, b = (int(x) for x in text.split(".."))
            if a < 1 or b < a:
                raise ValueError
            return [a << k for k in range((b // a).bit_length())]
        m = int(text)
        if m < 1:
            raise ValueError
        return [m]
    except ValueError:
        raise argparse.ArgumentTypeError(f"world size {text!r} must be a positive int or A..B (1 <= A <= B)") from None


def _mesh(text: str) -> int:
    """``--mesh``: ``"fsdp"`` -> 1 replica group; ``"hsdp:R"`` -> R (R >= 2)."""
    kind, _, count = text.strip().lower().partition(":")
    if kind == "fsdp" and not count:
        return 1
    if kind == "hsdp" and count.isdigit() and int(count) >= 2:
        return int(count)
    raise argparse.ArgumentTypeError(f"mesh {text!r} must be fsdp or hsdp:R with R >= 2 replica groups (e.g. hsdp:8)")


def _max_buffers(text: str):
    if text == "auto":
        return text
    try:
        if int(text) >= 1:
            return int(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"max buffers {text!r} must be 'auto' or a positive int")


# ---- the run ---------------------------------------------------------------------------------
def run_plan(args) -> int:
    """``plan``: with ``--predict`` / ``--sweep`` the lowered steps (``ragged/predict/_command.py``),
    else every unit kind planned at each world size, its padding beside the peers' and why."""
    console = make_console(args.width)
    source = args.model or args.shapes
    args.world_size = list(dict.fromkeys(m for group in args.world_size for m in group))
    if (args.memory is None) == args.sweep:
        raise UsageError("--sweep needs --memory GIB (the memory per device the configurations must fit)" if args.sweep
                         else f"--memory {args.memory:g} applies to --sweep only; add --sweep to rank configurations")
    try:
        if args.predict or args.sweep:
            return run_predict(args, console)
        units = model_units(source, dtype=DTYPES[args.dtype], layers_per_unit=args.layers_per_unit)
    except UsageError:
        raise
    except ValueError as err:  # a malformed --shapes file, or one without what the estimates need
        raise UsageError(f"--{'model' if args.model else 'shapes'} {source}: {err}") from None
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
    warnings, notes = [], set()
    for kind, members in kinds.items():
        _plan_kind(args, console, kind, members, totals, warnings, notes)
    _print_totals(args, console, totals, notes)
    _print_warnings(args, console, gtext, warnings)
    return 0


def _plan_kind(args, console, kind: str, members: list, totals: dict, warnings: list, notes: set) -> None:
    """One unit kind at every world size: its table (the worst unit's padding beside the peers'),
    added into ``totals``; a padding over ``--warn-above`` explained into ``warnings``."""
    max_buffers = 1 if args.strategy == "naive" else args.max_buffers
    specs0, _ = unit_specs(members[0].params, args.granularity)  # what the warnings and the picture plan
    table = Table(title=f"{kind} x{len(members)} ({unit_numel(members[0]) / 1e6:.1f}M elements, "
                        f"{len(pytree.leaves(members[0].params))} tensors per unit)",
                  header_style="bold", title_justify="left")
    for col in ("m", "S (ragged)", "buffers", "ragged", *spec.PEERS, "planner time"):
        table.add_column(col, justify="right")
    for m in args.world_size:
        t0 = time.perf_counter()
        plans = []
        for unit in members:
            specs, unit_notes = unit_specs(unit.params, args.granularity)
            notes.update(f"{kind}: {n}" for n in unit_notes)
            plans.append(spec.make_plan(unit.params, specs, world_size=m, strategy=args.strategy, align=args.align,
                                        max_buffers=max_buffers))
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
            lines, fixes, reductions = explain_padding(members[0], worst, specs0, granularity=args.granularity,
                                                       strategy=args.strategy, align=args.align,
                                                       repeated=len(members), threshold=args.warn_above,
                                                       max_buffers=args.max_buffers)
            warnings.append((kind, m, worst.overhead, lines, fixes, reductions))
    console.print(table)
    if args.visualize:
        plan = spec.make_plan(members[0].params, specs0, world_size=args.world_size[0], strategy=args.strategy,
                              align=args.align, max_buffers=max_buffers)
        console.print(visualize(plan, max_ranks=8))


def _print_totals(args, console, totals: dict, notes: set) -> None:
    """The whole model's padding at each world size, and the notes on how specs were applied."""
    summary = Table(title="whole model (padding over all units)", header_style="bold", title_justify="left")
    for col in ("m", "ragged", *spec.PEERS, "planner time (all units)"):
        summary.add_column(col, justify="right")
    for m, tot in totals.items():
        n = tot["numel"] or 1
        summary.add_row(str(m), f"{tot['ragged'] / n:.2%}", *(f"{tot[p] / n:.2%}" for p in spec.PEERS),
                        f"{tot['time']:.3f} s")
    console.print(summary)
    for note in sorted(notes):
        console.print(f"[dim]note: {note}[/]")
    console.print("[dim]note: fsdp1 and zero3 cut the flat buffer anywhere (rows and blocks split across ranks); "
                  "fsdp2 pads dim 0 of every tensor to a multiple of m; megatron pads to m x lcm(row sizes).[/]")


def _print_warnings(args, console, gtext: str, warnings: list) -> None:
    """Each unit kind whose padding is over ``--warn-above``: why, and what would fix or reduce it."""
    for kind, m, overhead, lines, fixes, reductions in warnings:
        console.print(f"[bold yellow]warning:[/] {kind} at m={m} with {gtext}: padding {overhead:.2%}.")
        for line in lines:
            console.print(f"  why: {line}")
        if fixes:
            console.print(f"  would fix it (<= {args.warn_above:g}%): " + "; ".join(fixes))
        if reductions:
            console.print("  would reduce it: " + "; ".join(reductions))
        if not fixes and not reductions:
            console.print("  no fix found: smaller shard groups, more layers per unit and rows:1 (if coarser) "
                          "all plan to about the same padding.")
