"""What rank 0 of the ``train`` job prints (on ``ragged._console.console()``, which never cuts a log
line): progress (a rich bar in a terminal, plain lines in a log) and the final summary table.
"""

from __future__ import annotations

import resource
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["rss_mb", "Progress", "print_summary"]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Progress:
    """A rich progress bar in a terminal; elsewhere a plain line every ``every`` steps (and the
    first and last step), flushed at once, so a log shows the run as it goes."""

    def __init__(self, console, steps: int, every: int | None, quiet: bool, start: int = 0):
        self.console, self.steps, self.bar = console, steps, None
        self.every = every or max(1, round(steps / 20))
        self.quiet, self.t0 = quiet, time.perf_counter()
        if quiet or not console.is_terminal:
            return
        self.bar = Bar(TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                            TextColumn("gathered {task.fields[gath]:.1f}/{task.fields[model]:.1f} MB"),
                            TextColumn("rss {task.fields[rss]:.0f} MB"), TimeElapsedColumn(), console=console)
        self.bar.start()
        self.task = self.bar.add_task("train", total=steps, completed=start, loss=float("nan"), tps=0.0, gath=0.0,
                                      model=0.0, rss=0.0)

    def update(self, step: int, rec: dict) -> None:
        fields = dict(loss=rec["loss"], tps=rec["tokens_per_s"], gath=rec["peak_gathered_bytes"] / 2**20,
                      model=rec["model_bytes"] / 2**20, rss=rec["rss_mb"])
        if self.bar is not None:
            self.bar.update(self.task, advance=1, **fields)
        elif not self.quiet and (step == 0 or (step + 1) % self.every == 0 or step + 1 == self.steps):
            elapsed = time.perf_counter() - self.t0
            print(f"train step {step + 1}/{self.steps}  loss {fields['loss']:.3f}  {fields['tps']:,.0f} tok/s  "
                  f"gathered {fields['gath']:.1f}/{fields['model']:.1f} MB  rss {fields['rss']:.0f} MB  "
                  f"{elapsed:.1f} s", flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_summary(console, summary: dict) -> None:
    """The run's summary as one table (rank 0)."""
    t = Table(title="summary (rank 0)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("loss: first -> last (min)", f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
                                           f"({summary['min_loss']:.3f})")
    t.add_row("ln(vocab) / no-copy floor / task floor",
              f"{summary['ln_vocab']:.3f} / {summary['no_copy_floor']:.3f} / {summary['floor']:.3f}")
    t.add_row("median step", f"{summary['median_step_s'] * 1e3:.1f} ms")
    t.add_row("tokens/s (whole run)", f"{summary['tokens_per_s']:,.0f}")
    t.add_row("peak gathered params", f"{summary['peak_gathered_bytes'] / 2**20:.2f} MB "
              f"= {summary['peak_gathered_bytes'] / summary['largest_unit_bytes']:.2f} x largest unit, "
              f"{summary['peak_gathered_bytes'] / summary['model_bytes']:.0%} of the model "
              f"({summary['model_bytes'] / 2**20:.2f} MB)")
    t.add_row("max RSS (rank 0)", f"{summary['max_rss_mb']:.0f} MB")
    if "resumed" in summary:
        got = summary["resumed"]
        t.add_row("resumed", f"at step {got['step']} (saved at {got['saved_world_size']} ranks): losses "
                             f"{got['losses'].split(':')[0]}")
    if summary.get("same_numbers_at"):
        sizes = ", ".join(map(str, summary["same_numbers_at"]))
        t.add_row("the same numbers, to the bit, at", f"--nproc-per-node {sizes} (--chunks {summary['args']['chunks']})")
    console.print(t)
