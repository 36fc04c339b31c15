"""Rich renderings of plans: a summary table and a per-rank picture of the buffer.

rich is imported lazily (inside the functions), as ``jax/_src/debugging.py`` does, so
``import ragged`` stays light. :func:`visualize` and :func:`rank_table` return a
:class:`Rendering`: a rich renderable (``rich.print`` / ``Console().print`` it, or let Jupyter
display it as the last expression of a cell) that also draws itself in a plain terminal REPL,
where ``repr`` shows the picture, and under ``print(...)``.

[Note: one cell, one colour]
``visualize`` draws each rank's S elements as ``width`` cells. A cell covers
``S / width`` elements and takes the colour of the leaf holding most of them (padding when
padding dominates), so a leaf smaller than a cell may not show; ``details=True`` lists every
rank's exact ragged pieces. A plan with several buffers draws each rank's piece of every buffer
(cells in proportion to ``S_b``, at least one each) separated by ``│``.
"""

from __future__ import annotations

from ragged._errors import RaggedValueError

__all__ = ["plan_summary", "visualize", "rank_table", "Rendering"]

#: Distinct colours, cycled over leaves in buffer order (neighbours never share one).
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22", "#393b79", "#ad494a", "#637939", "#7b4173", "#3182bd", "#e6550d", "#31a354",
)
_PAD_STYLE = "grey23"


class Rendering:
    """A rich renderable that draws itself anywhere: ``__rich__`` for rich consoles,
    ``_repr_mimebundle_`` for Jupyter, and ``repr`` / ``str`` rendered for this terminal (its
    width; colours only when stdout is a terminal), so a REPL echo or ``print`` shows the
    picture rather than ``<rich.panel.Panel object at ...>``. Other attributes are the
    renderable's.

    Examples:
        >>> from rich.text import Text
        >>> print(Rendering(Text("a picture")))
        a picture
    """

    __slots__ = ("renderable",)

    def __init__(self, renderable):
        self.renderable = renderable

    def __rich__(self):
        return self.renderable

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        # rich only when something is drawn (see the module docstring)
        from rich.jupyter import JupyterMixin

        return JupyterMixin._repr_mimebundle_(self, include, exclude, **kwargs)

    def __getattr__(self, name):
        return getattr(self.renderable, name)

    def __repr__(self) -> str:
        # rich only when something is drawn (see the module docstring); a file or pipe cuts nothing
        from ragged._console import console

        out = console()
        with out.capture() as captured:
            out.print(self.renderable)
        return captured.get().rstrip("\n")

    __str__ = __repr__


