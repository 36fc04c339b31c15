"""Every rank starts from the same values: checked by a fingerprint, or made so from one rank.

[Note: ranks start from the same values]
``fsdp.init`` shards each rank's own copy of the parameters: rank k keeps its piece of *its*
values. Ranks that built the model from different seeds would therefore train a model that is
neither rank's (a mix of pieces), with nothing failing. So when ``fsdp.init`` is given values
(a module with real tensors, a state dict, a pytree), it first checks that every rank of the
comm's mesh (the shard group and, for HSDP, the replicas) holds the same ones:

* each rank takes the dtype, the shape and a CRC-32 of the bytes of every value it brought:
  each unit's parameters and, for a module, its buffers (which stay on the module and are not
  sharded). A CRC of the bytes compares bits, not numbers: a change inside any 4 consecutive
  bytes (one ulp of one fp32 element, a flipped sign of zero) always changes it, and any other
  change (a permutation, other weights) leaves it equal with probability 2**-32 per value, so
  a model that differs in k values passes with probability 2**(-32 k). A cryptographic hash would
  cost 3-4 times more for no practical gain (hashlib's SHA-256 here: about 2 GB/s per core; zlib's
  CRC-32: 3.5 times that). It is one read of the values on the host (a device-to-host copy first
  on a GPU, 64 MiB at a time); ``bench/init_check.py`` measures it, see ``docs/lifecycle.md``;
* the ranks agree on the hash of those hashes in one :func:`~ragged.transforms._check.agree_on`
  round (the plan check's agreement primitive: a local token in, every rank's verdict out;
  one all-reduce of two int64s, and one across the replicas);
* a rank whose params could not be read (a missing key, a wrong shape: a misuse of its own)
  joins the same round with its error instead of its hashes (see [Note: a rank's error joins the
  next agreement] in ``ragged/collectives/_agree.py``): it raises that error, every other rank a
  ``RaggedError`` naming it, and none waits in a collective for a rank that left;
* only when they differ do they exchange the per-value hashes (the explanation round of
  :func:`~ragged.collectives._agree.agree`, see [Note: one way to agree]) and
  every rank raises :class:`ParamsMismatchError` naming the first differing value, the ranks on
  each side and the fix, before any shard, optimizer state or placeholder is made.

What ragged itself creates is equal by construction and is not checked: a module built on
``meta`` (initialised from ``seed`` and each module's name; only the values the user brought
real are checked), a Hugging Face directory (``rg.checkpoint.pretrained``) or an FSDP2
checkpoint, which every rank reads from the same files.

``fsdp.init(..., broadcast_from=r)`` instead makes every rank start from rank r's values, as
FSDP1's ``sync_module_states=True`` does: no check, each unit is reduce-scattered (summed)
from rank r's values and ``-0.0`` on every other rank (``x + (-0.0) == x`` for every ``x``,
``+0.0`` and NaN included, so each rank receives rank r's bits exactly), over the shard group and
the replicas; floating-point buffers of a module are all-reduced the same way (in place, so a
module shared by simulated ranks stays right). The communication is one reduce-scatter of the
model, the memory one unit's full buffer at a time. The module's own tensors, if kept
(``release_module=False``), are left as they were.
"""

from __future__ import annotations

import zlib

import torch

from ragged._errors import RaggedValueError, check_int
from ragged.collectives._channel import raised_on_every_rank
from ragged.collectives._agree import everyone
from ragged.transforms._check import agree_on
from ragged.transforms._reduce_scatter import reduce_scatter

__all__ = ["ParamsMismatchError", "check_equal", "check_source", "shard_from", "sync_buffers"]

_CHUNK = 1 << 26  # bytes hashed per device-to-host copy


class ParamsMismatchError(RaggedValueError):
    """The ranks hold different values for what ``fsdp.init`` shards (see [Note: ranks start
    from the same values]): raised on every rank, before anything is sharded.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> units = fsdp.make_units({"w": torch.zeros(4)}, world_size=2)
        >>> def run(comm):                           # each rank brings its own values
        ...     try:
        ...         fsdp.init(units, {"w": torch.full((4,), float(comm.rank))}, rg.optim.sgd(0.1), comm)
        ...     except fsdp.ParamsMismatchError as err:
        ...         return str(err).split(". ")[0]
        >>> print(rg.collectives.simulate(2, run)[1])          # every rank raises
        fsdp.init: the ranks hold different values for ['w'] (unit 'rest'): ranks [0] vs ranks [1]
    """


