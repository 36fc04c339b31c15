"""ragged's collectives as checked point-to-point exchanges (gloo; see [Note: size-tagged
messages and headers] in ``_channel.py``).

[Note: the data paths of the header protocol]
Each function builds, per peer, the tensors it sends and the tensors it receives into, and
hands them to :meth:`Channel.exchange`. No staging where none is needed:

* all-gather: the S-element input goes to every peer and each peer's chunk is received in
  place into its slot of the output (the own chunk is one local copy);
* reduce-scatter: chunk j of the input goes to rank j, and the m chunks are summed in rank
  order (:func:`reduce_rows`). Up to 3 ranks the own chunk is read where it is, in the input:
  at 2 the peer's chunk is received straight into the output and one ``add`` sums the two, at 3
  the peers' chunks land in a reused ``(2, n)`` scratch buffer; from 4 ranks on the m chunks (the
  own one copied) land in an ``(m, n)`` one, which ``torch.sum`` reads once;
* all-reduce: up to ``_DIRECT_BYTES`` the whole tensor goes to every peer and every rank sums
  the m copies in rank order (one round trip, the same bits on every rank); above it, a
  reduce-scatter of the zero-padded tensor then an all-gather of the reduced chunks (two
  exchanges, each rank's bytes sent ~2x the tensor). The large path completes inside the
  call even with ``async_op=True``: its second exchange must be issued at the same point on
  every rank, which a later ``wait()`` would not guarantee;
* all-to-all: split j goes to rank j, received in place;
* objects: pickled; receives are sized from the peers' headers;
* barrier: headers only.

Several buffers in one call (``all_gather_into_coalesced`` / ``reduce_scatter_into_coalesced``)
travel under one header per peer, as one message per buffer and peer.
"""

from __future__ import annotations

import pickle

import torch

from ragged._errors import RaggedValueError
from ragged.collectives._header import Call
from ragged.collectives._scratch import SCRATCH

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_gather_object", "barrier"]

_DIRECT_BYTES = 1 << 20


def reduce_rows(rows, op: str, out: torch.Tensor) -> None:
    """``out`` <- reduction of ``rows`` (an ``(m, n)`` tensor; up to 3 rows also a sequence of
    n-element tensors, of which ``out`` may be row 0 or row 1) in row order (the same bits on
    every rank for the same rows); ``"mean"`` divides by m."""
    m = len(rows)
    if op == "max":
        if isinstance(rows, torch.Tensor):
            torch.amax(rows, dim=0, out=out)
        else:
            torch.maximum(rows[0], rows[1], out=out) if m > 1 else out.copy_(rows[0])
            for j in range(2, m):
                torch.maximum(out, rows[j], out=out)
        return
    # on CPU a chain of adds is ~2x faster than sum(dim=0) for 2 chunks and ~1.15x for 3, but
    # sum reads each chunk once and wins from 4 chunks on (1.3x at 4, 1.8x at 8; one thread)
    if m == 1:
        out.copy_(rows[0])
    elif m <= 3:
        torch.add(rows[0], rows[1], out=out)
        for j in range(2, m):
            out.add_(rows[j])
    else:
        torch.sum(rows, 0, out=out)
    if op == "mean":
        out.div_(m)


def _same_dtype(ts, what):
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise RaggedValueError(f"{what}: coalesced buffers must share one dtype, got {sorted(map(str, dtypes))}.")
    return ts[0].dtype


def all_gather(ch, outputs, inputs, call_args, timeout):
    m, r = ch.size, ch.rank
    inputs = [t.contiguous() for t in inputs]
    dtype = _same_dtype(inputs + outputs, "all_gather_into")
    call = Call("all_gather", None, dtype, sum(t.numel() for t in inputs), *call_args)
    sends = [inputs] * m
    recvs = [[o[j * i.numel() : (j + 1) * i.numel()] for o, i in zip(outputs, inputs)] for j in range(m)]
    pending = ch.exchange(call, sends, recvs, timeout=timeout)
    for o, i in zip(outputs, inputs):  # while the messages travel
        o[r * i.numel() : (r + 1) * i.numel()].copy_(i)
    return pending


