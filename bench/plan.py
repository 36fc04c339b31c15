"""Planner benchmark: time and padding of every strategy on real model shapes, next to peers.

For each bundled model (one FSDP unit per decoder layer, plus embedding and head units; meta
tensors only), each granularity (rows:1, rows:16, rows:128, blocks:128x128) and each shard
group size m (8 ... 1024):

* whole-model padding of ragged's ``dp``, ``exact`` (tree order), ``naive`` plans (naive:
  plus how many granules it splits) and ``auto`` (``dp`` with ``max_buffers="auto"``: several
  buffers per unit), and of FSDP2 / FSDP1 / ZeRO-3 / Megatron-FSDP; ``bound``
  is the order-free lower bound (``_search.order_free_lower_bound``): no planner, in any
  order, pads less;
* the worst layer's ``dp`` padding per layer kind (the paper's Figure 11 view);
* the time to plan the whole model (every unit; identical units hit the plan memo) with
  cold caches, on one pinned core, median of ``--repeat`` runs at the largest m.

It ends with the done-when checks of the planning issues: whole model at m=1024 < 1 s (dp, and
auto), dp within 0.1 percentage point of exact on every cell, GPT-OSS / DeepSeek layers at rows:1
and rows:16 below 3% for every m <= 256 (dp), auto never above dp.

Usage::

    python3 bench/plan.py                      # full sweep (~1-2 min on one core)
    python3 bench/plan.py --models gpt-oss-120b --world-sizes 64 1024 --granularities rows:1
    python3 bench/plan.py --json out.json      # also write every cell as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
GRANULARITIES = ("rows:1", "rows:16", "rows:128", "blocks:128x128")
STRATEGIES = ("dp", "exact", "naive", "auto")  # auto: dp with max_buffers="auto"


def _clear_caches():
    from ragged.spec import _planning, _search

    _planning._PLAN_MEMO.clear()
    _planning._solve.cache_clear()
    _planning._solve_range.cache_clear()
    for cached in (_search._prepared, _search._arrays_cached, _search._release_threshold):
        cached.cache_clear()


def plan_model(units, granularity, m, strategy, unit_specs):
    """Plans every unit; returns (plans, seconds). Caches are cleared first (cold)."""
    from ragged import spec

    specs = [unit_specs(u.params, granularity)[0] for u in units]  # outside the timed region
    _clear_caches()
    options = dict(strategy="dp", max_buffers="auto") if strategy == "auto" else dict(strategy=strategy)
    t0 = time.perf_counter()
    plans = [spec.make_plan(u.params, s, world_size=m, **options) for u, s in zip(units, specs)]
    return plans, time.perf_counter() - t0


def sweep(models, granularities, world_sizes, strategies):
    from ragged import spec
    from ragged._cli import parse_granularity, unit_specs
    from ragged._models import model_units
    from ragged.spec import _search

    cells = []
    for model in models:
        units = model_units(model)
        peer_cache = {}
        for gtext in granularities:
            g = parse_granularity(gtext)
            for m in world_sizes:
                cell = {"model": model, "granularity": gtext, "m": m}
                bound_cache = {}
                numel = None
                for strategy in strategies:
                    plans, seconds = plan_model(units, g, m, strategy, unit_specs)
                    numel = sum(p.numel for p in plans)
                    cell[strategy] = sum(p.padding for p in plans) / numel
                    cell[f"{strategy}_time"] = seconds
                    if strategy == "naive":
                        cell["naive_split"] = sum(p.split_blocks for p in plans)
                    if strategy in ("dp", "auto"):
                        worst = {}
                        for u, p in zip(units, plans):
                            if u.kind not in ("embed", "head"):
                                worst[u.kind] = max(worst.get(u.kind, 0.0), p.overhead)
                        cell[f"{strategy}_worst_layer"] = worst
                    if strategy == "dp":
                        bound_pad, at_bound = 0, 0
                        for p in plans:
                            key = (tuple(l.numel for l in p.leaves), tuple(l.granule for l in p.leaves), p.align)
                            if key not in bound_cache:
                                bound_cache[key] = _search.order_free_lower_bound(*key, m)
                            lb = bound_cache[key]
                            bound_pad += m * lb - p.numel
                            at_bound += p.shard_size == lb
                        cell["bound"] = bound_pad / numel
                        cell["dp_at_bound"] = (at_bound, len(plans))
                if m not in peer_cache:
                    tot = dict.fromkeys(spec.PEERS, 0)
                    for u in units:
                        for name, pp in spec.peer_padding(u.params, m).items():
                            tot[name] += pp.padding
                    peer_cache[m] = {k: v / numel for k, v in tot.items()}
                cell.update(peer_cache[m])
                cells.append(cell)
                print(f"  {model} {gtext} m={m}: dp {cell.get('dp', float('nan')):.3%} "
                      f"({cell.get('dp_time', 0) * 1e3:.0f} ms)", file=sys.stderr, flush=True)
    return cells


def timing(models, granularities, m, repeat, strategy="dp"):
    """Median cold whole-model planning time at ``m`` (``strategy``: "dp" or "auto")."""
    from ragged._cli import parse_granularity, unit_specs
    from ragged._models import model_units

    out = {}
    for model in models:
        units = model_units(model)
        for gtext in granularities:
            g = parse_granularity(gtext)
            times = [plan_model(units, g, m, strategy, unit_specs)[1] for _ in range(repeat)]
            out[(model, gtext)] = (statistics.median(times), min(times), max(times), len(units))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama3-70b", "gpt-oss-120b", "deepseek-v3-671b"])
    parser.add_argument("--granularities", nargs="+", default=list(GRANULARITIES))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--repeat", type=int, default=5, help="timing runs per cell (median)")
    parser.add_argument("--all-cores", action="store_true", help="do not pin to one core")
    parser.add_argument("--json", help="write every cell to this JSON file")
    args = parser.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not args.all_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from ragged._console import console as make_console
    from rich.table import Table

    from ragged import spec

    console = make_console(min_width=140)
    cells = sweep(args.models, args.granularities, args.world_sizes, args.strategies)

    # ---- per model: whole-model padding, every strategy and peer ----------------------------
    for model in args.models:
        table = Table(title=f"{model}: whole-model padding (all units) and cold dp planning time",
                      header_style="bold", title_justify="left")
        bound_cols = ("bound",) if "dp" in args.strategies else ()
        for col in ("granularity", "m", *bound_cols, *args.strategies, *spec.PEERS, "dp time"):
            table.add_column(col, justify="right")
        for c in (c for c in cells if c["model"] == model):
            vals = []
            for s in args.strategies:
                v = f"{c[s]:.2%}"
                if s == "naive" and c.get("naive_split"):
                    v += f" ({c['naive_split']} split)"
                vals.append(v)
            bounds = (f"{c['bound']:.2%}",) if "dp" in args.strategies else ()
            table.add_row(c["granularity"], str(c["m"]), *bounds, *vals, *(f"{c[p]:.2%}" for p in spec.PEERS),
                          f"{c.get('dp_time', float('nan')) * 1e3:.0f} ms")
        console.print(table)

    # ---- Figure 11: worst layer of each kind, dp ------------------------------------------
    for strategy in (s for s in ("dp", "auto") if s in args.strategies):
        fig = Table(title=f"worst layer padding by layer kind ({strategy}), the paper's Figure 11 view",
                    header_style="bold", title_justify="left")
        fig.add_column("model / kind")
        fig.add_column("granularity")
        for m in args.world_sizes:
            fig.add_column(str(m), justify="right")
        for model in args.models:
            kinds = sorted({k for c in cells if c["model"] == model for k in c[f"{strategy}_worst_layer"]})
            for kind in kinds:
                for gtext in args.granularities:
                    row = []
                    for m in args.world_sizes:
                        c = next(c for c in cells if c["model"] == model and c["granularity"] == gtext and c["m"] == m)
                        v = c[f"{strategy}_worst_layer"][kind]
                        row.append(f"[{'red' if v > 0.03 else 'green'}]{v:.2%}[/]")
                    fig.add_row(f"{model} / {kind}", gtext, *row)
        console.print(fig)

    # ---- timing at the largest m -----------------------------------------------------------
    m_max = max(args.world_sizes)
    timed = [t for t in ("dp", "auto") if t in args.strategies]
    all_times = {t: timing(args.models, args.granularities, m_max, args.repeat, t) for t in timed}
    for t, times in all_times.items():
        tt = Table(title=f"whole-model {t} planning time at m={m_max}, cold caches, "
                         f"{'one core' if not args.all_cores else 'all cores'}, {args.repeat} runs",
                   header_style="bold", title_justify="left")
        for col in ("model", "units", *args.granularities):
            tt.add_column(col, justify="right")
        for model in args.models:
            tt.add_row(model, str(times[(model, args.granularities[0])][3]),
                       *(f"{times[(model, g)][0]:.3f} s (max {times[(model, g)][2]:.3f})" for g in args.granularities))
        console.print(tt)

    # ---- done-when checks ------------------------------------------------------------------
    for t, times in all_times.items():
        worst_time = max(v[0] for v in times.values())
        console.print(f"check: whole model at m={m_max} planned ({t}) in <= {worst_time:.3f} s (median, worst cell): "
                      + ("[green]PASS[/] (< 1 s)" if worst_time < 1 else "[red]FAIL[/] (>= 1 s)"))
    if "dp" in args.strategies and "auto" in args.strategies:
        above = [c for c in cells if c["auto"] > c["dp"] + 1e-12]
        console.print(f"check: auto pads no more than dp on all {len(cells)} cells: "
                      + ("[green]PASS[/]" if not above else f"[red]FAIL[/] ({len(above)} cells)"))
    if "dp" in args.strategies and "exact" in args.strategies:
        gap = max((c["dp"] - c["exact"]) * 100 for c in cells)
        gain = max((c["exact"] - c["dp"]) * 100 for c in cells)
        console.print(f"check: dp - exact over {len(cells)} cells: max {gap:+.4f} percentage points "
                      + ("[green]PASS[/] (<= 0.1)" if gap <= 0.1 else "[red]FAIL[/]")
                      + f"; dp's order search gains up to {gain:.3f} pp over exact(tree order)")
    if "dp" in args.strategies:
        reached = sum(c["dp_at_bound"][0] for c in cells)
        total_units = sum(c["dp_at_bound"][1] for c in cells)
        console.print(f"info (not a check): dp reaches the order-free lower bound ('bound' column: no order or planner can do "
                      f"better) on {reached} of {total_units} unit plans; max gap "
                      f"{max((c['dp'] - c['bound']) * 100 for c in cells):.4f} pp of whole-model padding")
    for strategy in (s for s in ("dp", "auto") if s in args.strategies):
        # The paper's claim (Figure 11) is about MoE layers; the other kinds are listed, not judged
        # (dense layers at coarse granules: leaves longer than 2*S_b force S_b, docs/planning.md).
        bad, other = [], []
        worst = 0.0
        checked = 0
        for c in cells:
            if c["model"] in ("gpt-oss-120b", "deepseek-v3-671b") and c["granularity"] in ("rows:1", "rows:16") and c["m"] <= 256:
                for kind, v in c[f"{strategy}_worst_layer"].items():
                    where = f"{c['model']}/{kind} {c['granularity']} m={c['m']}: {v:.2%}"
                    if kind != "moe_layer":
                        if v >= 0.03:
                            other.append(where)
                        continue
                    checked += 1
                    worst = max(worst, v)
                    if v >= 0.03:
                        bad.append(where)
        if not checked:
            console.print(f"check: GPT-OSS / DeepSeek MoE layers < 3% ({strategy}), rows:1 and rows:16, m <= 256: n/a "
                          "(no such cell in this sweep)")
        else:
            console.print(f"check: GPT-OSS / DeepSeek MoE layers < 3% ({strategy}), rows:1 and rows:16, m <= 256: worst "
                          f"{worst:.2%} over {checked} cells: " + ("[green]PASS[/]" if not bad else f"[red]FAIL[/] ({len(bad)} >= 3%)"))
        for line in bad:
            console.print(f"  {line}")
        if other:
            console.print(f"info (not a check, {strategy}): {len(other)} other (layer kind, cell) pairs there are >= 3%, worst "
                          f"{max(other, key=lambda w: float(w.rsplit(' ', 1)[1][:-1]))}: leaves longer than 2*S force S "
                          "(docs/planning.md); e.g. a smaller shard group fixes them (python -m ragged plan says which)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": cells, "timing": {f"{t} {k[0]} {k[1]}": v[0] for t, times in all_times.items()
                                                  for k, v in times.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
