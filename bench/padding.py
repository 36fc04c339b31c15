"""Figure-11-style padding sweep on real model shapes: ragged's buffer policies vs every peer's rule.

For each bundled model (``ragged.models``: Llama-3-70B, GPT-OSS-120B, DeepSeek-V3-671B; one
FSDP unit per decoder layer plus embedding and head), each shard group size ``m`` and each
granularity (1x, 16x, 128x rows and 128x128 blocks, as in the paper's Figure 11), the padding of
ragged's plans under three buffer policies, next to FSDP2, FSDP1, ZeRO-3 and Megatron-FSDP
(``spec.peer_padding``):

* ``one``: ``make_plan(max_buffers=1)``, one buffer per unit (the default ``dp`` planner);
* ``granule``: one buffer per distinct granule of the unit, each planned by ``dp``
  (independently of the planner's own search: a baseline);
* ``auto``: ``make_plan(max_buffers="auto")`` (at most 8 buffers per unit, the cost model of
  ``ragged/spec/_buffers.py``), with the buffers it chose (most per unit, and in total).

Padding is what every rank all-gathers on top of the parameters: ``(m * per-rank elements -
elements) / elements``, summed over all units (whole model), and per layer kind (worst layer,
the Figure-11 view). The script ends with the checks of the multi-buffer issue, cell by cell.

Usage::

    python3 bench/padding.py                                   # 3 models x 4 granularities, m = 8 ... 1024
    python3 bench/padding.py --models gpt-oss-120b --world-sizes 64 256 --granularities rows:1 blocks:128x128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
GRANULARITIES = ("rows:1", "rows:16", "rows:128", "blocks:128x128")
POLICIES = ("one", "granule", "auto")


def _granule_padding(params, specs, m, dtype):
    """One dp buffer per distinct granule of the unit (flat ``{name: tensor}`` params)."""
    from ragged import spec

    one = spec.make_plan(params, specs, world_size=m, dtype=dtype)
    key = {f"[{k!r}]": k for k in params}
    groups: dict[int, list[str]] = {}
    for leaf in one.leaves:
        groups.setdefault(leaf.granule, []).append(key[leaf.path])
    spec_of = {key[l.path]: l.granularity for l in one.leaves}
    return sum(spec.make_plan({k: params[k] for k in ks}, {k: spec_of[k] for k in ks}, world_size=m, dtype=dtype).padding
               for ks in groups.values())


def sweep(models, world_sizes, granularities, *, dtype=torch.bfloat16):
    """One row per (model, granularity, m): padding per policy and peer, buffers, timing."""
    from ragged import spec
    from ragged._cli import parse_granularity, unit_specs
    from ragged._models import model_units

    rows = []
    for model in models:
        units = model_units(model, dtype=dtype)
        kinds: dict[str, list] = {}
        for u in units:
            kinds.setdefault(u.kind, []).append(u)
        numel = sum(math.prod(t.shape) for u in units for t in u.params.values())
        peers = {}
        for m in world_sizes:
            peers[m] = {p: sum(spec.peer_padding(ms[0].params, m, peers=(p,))[p].padding * len(ms)
                               for ms in kinds.values()) / numel for p in spec.PEERS}
        for gtext in granularities:
            g = parse_granularity(gtext)
            specs = {k: unit_specs(ms[0].params, g)[0] for k, ms in kinds.items()}
            for m in world_sizes:
                row = {"model": model, "granularity": gtext, "m": m, **peers[m], "kinds": {}}
                for policy in POLICIES:
                    pad, most, total, t0 = 0, 0, 0, time.perf_counter()
                    for kind, members in kinds.items():  # units of one kind have identical shapes
                        params = members[0].params
                        if policy == "granule":
                            p = _granule_padding(params, specs[kind], m, dtype)
                            n = sum(math.prod(t.shape) for t in params.values())
                        else:
                            plan = spec.make_plan(params, specs[kind], world_size=m, dtype=dtype,
                                                  max_buffers=1 if policy == "one" else "auto")
                            p, n = plan.padding, plan.numel
                            most, total = max(most, plan.num_buffers), total + plan.num_buffers * len(members)
                        pad += p * len(members)
                        if kind not in ("embed", "head"):
                            row["kinds"].setdefault(kind, {})[policy] = p / n
                    row[policy] = pad / numel
                    if policy == "auto":
                        row["auto_s"], row["buffers_max"], row["buffers_total"] = time.perf_counter() - t0, most, total
                rows.append(row)
                print(f"  {model} {gtext} m={m}: one {row['one']:.3%} granule {row['granule']:.3%} auto {row['auto']:.3%}"
                      f" ({row['buffers_max']} buffers max, {row['auto_s'] * 1e3:.0f} ms)", file=sys.stderr, flush=True)
    return rows


def table(rows):
    from rich.table import Table

    from ragged import spec

    t = Table(title="whole-model padding (all-gathered elements over parameters): ragged's buffer policies vs peers' "
                    "rules; buffers = most per unit / total over the model (auto)", title_justify="left")
    for col in ("model", "granularity", "m", *POLICIES, "buffers", *spec.PEERS):
        t.add_column(col, justify="left" if col in ("model", "granularity") else "right")
    prev = None
    for r in rows:
        best_peer = min(r[p] for p in spec.PEERS)
        cells = []
        for c in POLICIES:
            style = "green" if r[c] <= best_peer else ("red" if r[c] > 0.10 else "")
            cells.append(f"[{style}]{r[c]:.3%}[/]" if style else f"{r[c]:.3%}")
        t.add_row(r["model"] if r["model"] != prev else "", r["granularity"], str(r["m"]), *cells,
                  f"{r['buffers_max']} / {r['buffers_total']}", *(f"{r[p]:.3%}" for p in spec.PEERS))
        prev = r["model"]
    return t


def kinds_table(rows, world_sizes):
    """Worst layer of each kind, per policy (the Figure-11 view)."""
    from rich.table import Table

    t = Table(title="padding of each decoder-layer kind (one / granule / auto), the paper's Figure 11 view",
              title_justify="left")
    t.add_column("model / kind")
    t.add_column("granularity")
    for m in world_sizes:
        t.add_column(str(m), justify="right")
    keys = dict.fromkeys((r["model"], r["granularity"], k) for r in rows for k in r["kinds"])
    for model, gtext, kind in keys:
        cells = []
        for m in world_sizes:
            r = next((r for r in rows if (r["model"], r["granularity"], r["m"]) == (model, gtext, m)), None)
            v = r["kinds"][kind] if r else None
            cells.append("" if v is None else f"{v['one']:.2%} / {v['granule']:.2%} / [bold]{v['auto']:.2%}[/]")
        t.add_row(f"{model} / {kind}", gtext, *cells)
    return t


_FLOOR, _CEIL = 1e-5, 10.0  # chart range: 0.001% .. 1000%
_MARKS = "▏▎▍▌▋▊▉█"


def _bar(v: float, width: int) -> str:
    if v <= 0:
        return ""
    x = (math.log10(max(v, _FLOOR)) - math.log10(_FLOOR)) / (math.log10(_CEIL) - math.log10(_FLOOR))
    cells = max(0.0, min(1.0, x)) * width
    full = int(cells)
    frac = int((cells - full) * 8)
    return "█" * full + (_MARKS[frac - 1] if frac else "")


def chart(rows, width: int = 48):
    """Grouped horizontal bars (log scale 0.001%..1000%) per model, granularity and m: ragged's
    policies and the peers."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ragged import spec

    cols = [*POLICIES, *spec.PEERS]
    colors = ["green", "bright_green", "cyan", "red", "yellow", "magenta", "blue"]
    out = []
    for model, gtext in dict.fromkeys((r["model"], r["granularity"]) for r in rows):
        t = Table(title=f"{model} {gtext}: padding by shard group size m (log scale, 0.001% .. 1000%; zero = no bar)",
                  title_justify="left", show_header=False, box=None, padding=(0, 1))
        t.add_column("m", justify="right")
        t.add_column("who")
        t.add_column("bar", width=width, no_wrap=True)
        t.add_column("value", justify="right")
        for r in (r for r in rows if (r["model"], r["granularity"]) == (model, gtext)):
            for i, c in enumerate(cols):
                t.add_row(str(r["m"]) if i == 0 else "", c, Text(_bar(r[c], width), style=colors[i % len(colors)]),
                          f"{r[c]:.3%}")
            t.add_row("", "", "", "")
        out.append(t)
    return Group(*out)