def digest(t: torch.Tensor) -> str:
    """``t``'s dtype, shape and the CRC-32 of its bytes (see [Note: ranks start from the same values])."""
    crc = 0
    flat = t.detach().reshape(-1)
    if flat.numel():
        raw = flat.contiguous().view(torch.uint8)
        for i in range(0, raw.numel(), _CHUNK):
            crc = zlib.crc32(raw[i : i + _CHUNK].cpu().numpy(), crc)
    return f"{str(t.dtype)[6:]}{list(t.shape)}:{crc:08x}"


def check_source(broadcast_from, comm) -> int | None:
    """``broadcast_from`` validated against ``comm``'s mesh."""
    if broadcast_from is None:
        return None
    n = everyone(comm)[1]
    return check_int("broadcast_from", broadcast_from, 0, n, fix=f" Pass None or a rank of the comm's {n} ranks.")


def _explain(everyone: list[list[tuple[str, str]]], replicas: int) -> str:
    keys = list(dict.fromkeys(k for rank in everyone for k, _ in rank))
    tables = [dict(rank) for rank in everyone]
    differ = [k for k in keys if len({t.get(k) for t in tables}) > 1]
    first = differ[0]
    sides: dict[str | None, list[int]] = {}
    for r, t in enumerate(tables):
        sides.setdefault(t.get(first), []).append(r)
    kinds = {h.partition(":")[0] for h in sides if h is not None}  # dtype and shape
    groups = " vs ".join(f"ranks {rs}" + (" (missing)" if h is None else f" ({h.partition(':')[0]})" if len(kinds) > 1
                                          else "") for h, rs in list(sides.items())[:4])
    more = f" ({len(differ)} of {len(keys)} values differ)" if len(differ) > 1 else ""
    where = " (mesh order, replica-major)" if replicas > 1 else ""
    return (
        f"fsdp.init: the ranks hold different values for {first}: {groups}{where}{more}. Each rank shards its own "
        "copy, so all must start equal, or the model trains a mix of them. Fix: fsdp.init(..., broadcast_from=0) "
        "(rank 0's values everywhere, as FSDP1's sync_module_states), or seed alike on every rank before building "
        "(rg.collectives.simulate's ranks are threads sharing one generator: build once outside, or draw from a "
        "torch.Generator().manual_seed(s) of each rank's own), or build on meta for fsdp.init to initialise."
    )


def check_equal(items: list[tuple[str, torch.Tensor]], comm, *, failure: BaseException | None = None,
                values: bool = True) -> None:
    """Raises on every rank unless every rank of ``comm``'s mesh read its values and, with
    ``values``, holds the same ``items`` (``(name, tensor)`` pairs, the name as the message shows
    it): :class:`ParamsMismatchError`, or, where reading them raised ``failure`` on some rank, that
    error on that rank and a :class:`~ragged.RaggedError` naming it on the others.

    See [Note: ranks start from the same values]."""
    if everyone(comm)[1] == 1 and failure is None:
        return
    mine = [(name, digest(t)) for name, t in items] if values and failure is None else []
    token = "fsdp.init values|" + "|".join(f"{k}={h}" for k, h in mine)
    details = agree_on(comm, token, lambda: mine, failure=failure, where="fsdp.init",
                       label="fsdp.init values")
    if details is not None:
        raise raised_on_every_rank(ParamsMismatchError(_explain(details, getattr(comm, "num_replicas", 1))))


def shard_from(plan, tree: dict[str, torch.Tensor], comm, source: int):
    """This rank's DBuffer of rank ``source``'s ``tree`` under ``plan`` (every rank passes its
    own tree; only ``source``'s values are used, bit for bit)."""
    if everyone(comm)[0] == source:
        return reduce_scatter(plan, {p: t.detach() for p, t in tree.items()}, comm, op="sum")
    flat = torch.full((plan.buffer_numel,), -0.0, dtype=plan.dtype, device=comm.device)
    replicated = torch.full((plan.replicated_numel,), -0.0, dtype=plan.dtype, device=comm.device)
    return reduce_scatter(plan, flat, comm, op="sum", replicated=replicated)


def sync_buffers(module: torch.nn.Module, comm, source: int) -> None:
    """Sets every numeric buffer of ``module`` to rank ``source``'s values, in place."""
    mine = everyone(comm)[0] == source
    label = "fsdp.init broadcast_from (buffers)"
    synced = []
    for _, b in module.named_buffers():
        if b.dtype == torch.bool or b.is_meta:
            continue
        value = b.detach().reshape(-1).clone() if mine else torch.full((b.numel(),), -0.0, dtype=b.dtype, device=b.device)
        comm.all_reduce(value, op="sum", label=label)
        comm.all_reduce_replicas(value, op="sum", label=label)
        synced.append((b, value))
    if synced:
        comm.barrier()  # a module shared by simulated ranks: every rank has read it before any rank writes
        with torch.no_grad():
            for b, value in synced:
                b.copy_(value.view(b.shape))
