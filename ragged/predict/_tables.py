"""``plan --predict``'s output: the rows of :func:`ragged.predict._command.predict_all` as rich
tables (``--sweep``'s ranking: ``_sweep.py``)."""

from __future__ import annotations

from rich.table import Table

__all__ = ["gib", "print_predict", "time_table"]


def gib(n) -> str:
    """Bytes as GiB, two decimals, thousands separated."""
    return f"{n / 2**30:,.2f}"


def print_predict(results, args, console) -> None:
    """``plan --predict``'s tables: each system's persistent state and communication, ragged's step
    (peak, collectives, lowering time), the step time, and the assumptions they rest on."""
    source = args.model or args.shapes
    console.print(f"[bold]{source}[/]: per-rank prediction, master {args.dtype}, compute {args.compute_dtype}, "
                  f"max buffers {args.max_buffers}, {args.batch} x {args.seq_len} tokens per rank"
                  f"{', checkpointing' if args.checkpointing else ''} (GiB; bytes per step)")
    table = Table(title="persistent state per rank and communication per step", header_style="bold",
                  title_justify="left")
    for col in ("m", "mesh", "optimizer", "system", "persistent GiB", "params", "optimizer", "other",
                "all-gather GiB/step", "reduce-scatter GiB/step", "largest gathered unit GiB"):
        table.add_column(col, justify="right")
    for r in results:
        for system, s in r["systems"].items():
            cat = s["by_category"]
            opt = sum(v for k, v in cat.items() if k.startswith("optimizer."))
            other = s["persistent_bytes"] - cat.get("param_shards", 0) - opt
            table.add_row(str(r["world_size"]), r["mesh"], r["optimizer"], system, gib(s["persistent_bytes"]),
                          gib(cat.get("param_shards", 0)), gib(opt), gib(other), gib(s["gather_bytes"]),
                          gib(s["reduce_bytes"]), gib(s["largest_gathered_bytes"]))
    console.print(table)
    steps = Table(title="ragged's step per rank", header_style="bold", title_justify="left")
    kinds = ("activations", "gathered", "grad_buffers", "reduce_copies", "grad_shards")
    for kind in ("wire_scratch", "scratch_pool"):  # a quantized collective's, at the peak
        if any(r["peak_parts"].get(kind) for r in results):
            kinds += (kind,)
    for col in ("m", "mesh", "optimizer", "peak GiB", "peak at", " / ".join(k.replace("_", " ") for k in kinds) + " GiB",
                "collectives (calls)", "lowering s"):
        steps.add_column(col, justify="right")
    for r in results:
        p = r["peak_parts"]
        steps.add_row(str(r["world_size"]), r["mesh"], r["optimizer"], gib(r["peak_bytes"]), " ".join(r["peak_at"]),
                      " / ".join(gib(p.get(k, 0)) for k in kinds),
                      ", ".join(f"{c['kind']}@{c['axis']} {c['calls']}" for c in r["collectives"]),
                      f"{r['build_seconds'] + r['lower_seconds']:.1f}")
    console.print(steps)
    console.print(time_table(results))
    for note in results[0]["assumed"]:
        console.print(f"[dim]assumed: {note}[/]")
    if "adamw8bit" in args.optimizer and not any(k.endswith("_codes") and v for r in results
                                                 for k, v in r["by_category"].items()):
        console.print("[dim]note: adamw_8bit quantizes blocks:RxC / elements:N granularities only; with this "
                      "granularity every moment stays fp32 (pass --granularity blocks:128x128).[/]")
    if {"soap", "shampoo"} & set(args.optimizer) and not any(k.endswith("left_stats") and v for r in results
                                                             for k, v in r["by_category"].items()):
        console.print("[dim]note: soap and shampoo precondition the blocks of a blocks:RxC granularity only; with "
                      "this granularity every leaf takes their Adam fallback (pass --granularity blocks:128x128).[/]")
    if {"muon", "soap", "shampoo"} & set(args.optimizer):
        console.print("[dim]note: the fsdp2 and zero3 rows carry torch.optim.AdamW's state for muon, soap and shampoo "
                      "(their state under those systems is not modelled).[/]")


def time_table(results, *, title: str = "step time per rank (ASSUMED hardware: see the assumed lines)"):
    """The step's parts per configuration (``estimate_time``): total, compute, the network's busy
    time per collective kind, the communication compute did not hide, and each axis' link."""
    table = Table(title=title, header_style="bold", title_justify="left")
    for col in ("m", "mesh", "optimizer", "step s", "compute s", "all-gather s", "reduce-scatter s", "all-reduce s",
                "exposed comm s", "shard link (alpha ms, GB/s)", "replica link"):
        table.add_column(col, justify="right")
    for r in results:
        t = r["time"]
        links = [f"{link['alpha'] * 1e3:.2f}, {link['bandwidth'] / 1e9:g}" for link in t["links"].values()]
        table.add_row(str(r["world_size"]), r["mesh"], r["optimizer"], f"{t['seconds']:.3f}", f"{t['compute']:.3f}",
                      *(f"{t['comm'].get(k, 0.0):.3f}" for k in ("all_gather", "reduce_scatter", "all_reduce")),
                      f"{t['exposed_comm']:.3f}", links[0], links[1] if len(links) > 1 else "")
    return table
