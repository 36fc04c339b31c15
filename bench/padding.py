"""Figure-11-style padding sweep on real model shapes: ragged vs every peer's rule.

For each bundled model (``ragged.models``: Llama-3-70B, GPT-OSS-120B, DeepSeek-V3-671B; one
FSDP unit per decoder layer plus embedding and head), each shard group size ``m`` and each
row granularity (1x, 16x, 128x rows, as in the paper's Figure 11), the whole-model padding of
ragged's plans (``rg.make_plan``, default ``dp`` strategy) next to FSDP2, FSDP1, ZeRO-3 and
Megatron-FSDP (``spec.peer_padding``). Padding is what every rank all-gathers on top of the
parameters: ``(m * per-rank elements - elements) / elements``, summed over all units.

Shown as a table and as a terminal chart (log scale; no plotting dependency).

Usage::

    python3 bench/padding.py                                   # 3 models, m = 8 ... 1024
    python3 bench/padding.py --models gpt-oss-120b --world-sizes 64 128 256 --granularities 1 128
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
GRANULARITIES = (1, 16, 128)


def sweep(models, world_sizes, granularities, *, dtype=torch.bfloat16, strategy="dp"):
    """``[{model, m, numel, "ragged r1": overhead, ..., "fsdp2": overhead, ...}]`` and timing."""
    from ragged import spec
    from ragged._models import model_units

    rows = []
    for model in models:
        units = model_units(model, dtype=dtype)
        kinds: dict[str, list] = {}
        for u in units:
            kinds.setdefault(u.kind, []).append(u)
        numel = sum(math.prod(t.shape) for u in units for t in u.params.values())
        for m in world_sizes:
            row = {"model": model, "m": m, "numel": numel, "plan_s": 0.0}
            for g in granularities:
                pad = 0
                t0 = time.perf_counter()
                for members in kinds.values():  # units of one kind have identical shapes: one plan each
                    plan = spec.make_plan(members[0].params, spec.Rows(g), world_size=m, strategy=strategy)
                    pad += plan.padding * len(members)
                row["plan_s"] += time.perf_counter() - t0
                row[f"ragged r{g}"] = pad / numel
            for peer in spec.PEERS:
                pad = sum(spec.peer_padding(members[0].params, m, peers=(peer,))[peer].padding * len(members)
                          for members in kinds.values())
                row[peer] = pad / numel
            rows.append(row)
    return rows


def _columns(granularities):
    from ragged import spec

    return [f"ragged r{g}" for g in granularities] + list(spec.PEERS)


def table(rows, granularities):
    from rich.table import Table

    cols = _columns(granularities)
    t = Table(title="whole-model padding (all-gathered elements over parameters), ragged at row granularity "
                    "1x/16x/128x vs peers' rules", title_justify="left")
    t.add_column("model")
    t.add_column("m", justify="right")
    for c in cols:
        t.add_column(c, justify="right")
    t.add_column("planner s", justify="right")
    prev = None
    for r in rows:
        best_peer = min(r[c] for c in cols if not c.startswith("ragged"))
        cells = []
        for c in cols:
            v = r[c]
            style = "green" if c.startswith("ragged") and v <= best_peer else ("red" if v > 0.10 else "")
            cells.append(f"[{style}]{v:.3%}[/]" if style else f"{v:.3%}")
        t.add_row(r["model"] if r["model"] != prev else "", str(r["m"]), *cells, f"{r['plan_s']:.2f}",
                  end_section=False)
        prev = r["model"]
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


def chart(rows, granularities, width: int = 48):
    """Grouped horizontal bars (log scale 0.001%..1000%) per model and m."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    cols = _columns(granularities)
    colors = ["green", "bright_green", "cyan", "red", "yellow", "magenta", "blue"]
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        t = Table(title=f"{model}: padding by shard group size m (log scale, 0.001% .. 1000%; zero = no bar)",
                  title_justify="left", show_header=False, box=None, padding=(0, 1))
        t.add_column("m", justify="right")
        t.add_column("who")
        t.add_column("bar", width=width, no_wrap=True)
        t.add_column("value", justify="right")
        for r in (r for r in rows if r["model"] == model):
            for i, c in enumerate(cols):
                t.add_row(str(r["m"]) if i == 0 else "", c, Text(_bar(r[c], width), style=colors[i % len(colors)]),
                          f"{r[c]:.3%}")
            t.add_row("", "", "", "")
        ticks = " ".join(f"{10.0 ** k:.0%}" if k >= -2 else f"{10.0 ** k:.3%}".rstrip("0") for k in range(-5, 2))
        out.append(t)
        out.append(Text(f"   scale: log10, one decade per {width // 6} cells, left edge 0.001%, right edge 1000% "
                        f"(decades: {ticks})", style="dim"))
    return Group(*out)


def markdown(rows, granularities) -> str:
    cols = _columns(granularities)
    out = ["| model | m | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    prev = None
    for r in rows:
        out.append(f"| {r['model'] if r['model'] != prev else ''} | {r['m']} | " + " | ".join(f"{r[c]:.2%}" for c in cols) + " |")
        prev = r["model"]
    return "\n".join(out)


def main(argv=None) -> int:
    from rich.console import Console

    from ragged._models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES))
    ap.add_argument("--granularities", nargs="+", type=int, default=list(GRANULARITIES), help="rows per granule")
    ap.add_argument("--strategy", choices=("dp", "exact", "naive"), default="dp")
    ap.add_argument("--no-chart", dest="chart", action="store_false")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    args = ap.parse_args(argv)
    console = Console(width=args.width or max(120, Console().width))
    rows = sweep(args.models, args.world_sizes, args.granularities, strategy=args.strategy)
    console.print(table(rows, args.granularities))
    if args.chart:
        console.print(chart(rows, args.granularities))
    if args.markdown:
        print(markdown(rows, args.granularities))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