def _fmt(n: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _pick_ranks(world_size: int, max_ranks: int) -> list[int | None]:
    """Ranks to draw; ``None`` marks an elided run."""
    if world_size <= max_ranks:
        return list(range(world_size))
    head = max_ranks // 2
    tail = max_ranks - head
    return [*range(head), None, *range(world_size - tail, world_size)]


def _owners_text(plan, leaf) -> str:
    """The ranks holding ``leaf``: ``"-"`` (none), ``"3"`` or ``"0-2"``."""
    owners = plan.owners(leaf)
    return "-" if not owners else (str(owners[0]) if len(owners) == 1 else f"{owners[0]}-{owners[-1]}")


def _piece_range(piece) -> str:
    leaf = piece.leaf
    row = leaf.row_size
    if len(leaf.shape) >= 2 and row and piece.start % row == 0 and piece.stop % row == 0:
        return f"rows [{piece.start // row}:{piece.stop // row})"
    return f"elems [{piece.start}:{piece.stop})"


def plan_summary(plan, *, max_leaves: int = 24):
    """The ``LayoutPlan.__rich__`` view: sizes, padding, occupancy and the leaf table.

    Args:
        plan: a :class:`~ragged.spec.LayoutPlan`.
        max_leaves: leaf rows to show (the rest are summarised in one row).

    Examples:
        >>> import torch, ragged as rg
        >>> import io
        >>> from rich.console import Console
        >>> plan = rg.make_plan({"w": torch.empty(6, 4), "b": torch.empty(5)}, world_size=2, align=1)
        >>> console = Console(record=True, width=100, file=io.StringIO())
        >>> console.print(plan)
        >>> text = console.export_text()
        >>> "shard_size S=16" in text and "['w']" in text and "rows [0:4)" not in text
        True
    """
    # rich only when something is drawn (see the module docstring)
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    occ = plan.occupancy()
    S = plan.shard_size
    head = Text()
    head.append("LayoutPlan ", style="bold")
    head.append(
        f"world_size m={plan.world_size}  shard_size S={S}  dtype={str(plan.dtype).replace('torch.', '')}  "
        f"align={plan.align}  strategy={plan.strategy}\n"
    )
    if plan.num_buffers > 1:
        head.append(f"{plan.num_buffers} buffers, S_b = {' + '.join(str(b) for _, b in plan.buffers)}\n")
    head.append(
        f"{len(plan.leaves)} sharded leaves ({_fmt(plan.numel)} elements), {len(plan.replicated)} replicated "
        f"({_fmt(plan.replicated_numel)})  padding {_fmt(plan.padding)} = "
    )
    head.append(f"{plan.overhead:.3%}", style="bold red" if plan.overhead > 0.03 else "bold green")
    if occ:
        head.append(f"\nper-rank occupancy min {min(occ) / S:.1%} max {max(occ) / S:.1%}" if S else "")
    if plan.split_blocks:
        head.append(f"\n{plan.split_blocks} granules split across ranks (naive layout)", style="bold red")
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    many = plan.num_buffers > 1
    for col, justify in (("leaf", "left"), ("shape", "left"), *((("buffer", "right"),) if many else ()),
                         ("offset", "right"), ("numel", "right"), ("granule", "right"), ("ranks", "left")):
        table.add_column(col, justify=justify)
    shown = plan.leaves[:max_leaves]
    for i, leaf in enumerate(shown):
        buffer = (str(plan.buffer_index(leaf.offset)),) if many else ()
        table.add_row(Text(leaf.path, style=PALETTE[i % len(PALETTE)]), str(tuple(leaf.shape)), *buffer,
                      str(leaf.offset), str(leaf.numel), str(leaf.granule), _owners_text(plan, leaf))
    blank = ("",) if many else ()
    if len(plan.leaves) > max_leaves:
        rest = plan.leaves[max_leaves:]
        table.add_row(f"... {len(rest)} more", "", *blank, "", str(sum(l.numel for l in rest)), "", "")
    for leaf in plan.replicated[: max(0, max_leaves - len(shown))]:
        table.add_row(Text(leaf.path, style="italic"), str(tuple(leaf.shape)), *blank, "replicated", str(leaf.numel),
                      "-", "all")
    return Group(head, table)


def _bar(plan, rank: int, width: int, colour_of: dict):
    # rich only when something is drawn (see the module docstring)
    from rich.text import Text

    S = plan.shard_size
    pieces = plan.local_pieces(rank)
    text = Text()
    if S == 0:
        return text
    for b, r in enumerate(plan.shard_ranges(rank)):  # one run of cells per buffer, in proportion to S_b
        if b:
            text.append("│", style="bold")
        for idx in _cells(pieces, r.local_offset, r.numel, max(1, round(width * r.numel / S)), colour_of):
            if idx < 0:
                text.append("·", style=_PAD_STYLE)
            else:
                text.append("█", style=PALETTE[idx % len(PALETTE)])
    return text


def _cells(pieces, start: int, size: int, width: int, colour_of: dict) -> list[int]:
    """For each of ``width`` cells over local elements ``[start, start + size)``: the colour
    index of the leaf with the largest overlap, or -1 where padding dominates."""
    cells = [-1] * width
    bounds = [start + (c * size) // width for c in range(width + 1)]
    j = 0
    for c in range(width):
        lo, hi = bounds[c], bounds[c + 1]
        hi = max(hi, lo + 1)  # more cells than elements: a cell shows the element it starts at
        best, best_n, covered = -1, 0, 0
        while j < len(pieces) and pieces[j].local_offset + pieces[j].numel <= lo:
            j += 1
        k = j
        while k < len(pieces) and pieces[k].local_offset < hi:
            p = pieces[k]
            n = min(hi, p.local_offset + p.numel) - max(lo, p.local_offset)
            covered += max(n, 0)
            if n > best_n:
                best, best_n = colour_of[id(p.leaf)], n
            k += 1
        if hi - lo - covered > best_n:
            best = -1
        cells[c] = best
    return cells


def rank_table(plan, ranks=None, *, max_pieces: int = 8):
    """Per-rank occupancy and local ragged ranges (which rows / elements of each leaf a
    rank holds, and where they sit in its shard).

    Args:
        plan: a :class:`~ragged.spec.LayoutPlan`.
        ranks: ranks to list (default: all, or the first and last 4 when there are more than 8).
        max_pieces: pieces listed per rank.

    Examples:
        >>> import torch, ragged as rg
        >>> import io
        >>> from rich.console import Console
        >>> plan = rg.make_plan({"w": torch.empty(6, 4)}, world_size=2, align=1)
        >>> console = Console(record=True, width=100, file=io.StringIO())
        >>> console.print(rg.rank_table(plan))
        >>> "rows [3:6)" in console.export_text()
        True
    """
    # rich only when something is drawn (see the module docstring)
    from rich.table import Table

    if ranks is None:
        ranks = _pick_ranks(plan.world_size, 8)
    table = Table(title="per-rank pieces", header_style="bold")
    table.add_column("rank", justify="right")
    table.add_column("occupancy", justify="right")
    table.add_column("pieces (leaf: local range -> shard offset)")
    S = plan.shard_size
    for r in ranks:
        if r is None:
            table.add_row("...", "", "")
            continue
        pieces = plan.local_pieces(r)
        used = sum(p.numel for p in pieces)
        lines = [f"{p.leaf.path}: {_piece_range(p)} -> {p.local_offset}" for p in pieces[:max_pieces]]
        if len(pieces) > max_pieces:
            lines.append(f"... {len(pieces) - max_pieces} more")
        table.add_row(str(r), f"{used}/{S} ({used / S:.1%})" if S else "0", "\n".join(lines) or "(padding only)")
    return Rendering(table)


def visualize(plan, *, width: int = 64, max_ranks: int = 16, legend: bool = True, details: bool = False):
    """Draws the buffer per rank, one colour per leaf (like ``jax.debug.visualize_array_sharding``).

    Each rank is one line of ``width`` cells covering its S elements; ``·`` is padding; the
    right column gives the rank's occupancy. See [Note: one cell, one colour].

    Args:
        plan: a :class:`~ragged.spec.LayoutPlan`.
        width: cells per rank.
        max_ranks: ranks drawn; above it the first and last ``max_ranks // 2`` are drawn.
        legend: add the colour legend (leaf, shape, ranks).
        details: add :func:`rank_table` (exact local ragged ranges).

    Returns:
        A :class:`Rendering` (rich consoles, Jupyter, and ``repr`` / ``print`` in a terminal).

    Examples:
        >>> import torch, ragged as rg
        >>> import io
        >>> from rich.console import Console
        >>> plan = rg.make_plan({"a": torch.empty(3, 4), "b": torch.empty(5, 4)}, world_size=3, align=1)
        >>> console = Console(record=True, width=100, file=io.StringIO())
        >>> console.print(rg.visualize(plan, width=12))
        >>> print(console.export_text())
        ╭───── m=3 S=12 float32 dp ──────╮
        │ rank 0 ████████████ 12/12      │
        │ rank 1 ████████████ 12/12      │
        │ rank 2 ████████····  8/12      │
        │ █ ['a'] (3, 4) ranks 0         │
        │ █ ['b'] (5, 4) ranks 1-2       │
        │ · padding (4 elements, 12.50%) │
        ╰────────────────────────────────╯
        <BLANKLINE>
    """
    # rich only when something is drawn (see the module docstring)
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    if width < 1:
        raise RaggedValueError(f"width must be >= 1, got {width}.")
    colour_of = {id(leaf): i for i, leaf in enumerate(plan.leaves)}
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", style="bold")
    grid.add_column()
    grid.add_column(justify="right")
    S = plan.shard_size
    for r in _pick_ranks(plan.world_size, max_ranks):
        if r is None:
            grid.add_row("⋮", Text(f"({plan.world_size - max_ranks} ranks not drawn)", style="dim"), "")
            continue
        used = sum(p.numel for p in plan.local_pieces(r))
        grid.add_row(f"rank {r}", _bar(plan, r, width, colour_of), f"{used}/{S}")
    parts = [grid]
    if legend:
        leg = Text()
        for i, leaf in enumerate(plan.leaves[:32]):
            leg.append("█ ", style=PALETTE[i % len(PALETTE)])
            leg.append(f"{leaf.path} {tuple(leaf.shape)} ranks {_owners_text(plan, leaf)}\n")
        if len(plan.leaves) > 32:
            leg.append(f"... {len(plan.leaves) - 32} more leaves (colours cycle)\n", style="dim")
        leg.append("· ", style=_PAD_STYLE)
        leg.append(f"padding ({plan.padding} elements, {plan.overhead:.2%})")
        if plan.replicated:
            leg.append(f"\n{len(plan.replicated)} replicated leaves ({plan.replicated_numel} elements) on every rank, "
                       "outside the sharded buffer", style="italic")
        parts.append(leg)
    if details:
        parts.append(rank_table(plan))
    title = f"m={plan.world_size} S={S} {str(plan.dtype).replace('torch.', '')} {plan.strategy}"
    if plan.num_buffers > 1:
        title += f" {plan.num_buffers} buffers"
    return Rendering(Panel(Group(*parts), title=title, expand=False))