def checks(rows) -> list[tuple[str, bool, str]]:
    """The done-when cells of the multi-buffer issue: ``[(what, passed, detail)]``."""
    out = []
    worse = [f"{r['model']} {r['granularity']} m={r['m']}: auto {r['auto']:.4%} vs one {r['one']:.4%} / granule "
             f"{r['granule']:.4%}" for r in rows if r["auto"] > min(r["one"], r["granule"]) + 1e-12]
    worse_kinds = [f"{r['model']}/{k} {r['granularity']} m={r['m']}" for r in rows for k, v in r["kinds"].items()
                   if v["auto"] > min(v["one"], v["granule"]) + 1e-12]
    out.append((f"every cell ({len(rows)}) and layer kind: auto pads no more than one buffer and than one buffer per "
                "granule", not worse and not worse_kinds, "; ".join((worse + worse_kinds)[:4])))

    def cell(model, gtext, m):
        return next((r for r in rows if (r["model"], r["granularity"], r["m"]) == (model, gtext, m)), None)

    def kind_check(what, model, kind, gtext, ms, bound):
        got = [(m, cell(model, gtext, m)) for m in ms]
        got = [(m, r["kinds"][kind]["auto"]) for m, r in got if r is not None]
        if got:
            worst = max(v for _, v in got)
            out.append((f"{what} <= {bound:.1%}", worst <= bound,
                        ", ".join(f"m={m}: {v:.3%}" for m, v in got)))

    ms = sorted({r["m"] for r in rows})
    kind_check("DeepSeek-V3 dense layer rows:1, m=256", "deepseek-v3-671b", "dense_layer", "rows:1", [256], 0.003)
    kind_check("DeepSeek-V3 dense layer rows:1, m=1024", "deepseek-v3-671b", "dense_layer", "rows:1", [1024], 0.012)
    got = [(r["m"], r["auto"]) for r in rows if (r["model"], r["granularity"]) == ("llama3-70b", "rows:1")]
    if got:
        out.append(("Llama-3-70B rows:1, every m (whole model) <= 0.1%", max(v for _, v in got) <= 0.001,
                    ", ".join(f"m={m}: {v:.3%}" for m, v in got)))
    kind_check("GPT-OSS-120B MoE layer rows:16, m=1024", "gpt-oss-120b", "moe_layer", "rows:16", [1024], 0.035)
    kind_check("GPT-OSS-120B MoE layer rows:128, every m", "gpt-oss-120b", "moe_layer", "rows:128", ms, 0.18)
    return out


