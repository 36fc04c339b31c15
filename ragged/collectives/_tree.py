"""A fixed binary tree of additions: the summation order of a chunked step (``rg.fsdp.make_step(...,
chunks=C)``), the same at every world size that serves it.

[Note: one tree over the chunks]
Floating-point addition is commutative but not associative: ``a + b == b + a`` bit for bit, but
``(a + b) + c`` and ``a + (b + c)`` may differ in the last bit. So a sum of C terms has one value
per *shape* of the tree that adds them, whatever the order of each node's two children. The
chunked step fixes one shape, the **binary counter** over the chunk indices ``0 .. C - 1``:
terms are pushed in index order, and whenever the two newest partial sums cover as many terms
each, they are added (``(c0 + c1) + (c2 + c3)``, ...); at the end the partial sums left (one
per set bit of C) are added from the newest down. Every aligned block of ``2**k`` indices is
then a subtree. A data-parallel rank ``d`` of ``D`` runs chunks ``j * D + d`` as its micro-batches
``j`` (``fsdp.local_chunks``), so when ``D`` is a power of two each micro-batch's reduction over
the ranks covers one aligned block (the ranks' rows summed by :func:`sum_rows`, itself the
counter), and the micro-batches, pushed in order into a :class:`TreeSum`, build the rest of the
same tree: the gradient is the same sum at every such ``D``, to the bit. ``D = C`` (one
micro-batch each) is the counter over the ranks itself, so it serves any ``C``. See
docs/invariance.md.
"""

from __future__ import annotations

import torch

from ragged._errors import RaggedValueError

__all__ = ["TreeSum", "tree_sum", "held_partials", "sum_rows"]


def _add(older, newer):
    """``older + newer``; a tensor ``older`` is written in place (the counter owns its partial sums)."""
    if isinstance(older, torch.Tensor):
        return older.add_(newer)
    return older + newer


class TreeSum:
    """The binary counter of [Note: one tree over the chunks]: push terms in index order, then
    :meth:`result`. Tensors pushed become the counter's (a partial sum is written in place).

    Examples:
        >>> t = TreeSum()
        >>> for x in (1e16, 1.0, -1e16, 1.0):
        ...     t.push(x)
        >>> t.result(), ((1e16 + 1.0) + -1e16) + 1.0     # (1e16 + 1) + (-1e16 + 1): the tree, not the chain
        (0.0, 1.0)
    """

    __slots__ = ("_stack",)

    def __init__(self):
        self._stack: list = []  # (terms covered, partial sum), oldest first

    def __len__(self) -> int:
        """Partial sums held now (what the counter costs in memory)."""
        return len(self._stack)

    def nbytes(self) -> int:
        """Bytes of the tensors held (what the counter costs in memory)."""
        return sum(x.numel() * x.element_size() for _, x in self._stack if isinstance(x, torch.Tensor))

    def push(self, x) -> None:
        size = 1
        while self._stack and self._stack[-1][0] == size:
            _, older = self._stack.pop()
            x = _add(older, x)
            size *= 2
        self._stack.append((size, x))

    def result(self):
        """The sum of every term pushed (the counter is empty afterwards)."""
        if not self._stack:
            raise RaggedValueError("TreeSum.result() of no terms.")
        _, acc = self._stack.pop()
        while self._stack:
            _, older = self._stack.pop()
            acc = _add(older, acc)
        return acc


def tree_sum(terms):
    """The sum of ``terms`` over the binary counter of [Note: one tree over the chunks].

    Examples:
        >>> tree_sum([1.0, 2.0, 3.0])
        6.0
    """
    acc = TreeSum()
    for x in terms:
        acc.push(x)
    return acc.result()


def held_partials(count: int) -> int:
    """The most partial sums a :class:`TreeSum` holds at once while ``count`` terms are pushed,
    the newest term included (``popcount(k - 1) + 1`` before the ``k``-th push's merges)."""
    return max(bin(k).count("1") for k in range(count)) + 1 if count else 0


def sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` <- the sum of ``rows`` (an ``(m, n)`` tensor) over the counter's tree; ``rows`` is
    overwritten. A power-of-two ``m`` takes one kernel per level of the tree (the same additions).

    Examples:
        >>> rows = torch.tensor([[1e16], [1.0], [-1e16], [1.0]], dtype=torch.float64)
        >>> out = torch.empty(1, dtype=torch.float64)
        >>> sum_rows(rows, out); out.tolist()
        [0.0]
    """
    m = rows.shape[0]
    if m == 1:
        out.copy_(rows[0])
        return
    if m & (m - 1):
        out.copy_(tree_sum(list(rows)))
        return
    step = 1
    while 2 * step < m:
        rows[0 :: 2 * step].add_(rows[step :: 2 * step])
        step *= 2
    torch.add(rows[0], rows[step], out=out)