def reduce_scatter(ch, outputs, inputs, op, call_args, timeout):
    m, r = ch.size, ch.rank
    inputs = [t.contiguous() for t in inputs]
    dtype = _same_dtype(inputs + outputs, "reduce_scatter_into")
    call = Call("reduce_scatter", op, dtype, sum(t.numel() for t in outputs), *call_args)
    stacked = m > 3  # see reduce_rows: one (m, n) buffer that torch.sum reads once
    scratch, rows = [], []  # per buffer: the scratch it takes, and its m chunks in rank order
    for o, i in zip(outputs, inputs):
        n = o.numel()
        own = i[r * n : (r + 1) * n].detach()
        if m == 2:  # the peer's chunk straight into the output (see reduce_rows: out may be row 0 or 1)
            scratch.append(None)
            rows.append([own, o] if r == 0 else [o, own])
            continue
        s = SCRATCH.take((m if stacked else m - 1) * n, i.dtype, i.device)
        scratch.append(s)
        if stacked:
            rows.append(s.view(m, n))
        else:
            peers = list(s.view(m - 1, n))
            rows.append(peers[:r] + [own] + peers[r:])
    sends = [[i[j * o.numel() : (j + 1) * o.numel()] for o, i in zip(outputs, inputs)] for j in range(m)]
    recvs = [[rs[j] for rs in rows] for j in range(m)]

    def finish():
        for s, rs, o in zip(scratch, rows, outputs):
            reduce_rows(rs, op, o)
            if s is not None:
                SCRATCH.give(s)

    pending = ch.exchange(call, sends, recvs, timeout=timeout, finish=finish)
    if stacked:
        for rs, o, i in zip(rows, outputs, inputs):  # while the messages travel
            rs[r].copy_(i[r * o.numel() : (r + 1) * o.numel()].detach())
    return pending


def all_reduce(ch, tensor, op, call_args, timeout):
    m, r, n = ch.size, ch.rank, tensor.numel()
    flat = tensor.view(-1) if tensor.is_contiguous() else None
    if flat is None:
        raise RaggedValueError("all_reduce: the tensor must be contiguous (it is reduced in place).")
    if n * tensor.element_size() <= _DIRECT_BYTES:
        call = Call("all_reduce", op, tensor.dtype, n, *call_args)
        rows = SCRATCH.take(m * n, tensor.dtype, tensor.device).view(m, n)
        sends = [[flat]] * m
        recvs = [[rows[j]] for j in range(m)]

        def finish():
            reduce_rows(rows, op, flat)
            SCRATCH.give(rows.view(-1))

        pending = ch.exchange(call, sends, recvs, timeout=timeout, finish=finish)
        rows[r].copy_(flat.detach())
        return pending
    chunk = -(-n // m)  # fresh buffers: this path is rare, and must work inside torch.func.grad too
    padded = torch.cat([flat, flat.new_zeros(m * chunk - n)])
    mine = flat.new_empty(chunk)
    reduce_scatter(ch, [mine], [padded], op, call_args, timeout).wait()
    all_gather(ch, [padded], [mine], call_args, timeout).wait()
    flat.copy_(padded[:n])
    return None


def all_to_all(ch, output, input, output_splits, input_splits, call_args, timeout):
    m, r = ch.size, ch.rank
    if len(output_splits) != m or len(input_splits) != m:
        raise RaggedValueError(f"all_to_all: splits must have world_size={m} entries, got {len(input_splits)} and "
                               f"{len(output_splits)}.")
    if sum(input_splits) != input.numel() or sum(output_splits) != output.numel():
        raise RaggedValueError(
            f"all_to_all: splits sum to {sum(input_splits)} / {sum(output_splits)} but the tensors have "
            f"{input.numel()} / {output.numel()} elements.")
    if input_splits[r] != output_splits[r]:
        raise RaggedValueError(f"all_to_all: rank {r} sends itself {input_splits[r]} elements but expects "
                               f"{output_splits[r]}.")
    input = input.contiguous()
    ins, outs, a, b = [], [], 0, 0
    for j in range(m):
        ins.append(input[a : a + input_splits[j]])
        outs.append(output[b : b + output_splits[j]])
        a, b = a + input_splits[j], b + output_splits[j]
    call = Call("all_to_all", None, input.dtype, -1, *call_args)
    pending = ch.exchange(call, [[t] for t in ins], [[t] for t in outs], timeout=timeout, all_pairs_see_mismatch=False)
    outs[r].copy_(ins[r])
    return pending


def all_gather_object(ch, obj, call_args, timeout) -> list:
    m = ch.size
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    got: dict[int, torch.Tensor] = {}

    def make_recv(j, nbytes):
        got[j] = torch.empty(nbytes, dtype=torch.uint8)
        return got[j]

    call = Call("all_gather_object", None, None, -1, *call_args)
    ch.exchange(call, [[payload]] * m, None, timeout=timeout, make_recv=make_recv).wait()
    return [obj if j == ch.rank else pickle.loads(got[j].numpy().tobytes()) for j in range(m)]


def barrier(ch, call_args, timeout) -> None:
    empty = [[] for _ in range(ch.size)]
    ch.exchange(Call("barrier", None, None, -1, *call_args), empty, empty, timeout=timeout).wait()
