"""The data paths of ``torch.distributed`` under ``handshake="none"`` / ``"deferred"``: native
collectives (coalesced on NCCL), point-to-point batches and ``all_to_all_single``, one buffer
at a time; ``comm`` is the :class:`~ragged.collectives._torch.TorchCollectives` issuing them.

[Note: gloo all-gather and reduce-scatter paths]
On gloo the native flat all-gather / reduce-scatter (``all_gather_single`` /
``reduce_scatter_single``, called through ``ragged/_compat.py``: see [Note: torch 2.11 to 2.14]
there) are slow (gloo's reduce-scatter is a clone + a full all-reduce + a copy of the own chunk).
``"header"`` moves data point to point (see [Note: the data paths of the header
protocol] in ``_p2p.py``). Under ``"none"`` / ``"deferred"`` on gloo the measured fastest
paths are: all-gather ``"p2p"`` (one ``batch_isend_irecv`` into the output; ``all_to_all_single``
would need the input materialised m times, it rejects a stride-0 ``expand``), reduce-scatter
``"all_to_all"`` (``all_to_all_single`` into an m*S scratch buffer, then one local sum; it also
works under ``torch.func.grad`` where gloo's ``reduce_scatter_single`` does not, torch-notes).
NCCL uses the native ``all_gather_single`` / ``reduce_scatter_single`` (coalesced for
several buffers, ``AVG`` for mean). ``algorithm=`` forces a path under ``"none"`` / ``"deferred"``.

[Note: coalesced collectives of several buffers]
``all_gather_into_coalesced`` / ``reduce_scatter_into_coalesced`` move several buffers (the
buffers of one multi-buffer plan, see [Note: buffers of a plan] in ragged/spec/_plan.py) in ONE
call: under ``"header"`` one header per peer describes every buffer (op, dtype, each buffer's
size, identity, label), and the data of every (peer, buffer) pair travels in the same
batch (see ``_p2p.py``); under ``"none"`` / ``"deferred"`` on gloo one ``batch_isend_irecv``
or ``all_to_all_single`` per buffer, one ledger entry for the call; on NCCL ("native") the
per-buffer native ops inside ``torch.distributed._coalescing_manager`` (one NCCL group: one
launch; written, not run here: no GPU). gloo has no coalescing group, so ``algorithm="native"``
on gloo issues one native op per buffer.
"""

from __future__ import annotations

import torch.distributed as dist

from ragged import _compat
from ragged.collectives import _p2p
from ragged.collectives._scratch import SCRATCH

__all__ = ["gather_one", "scatter_one", "native"]


def _exchange(comm, send, recv):
    """One ``batch_isend_irecv``: ``send(j)`` to and ``recv(j)`` from every other rank ``j``."""
    ops = []
    for j in range(comm._world):
        if j != comm._rank:
            peer = comm._peer(j)
            ops += [dist.P2POp(dist.isend, send(j), peer, comm.group), dist.P2POp(dist.irecv, recv(j), peer, comm.group)]
    return dist.batch_isend_irecv(ops)


def gather_one(comm, output, input, algo):
    """Issues the all-gather of one buffer by ``algo`` (``"p2p"`` or ``"all_to_all"``): its
    works and what to run once they are waited (``None``: nothing)."""
    m, n = comm._world, input.numel()
    if algo == "all_to_all":
        staged = SCRATCH.take(m * n, input.dtype, input.device)
        staged.view(m, n).copy_(input.reshape(1, n).expand(m, n))
        w = dist.all_to_all_single(output, staged, group=comm.group, async_op=True)
        return [w], lambda: SCRATCH.give(staged)
    works = _exchange(comm, lambda j: input, lambda j: output[j * n : (j + 1) * n])
    output[comm._rank * n : (comm._rank + 1) * n].copy_(input)
    return works, None


def native(comm, fn, outs, ins, **kw):
    """Works of one native collective ``fn`` (``_compat.all_gather_single`` or
    ``_compat.reduce_scatter_single``) per buffer: coalesced into one launch on NCCL when there
    are several (the coalescing manager records ``fn``, the function this torch expects);
    one op per buffer elsewhere (gloo has no coalescing group)."""
    if len(outs) == 1 or "nccl" not in comm.backend:
        return [fn(o, i, group=comm.group, async_op=True, **kw) for o, i in zip(outs, ins)]
    with dist._coalescing_manager(group=comm.group, device=comm._device, async_ops=True) as cm:
        for o, i in zip(outs, ins):
            fn(o, i, group=comm.group, **kw)
    return [cm]


def scatter_one(comm, output, input, op):
    """Issues the reduce-scatter of one buffer by ``comm.rs_algorithm`` (``"all_to_all"`` or
    ``"p2p"``) into a scratch buffer: its works and the local reduction to run once waited."""
    m, n = comm._world, output.numel()
    recv = SCRATCH.take(m * n, input.dtype, input.device)
    chunks = recv.view(m, n)
    if comm.rs_algorithm == "all_to_all":
        works = [dist.all_to_all_single(recv, input, group=comm.group, async_op=True)]
    else:  # p2p
        works = _exchange(comm, lambda j: input[j * n : (j + 1) * n], lambda j: chunks[j])
        chunks[comm._rank].copy_(input[comm._rank * n : (comm._rank + 1) * n])

    def finish():
        _p2p.reduce_rows(chunks, op, output)
        SCRATCH.give(recv)

    return works, finish
