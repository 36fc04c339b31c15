"""The one rich console every command, report and benchmark prints through: :func:`console`.

[Note: output for pipes]
In a terminal a console is rich's own: the terminal's width, a table too wide for it shrunk to
fit (rich's ellipsis). Anywhere else (a file, a pipe, a CI log, ``repr`` in a plain REPL) no
cell is ever cut: every print is as wide as the widest line of what it prints needs, and never
narrower than ``COLUMNS`` (else 80), so ``plan --model deepseek-v3-671b --world-size 1024 > f``
keeps ``11238400`` whole, and a log line runs on instead of wrapping. An explicit width (the
``plan --width`` option) is the caller's choice and is kept as given. Progress goes to stderr
(``stderr=True``), so stdout stays what a pipe reads (``--json``).
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.protocol import is_renderable

__all__ = ["console"]

_UNCUT = 100_000  # the width a fitting console renders within: no line of a report is longer


class _Fitting(Console):
    """A console that is not a terminal: each print as wide as its content (at least ``floor``)."""

    def __init__(self, floor: int, **kwargs):
        super().__init__(width=_UNCUT, **kwargs)
        self.floor = floor

    def print(self, *objects, **kwargs):
        if objects and kwargs.get("width") is None:
            kwargs["width"] = max(self.floor, self._need(objects, kwargs.get("sep", " ")))
        super().print(*objects, **kwargs)

    def _need(self, objects, sep: str) -> int:
        """The columns ``objects`` take on one line at most (their natural widths side by side)."""
        total = len(sep) * (len(objects) - 1)
        for item in objects:
            item = item if isinstance(item, str) or is_renderable(item) else repr(item)
            total += Measurement.get(self, self.options, item).maximum
        return total


def console(width: int | None = None, *, min_width: int = 0, stderr: bool = False) -> Console:
    """The console to print on (see [Note: output for pipes]).

    Args:
        width: a fixed width (the caller's choice, kept as given: cells may be cut).
        min_width: the least width: in a terminal, wider than the terminal if need be; elsewhere
            the floor of every print.
        stderr: print to stderr (progress, so stdout stays machine-readable).

    Examples:
        >>> import contextlib, io
        >>> from rich.table import Table
        >>> table = Table("m", "S (ragged)", "buffers", "ragged", "fsdp2", "fsdp1", "zero3", "megatron", "planner time")
        >>> table.add_row("1024", "11238400", "3", "0.01%", "0.11%", "0.00%", "0.00%", "1.04%", "968.1 ms")
        >>> def printed(make):
        ...     out = io.StringIO()
        ...     with contextlib.redirect_stdout(out):   # stdout is not a terminal
        ...         make().print(table)
        ...     return out.getvalue()
        >>> "11238400" in printed(lambda: Console(width=80)), "11238400" in printed(console)   # 80 columns cut it
        (False, True)
    """
    probe = Console(stderr=stderr)
    if width is not None:
        return Console(width=width, stderr=stderr)
    if probe.is_terminal or probe.is_jupyter:
        return Console(width=max(min_width, probe.width), stderr=stderr) if min_width > probe.width else probe
    return _Fitting(max(min_width, probe.width), stderr=stderr)
