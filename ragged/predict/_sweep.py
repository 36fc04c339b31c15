"""``python -m ragged plan --predict --sweep --memory GIB``: the configurations (world sizes x meshes
x optimizers) whose predicted peak fits a memory budget per device, fastest predicted step first."""

from __future__ import annotations

import json

from rich.table import Table

from ragged.predict._tables import gib, time_table

__all__ = ["rank", "print_sweep"]


def rank(rows, budget_bytes: int) -> tuple[list, list]:
    """``(ranked, dropped)``: the rows whose ``peak_bytes`` fits ``budget_bytes``, by predicted step
    time then by peak (then world size and mesh, for a stable order), and the rest by peak.

    Examples:
        >>> row = lambda name, peak, s: {"name": name, "peak_bytes": peak, "time": {"seconds": s}, "world_size": 8,
        ...                              "replicas": 1, "optimizer": "adamw"}
        >>> ranked, dropped = rank([row("a", 50, 2.0), row("b", 90, 1.0), row("c", 40, 2.0), row("d", 10, 3.0)], 80)
        >>> [r["name"] for r in ranked], [r["name"] for r in dropped]
        (['c', 'a', 'd'], ['b'])
    """
    fits = [r for r in rows if r["peak_bytes"] <= budget_bytes]
    ranked = sorted(fits, key=lambda r: (r["time"]["seconds"], r["peak_bytes"], r["world_size"], r["replicas"],
                                         r["optimizer"]))
    dropped = sorted((r for r in rows if r["peak_bytes"] > budget_bytes), key=lambda r: r["peak_bytes"])
    return ranked, dropped


def print_sweep(rows, memory_gib: float, console, *, as_json: bool = False) -> int:
    """Prints the ranked configurations (a table, or JSON ``{"budget_bytes", "ranked", "dropped"}``)."""
    budget = int(memory_gib * 2**30)
    ranked, dropped = rank(rows, budget)
    if as_json:
        print(json.dumps({"budget_bytes": budget, "ranked": ranked, "dropped": dropped}, indent=1))
        return 0
    table = Table(title=f"{len(ranked)} of {len(rows)} configurations fit {memory_gib:g} GiB per device, fastest "
                        "predicted step first", header_style="bold", title_justify="left")
    for col in ("rank", "m", "mesh", "shard group", "optimizer", "step s", "compute s", "exposed comm s",
                "peak GiB", "persistent GiB", "peak at"):
        table.add_column(col, justify="right")
    for i, r in enumerate(ranked, 1):
        t = r["time"]
        table.add_row(str(i), str(r["world_size"]), r["mesh"], str(r["shard_size"]), r["optimizer"],
                      f"{t['seconds']:.3f}", f"{t['compute']:.3f}", f"{t['exposed_comm']:.3f}", gib(r["peak_bytes"]),
                      gib(r["persistent_bytes"]), " ".join(r["peak_at"]))
    console.print(table)
    for r in dropped:
        console.print(f"dropped: m={r['world_size']} {r['mesh']} {r['optimizer']}: peak {gib(r['peak_bytes'])} GiB > "
                      f"{memory_gib:g} GiB")
    if ranked:
        console.print(time_table(ranked, title="the fitting configurations' step parts (ASSUMED hardware)"))
    for note in rows[0]["assumed"]:
        console.print(f"[dim]assumed: {note}[/]")
    return 0
