"""Differentiable TP / EP collectives (the Megatron ``f`` / ``g`` pair and a row all-to-all).

[Note: f and g]
A column-parallel linear followed by a row-parallel one needs two conjugate operators on the
TP group: ``copy_to`` (identity forward, all-reduce(sum) backward) before the column-parallel
input, so gradients of everything upstream (norms, embeddings: replicated on TP) are complete
and equal on every TP rank; and ``reduce_from`` (all-reduce(sum) forward, identity backward)
after the row-parallel output. With both in place, gradients of TP-replicated parameters are
already equal across the TP group and need no TP reduction. Both are new-style
``autograd.Function`` s, so they work under ``.backward()`` and ``torch.func.grad``.
"""

from __future__ import annotations

import math

import torch

from ragged.transforms._gather import AllReduceGrad
from ragged._errors import RaggedValueError

__all__ = ["copy_to", "reduce_from", "all_to_all"]


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(x, comm):
        out = x.contiguous().clone()
        comm.all_reduce(out.view(-1), op="sum")
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to(x: torch.Tensor, comm) -> torch.Tensor:
    """Identity forward; all-reduce(sum) of the gradient over ``comm`` backward (Megatron's
    ``f``; see [Note: f and g]).

    Examples:
        >>> import torch, ragged as rg
        >>> def fn(comm):
        ...     x = torch.ones(2, requires_grad=True)
        ...     (rg.parallel.copy_to(x, comm) * (comm.rank + 1)).sum().backward()
        ...     return x.grad.tolist()
        >>> rg.collectives.simulate(2, fn)
        [[3.0, 3.0], [3.0, 3.0]]
    """
    return AllReduceGrad.apply(x, comm)


def reduce_from(x: torch.Tensor, comm) -> torch.Tensor:
    """All-reduce(sum) over ``comm`` forward; identity backward (Megatron's ``g``).

    Examples:
        >>> import torch, ragged as rg
        >>> rg.collectives.simulate(2, lambda c: rg.parallel.reduce_from(torch.tensor([c.rank + 1.0]), c).tolist())
        [[3.0], [3.0]]
    """
    return _ReduceFrom.apply(x, comm)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, comm, output_rows, input_rows):
        inner = math.prod(x.shape[1:])
        out = torch.empty((sum(output_rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
        comm.all_to_all(out.view(-1), x.contiguous().view(-1), [r * inner for r in output_rows],
                        [r * inner for r in input_rows])
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.output_rows, ctx.input_rows = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.comm, ctx.input_rows, ctx.output_rows), None, None, None


def all_to_all(x: torch.Tensor, comm, output_rows, input_rows) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows (dim 0) of ``x`` over ``comm`` (EP token
    dispatch and combine); its backward is the reverse all-to-all.

    Args:
        x: ``(sum(input_rows), *rest)``; rows ``input_rows[j]`` consecutive go to rank ``j``.
        comm: the EP group's Collectives.
        output_rows: rows received from each rank (exchange the counts first).
        input_rows: rows sent to each rank.

    Returns:
        ``(sum(output_rows), *rest)``: rows from rank 0 first, then rank 1, ...

    Examples:
        >>> import torch, ragged as rg
        >>> def fn(comm):
        ...     x = torch.full((2, 1), float(comm.rank))
        ...     return rg.parallel.all_to_all(x, comm, [1, 1], [1, 1]).view(-1).tolist()
        >>> rg.collectives.simulate(2, fn)
        [[0.0, 1.0], [0.0, 1.0]]
    """
    output_rows, input_rows = tuple(int(r) for r in output_rows), tuple(int(r) for r in input_rows)
    if x.shape[0] != sum(input_rows):
        raise RaggedValueError(f"all_to_all: x has {x.shape[0]} rows but input_rows sums to {sum(input_rows)}.")
    return _AllToAll.apply(x, comm, output_rows, input_rows)
