"""``agree``: each rank's local verdict in, every rank's decision out.

[Note: one way to agree]
A decision that depends on what each rank saw must come out the same on every rank: ranks that
branch differently issue different collectives (a hang, or wrong numbers) or let replicas drift
apart silently. Every such decision in ragged goes through :func:`agree`, in up to two rounds:

* the **verdict**: a few numbers per rank (flags, counts, a loss, hashes), one all-reduce over
  the shard group and one over the replicas, if any (none on a single rank) (``op="max"``: "did any rank ...", and equality
  as ``max`` of ``(h, -h)``, equal up to sign exactly when every rank holds ``h``; ``"sum"``:
  counts and means). Every rank gets the same reduced values, as a host list: the one host sync
  of the decision;
* the **explanation**, only when the reduced verdict calls for it: ``explain(values)`` returns
  this rank's details (or ``None``, on every rank alike: it reads only the reduced values), and
  every rank gets every rank's details (``all_gather_object``), so each can raise the same error
  naming the ranks and what differs, or merge what each saw. The cheap round runs every time,
  the costly one only on a difference (or with no verdict at all: a checkpoint's rounds).

Both rounds run outside the comm's scope (see [Note: what a collective call carries] in
``_base.py``): they are the same calls on every rank, whatever plans the ranks hold.

Its users: the plan check (``transforms/_check.py``: ``ranks_agree``, the leaf-by-leaf
explanation of ``check_plans``, which also carries the deferred ledger's digest), the training
step's end-of-call agreement (``fsdp/_grad.py``: the loss, failures, deviations from the
schedule, which leaves got gradients), every round of the checkpoint protocol
(``checkpoint/_dcp.py``), ``apply_if_finite`` and ``clip_by_global_norm(error_if_nonfinite=True)``
(``optim/_finite.py``), ``fsdp.init``'s check that every rank starts from the same values
(``fsdp/_equal_start.py``, through ``ranks_agree``).

Not on it: the per-call identity the transports check (each call's header on gloo, the
deferred ledger on NCCL, see [Note: two transports] in ``_torch.py``). It is checked with every
collective itself, before the data moves (gloo) or without a host sync (NCCL); a round of
:func:`agree` per call would add a round trip, or a device-to-host sync, to every collective,
which is what those mechanisms exist to avoid. [Note: what each agreement catches] in
``ragged/transforms/_check.py`` says what each catches that the others cannot.

[Note: a rank's error joins the next agreement]
A rank that fails between two agreements (a misuse of its own: a format callable that returns a
string on this rank only, a batch its micro-batches do not divide, a learning-rate schedule that
turns negative, params it cannot read) must not simply raise: its peers would wait for it in
their next collective until a timeout (and, when the caller catches the error and goes on, for
ever). So ``agree_on`` (``ragged/transforms/_check.py``, behind ``check_plans`` and ``fsdp.init``'s
values check) lets the failed rank take part in the round its peers run next with its error in
place of its token: the tokens differ, so every rank takes the explanation round, where the failed rank's details are
where it failed and its error. It then raises its own error; every other rank a
:class:`~ragged.RaggedError` naming it ("fsdp.make_step failed on rank 1 (...): RaggedTypeError:
..."), within the round's time, and the comm stays usable (nothing was left half-issued). Ranks
that all fail alike agree at once and raise their own errors without the second round.
``rg.fsdp.make_step`` / ``value_and_grad`` join the step's start-of-call agreement (the next one
their peers run), the step's local checks (``Step.__call__``: the state, the batch, the optimizer's
settings and learning rates) join that same round, ``fsdp.init`` its values check, and the
checkpoint's preparation its first round (``checkpoint/_dcp.py: on_every_rank``). Errors after the
step's end-of-call agreement (in the optimizer's update) poison the comm instead (see
[Note: what a collective call carries] in ``collectives/_base.py``): the ranks' parameters may then
differ, so the job must not go on with them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["agree", "Agreed", "agree_collectives", "everyone", "on_device"]


class Agreed(NamedTuple):
    """What :func:`agree` returns, the same on every rank: ``values`` the reduced verdict,
    ``details`` every rank's details (mesh order) or ``None`` when none were asked for."""

    values: list
    details: list | None


def agree(comm, verdict=(), *, op: str = "max", explain: Callable[[list], Any] | None = None,
          label: str = "agreement") -> Agreed:
    """Each rank's local ``verdict`` in, every rank's decision out: see [Note: one way to agree].

    Args:
        comm: the ranks that decide (the shard group, times its replicas).
        verdict: this rank's numbers (ints: reduced as int64, exact to 63 bits; else float64),
            or a 1-D int64 / float64 tensor on the comm's device (numbers still there, such as a
            loss: read on the host only with the result, in the round's one sync).
        op: ``"max"`` or ``"sum"``.
        explain: ``explain(values) -> details | None``; details go to every rank.
        label: the calls' label (the same on every rank).

    Examples:
        >>> import ragged as rg
        >>> def decide(comm):
        ...     bad = comm.rank == 1                      # only rank 1 saw a problem
        ...     got = agree(comm, [int(bad)], explain=lambda v: f"rank {comm.rank}" if v[0] else None)
        ...     return got.values, got.details
        >>> rg.collectives.simulate(2, decide)
        [([1], ['rank 0', 'rank 1']), ([1], ['rank 0', 'rank 1'])]
    """
    values = verdict if isinstance(verdict, torch.Tensor) else list(verdict)
    scope = getattr(comm, "scope", None)
    if scope is not None:
        comm.scope = None
    try:
        calls = agree_collectives(comm, len(values))  # what it issues, said once
        if calls:
            t = values.clone() if isinstance(values, torch.Tensor) else on_device(values, getattr(comm, "device", None))
            for _, axis, _, _ in calls:
                (comm.all_reduce if axis == "shard" else comm.all_reduce_replicas)(t, op=op, label=label)
            values = t.tolist()
        elif isinstance(values, torch.Tensor):
            values = values.tolist()
        detail = None if explain is None else explain(values)
        return Agreed(values, None if detail is None else comm.all_gather_object(detail))
    finally:
        if scope is not None:
            comm.scope = scope


def on_device(values, device) -> torch.Tensor:
    """``values`` (ints: int64, else float64) as a 1-D tensor on ``device``, without a host sync:
    on CUDA copied from pinned memory behind the stream's earlier work (a pageable copy would make
    the host wait for the device)."""
    dtype = torch.int64 if all(isinstance(v, int) for v in values) else torch.float64
    host = torch.tensor(values, dtype=dtype)
    if device is None or torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def agree_collectives(comm, values: int) -> tuple[tuple[str, str, int, int], ...]:
    """What one :func:`agree` of a verdict of ``values`` numbers issues on ``comm``, as ``(kind,
    axis, calls, bytes)`` (see ``GradientTransformation.collectives``; no explanation round):
    :func:`agree` issues exactly these, and the predictor counts them."""
    replicas = getattr(comm, "num_replicas", 1)
    if comm is None or not values or comm.world_size * replicas == 1:
        return ()
    return (("all_reduce", "shard", 1, 8 * values),) + ((("all_reduce", "replica", 1, 8 * values),) if replicas > 1 else ())


def everyone(comm) -> tuple[int, int]:
    """``(index, count)`` of this process among all processes ``comm.all_gather_object`` reaches
    (whose order an explanation round's details follow): the shard group, times the replicas for
    an HSDP comm (replica-major)."""
    replicas = getattr(comm, "num_replicas", 1)
    return getattr(comm, "replica_rank", 0) * comm.world_size + comm.rank, replicas * comm.world_size