def main(argv=None) -> int:
    from ragged._console import console as make_console

    from ragged._models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES))
    ap.add_argument("--granularities", nargs="+", default=list(GRANULARITIES), help="rows:N | blocks:RxC")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--chart", action="store_true", help="also draw the terminal chart (log scale)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    args = ap.parse_args(argv)
    console = make_console(args.width, min_width=160)
    rows = sweep(args.models, args.world_sizes, args.granularities)
    console.print(table(rows))
    console.print(kinds_table(rows, args.world_sizes))
    if args.chart:
        console.print(chart(rows))
    for what, ok, detail in checks(rows):
        console.print(f"check: {what}: " + ("[green]PASS[/]" if ok else "[red]FAIL[/]") + (f" ({detail})" if detail else ""))
    if args.markdown:
        print(markdown(rows, args.world_sizes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def markdown(rows, world_sizes) -> str:
    out = ["| model | granularity | m | one buffer | one per granule | auto | buffers (max / total) | FSDP2 | Megatron-FSDP |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['granularity']} | {r['m']} | {r['one']:.2%} | {r['granule']:.2%} | "
                   f"{r['auto']:.2%} | {r['buffers_max']} / {r['buffers_total']} | {r['fsdp2']:.2%} | "
                   f"{r['megatron']:.2%} |")
    out.append("")
    out.append("| layer kind | granularity | " + " | ".join(f"m={m}" for m in world_sizes) + " |")
    out.append("|---|---|" + "---|" * len(world_sizes))
    keys = dict.fromkeys((r["model"], r["granularity"], k) for r in rows for k in r["kinds"])
    for model, gtext, kind in keys:
        vals = []
        for m in world_sizes:
            r = next((r for r in rows if (r["model"], r["granularity"], r["m"]) == (model, gtext, m)), None)
            vals.append("" if r is None else f"{r['kinds'][kind]['one']:.2%} / {r['kinds'][kind]['auto']:.2%}")
        out.append(f"| {model} {kind} | {gtext} | " + " | ".join(vals) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
