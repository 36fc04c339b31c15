"""Writes the tables of docs/predict.md: bundled models lowered at m = 1K..10K (ragged vs the FSDP2
and ZeRO-3 rules), each row from ``python -m ragged plan --predict``'s code (``ragged/predict/_command.py``).

Usage (from the repository root)::

    python3 docs/predict_table.py > /tmp/tables.md
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ragged.predict._command import bundled_step, predict_rows  # noqa: E402

MODELS = ("deepseek-v3-671b", "gpt-oss-120b")
WORLD = (1024, 2048, 4096, 10240)


def _gib(n) -> str:
    return f"{n / 2**30:,.2f}"


def table(model: str, optimizer: str = "adamw") -> str:
    lines = [f"**{model}**, AdamW ({'8-bit' if optimizer == 'adamw8bit' else 'fp32 moments'}), fp32 master, bf16 "
             "gathers, rows:1, `max_buffers=\"auto\"`, one unit per decoder layer (GiB per rank; per step)", "",
             "| m | system | persistent | params | optimizer | other | all-gather / step | reduce-scatter / step "
             "| largest gathered unit | ragged peak (at) | lowering s |", "|" + "---|" * 11]
    for m in WORLD:
        t0 = time.perf_counter()
        row = predict_rows(bundled_step(model, m, optimizer=optimizer))
        seconds = time.perf_counter() - t0
        for system, s in row["systems"].items():
            cat = s["by_category"]
            opt = sum(v for k, v in cat.items() if k.startswith("optimizer."))
            other = s["persistent_bytes"] - cat.get("param_shards", 0) - opt
            peak = f"{_gib(row['peak_bytes'])} ({' '.join(row['peak_at'])})" if system == "ragged" else ""
            lines.append(f"| {m:,} | {system} | {_gib(s['persistent_bytes'])} | {_gib(cat.get('param_shards', 0))} | "
                         f"{_gib(opt)} | {_gib(other)} | {_gib(s['gather_bytes'])} | {_gib(s['reduce_bytes'])} | "
                         f"{_gib(s['largest_gathered_bytes'])} | {peak} | {f'{seconds:.1f}' if system == 'ragged' else ''} |")
        print(f"{model} m={m}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(m) for m in MODELS))
