"""``python -m ragged plan --predict``: a bundled (or ``--shapes``) model lowered at each world size
on an abstract comm, with ragged's per-rank memory and communication next to the FSDP2 and ZeRO-3
rules (see [Note: lowering a step] in ``ragged/fsdp/_lower.py`` and [Note: peer rules of a lowered
step] in ``ragged/fsdp/_lower_peers.py``)."""

from __future__ import annotations

import collections
import json
import time

__all__ = ["bundled_step", "predict_rows", "run_predict"]

def bundled_step(source, world_size: int, *, optimizer: str = "adamw", dtype: str = "fp32",
                 compute_dtype: str = "bf16", granularity=None, strategy: str = "dp", align=None,
                 max_buffers="auto", layers_per_unit: int = 1):
    """A step over ``source``'s units (``ragged.models.model_units``) on ``rg.collectives.abstract``.

    Examples:
        >>> step = bundled_step("gpt-oss-120b", 1024)
        >>> len(step.units), step.units.names[:2], step.comm.world_size
        (38, ('embed', 'layers.0'), 1024)
    """
    import torch

    import ragged as rg
    from ragged import fsdp, spec
    from ragged._cli_plan import _DTYPES, unit_specs
    from ragged._models import model_units

    master = getattr(torch, _DTYPES[dtype])
    tree = collections.OrderedDict((u.name, collections.OrderedDict(u.params) if isinstance(u.params, dict) else u.params)
                                   for u in model_units(source, dtype=master, layers_per_unit=layers_per_unit))
    granularity = spec.Rows(1) if granularity is None else granularity

    def specs(path, t):
        leaf_specs, _ = unit_specs({"x": t}, granularity)
        return leaf_specs["x"] if isinstance(leaf_specs, dict) else leaf_specs

    units = fsdp.make_units(tree, world_size=world_size, groups=lambda path: path[2:path.index("']")], specs=specs,
                            strategy=strategy, align=align, max_buffers=1 if strategy == "naive" else max_buffers)
    opt = rg.optim.adamw_8bit(1e-3) if optimizer == "adamw8bit" else rg.optim.adamw(1e-3)
    return fsdp.make_step(units, lambda params, batch: None, opt, rg.collectives.abstract(world_size),
                          policy=fsdp.MixedPrecision(compute_dtype=getattr(torch, _DTYPES[compute_dtype])))


def predict_rows(step) -> dict:
    """Everything ``--predict`` prints for one lowered step, as plain values (``--json``)."""
    from ragged.fsdp._lower_peers import compare

    t0 = time.perf_counter()
    lowered = step.lower()
    mem, cost = lowered.memory_analysis(), lowered.cost_analysis()
    peers = compare(lowered)
    return {
        "world_size": step.comm.world_size,
        "units": len(step.units),
        "persistent_bytes": mem.persistent_bytes,
        "by_category": mem.by_category,
        "max_rank": mem.max_rank,
        "min_rank": mem.min_rank,
        "min_bytes": mem.min_bytes,
        "peak_bytes": mem.peak_bytes,
        "peak_at": list(mem.peak_at),
        "peak_parts": mem.peak_parts,
        "collectives": [dict(kind=c.kind, axis=c.axis, calls=c.calls, bytes=c.bytes) for c in cost.collectives],
        "systems": {r.system: dict(persistent_bytes=r.persistent_bytes, by_category=r.by_category,
                                   gather_bytes=r.gather_bytes, reduce_bytes=r.reduce_bytes,
                                   largest_gathered_bytes=r.largest_gathered_bytes) for r in peers},
        "assumed": list(dict.fromkeys(mem.assumed + cost.assumed)),
        "lower_seconds": time.perf_counter() - t0,
    }


def _gib(n) -> str:
    return f"{n / 2**30:,.2f}"


def run_predict(args, console) -> int:
    from rich.table import Table

    source = args.model or args.shapes
    results = []
    for m in args.world_size:
        t0 = time.perf_counter()
        step = bundled_step(source, m, optimizer=args.optimizer, dtype=args.dtype, compute_dtype=args.compute_dtype,
                            granularity=args.granularity, strategy=args.strategy, align=args.align,
                            max_buffers=args.max_buffers, layers_per_unit=args.layers_per_unit)
        build = time.perf_counter() - t0
        row = predict_rows(step)
        row.update(model=str(source), optimizer=args.optimizer, dtype=args.dtype, compute_dtype=args.compute_dtype,
                   build_seconds=build)
        results.append(row)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    console.print(f"[bold]{source}[/]: per-rank prediction, optimizer {args.optimizer}, master {args.dtype}, "
                  f"compute {args.compute_dtype}, max buffers {args.max_buffers} (GiB; bytes per step)")
    table = Table(title="persistent state per rank and communication per step", header_style="bold",
                  title_justify="left")
    for col in ("m", "system", "persistent GiB", "params", "optimizer", "other", "all-gather GiB/step",
                "reduce-scatter GiB/step", "largest gathered unit GiB"):
        table.add_column(col, justify="right")
    for r in results:
        for system, s in r["systems"].items():
            cat = s["by_category"]
            opt = sum(v for k, v in cat.items() if k.startswith("optimizer."))
            other = s["persistent_bytes"] - cat.get("param_shards", 0) - opt
            table.add_row(str(r["world_size"]), system, _gib(s["persistent_bytes"]), _gib(cat.get("param_shards", 0)),
                          _gib(opt), _gib(other), _gib(s["gather_bytes"]), _gib(s["reduce_bytes"]),
                          _gib(s["largest_gathered_bytes"]))
    console.print(table)
    steps = Table(title="ragged's step per rank", header_style="bold", title_justify="left")
    for col in ("m", "peak GiB", "peak at", "gathered / grad buffers / reduce copies / grad shards GiB",
                "collectives (calls)", "lowering s"):
        steps.add_column(col, justify="right")
    for r in results:
        p = r["peak_parts"]
        steps.add_row(str(r["world_size"]), _gib(r["peak_bytes"]), " ".join(r["peak_at"]),
                      " / ".join(_gib(p[k]) for k in ("gathered", "grad_buffers", "reduce_copies", "grad_shards")),
                      ", ".join(f"{c['kind']} {c['calls']}" for c in r["collectives"]),
                      f"{r['build_seconds'] + r['lower_seconds']:.1f}")
    console.print(steps)
    for note in results[0]["assumed"]:
        console.print(f"[dim]assumed: {note}[/]")
    if args.optimizer == "adamw8bit" and not any(k.endswith("_codes") and v for k, v in results[0]["by_category"].items()):
        console.print("[dim]note: adamw_8bit quantizes blocks:RxC / elements:N granularities only; with this "
                      "granularity every moment stays fp32 (pass --granularity blocks:128x128).[/]")
    return 0
