"""Input validation and the cross-rank plan check shared by the transforms.

[Note: plan check before collectives]
Ranks holding different plans would exchange differently sized buffers: at best a hang, at
worst silently wrong numbers. Two mechanisms keep that from happening:

* **every call** carries what it moves (see [Note: what a collective call carries] in
  ``ragged/collectives/_base.py``): before its collective, every transform declares its
  *scope*, the operation (e.g. ``"gather:torch.bfloat16"``, ``"reduce_scatter:mean:..."``) and
  the fingerprints of the plans it moves (:func:`check_plans` sets ``comm.scope``; the
  entry point's :func:`poisons` restores it on exit), and the backend checks it with the
  call's operation, dtype and sizes on every rank: the torch backend on gloo before the data
  moves (``handshake="header"``, its default: no extra round trip, the header rides ahead of
  the data), on NCCL deferred to the next agreement point (``handshake="deferred"``), the
  simulated backend at the rendezvous. This is what catches a rank that later switches, alone,
  to another plan, dtype or op (``"sum"`` vs ``"mean"``), skips or adds a call;
* an **agreement round** on the plans (``ranks_agree``: one :func:`~ragged.collectives._agree.agree`
  of two int64s, see [Note: one way to agree]; ``max`` of
  ``(h, -h)`` for a 62-bit hash ``h`` of the token gives ``(max h, -min h)``, equal up to sign
  exactly when every rank holds the same token), plus one more across the replicas of an HSDP
  mesh. Only when tokens differ do the ranks all-gather a summary of their plans (one small
  ``all_gather_object``) and raise :class:`~ragged.PlanMismatchError` on every rank, naming
  what differs, down to the leaf (``leaf ['emb']: shape (11, 8) vs (13, 8)``). Every rank
  takes the same branch, so nothing hangs. The round runs outside the scope (its own call
  is the same on every rank, whatever the plans), and folds in the digest of a
  ``"deferred"`` comm's unverified calls.

``comm.plan_check`` chooses when the round runs:

* ``"first_use"`` (default of ``from_torch``): once per plan and comm. With the per-call
  identity this is complete: a first use is explained leaf by leaf, any later difference is
  raised by the call's own check (naming the operation, plan and label of both sides).
  ``rg.fsdp``'s step runs the round on all its units once per step whatever the mode (which
  on NCCL is also the step's deferred verification).
* ``"every_call"`` (default of the simulated backend, and of ``from_torch`` under
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, as torch's own per-call collective checks): every
  ``shard``, ``gather``, ``reduce_scatter`` and ``redistribute`` runs the round first, so each
  difference is explained leaf by leaf, for one small all-reduce per call (0.1-1 ms on gloo
  on this 2-core machine, see ``bench/collectives.py``; on NCCL also a device-to-host sync).

``comm.checked_plans`` (a dict) memoises fingerprints by plan identity (``plan.fingerprint()``
hashes every leaf; the memo keeps the plan alive, so its id is not reused) and, in
``"first_use"``, records which fingerprints were agreed.

A rank that raises in a transform before its collective (bad gradients, a plan over more
ranks than the comm has) would leave its peers waiting in that collective: the entry points are
wrapped in :func:`poisons`, which poisons the comm (``comm.poison``) so that the peers raise
:class:`~ragged.CollectiveError` "rank k failed: <the error>" promptly.

[Note: what each agreement catches]
Three agreements, each catching what the others cannot:

* the **plan round** above (first use of a plan, every transform under ``"every_call"``, and
  once per call of ``rg.fsdp``'s step, whose token adds the step's options, the schedule's
  fingerprint, the frozen set and the optimizer's settings, each named): the only one that
  explains a difference leaf by leaf (``tests/distributed/test_engine_gloo.py:
  test_plan_mismatch_raises_on_every_rank``) or option by option, and that sees options which
  change no call's size (a rank with ``micro_batches=2``, another learning rate:
  ``test_fsdp_gloo.py: test_rank_switching_step_options_raises_on_every_rank``,
  ``test_models_gloo.py: test_settings_that_differ_are_named_on_every_rank``);
* the **per-call identity** (a call's operation, dtype, sizes and label): checked by gloo's
  headers before the data moves, by the simulated backend at its rendezvous, and under
  ``"deferred"`` recorded by the ledger and verified at the next agreement point (the plan
  round folds the ledger's digest in; ``comm.verify()``; the periodic device-side check, the
  only check with no agreement point at all). It catches what a rank does after the plans were
  agreed: another plan, dtype or op, a skipped or added call, another label
  (``test_faults_gloo.py``: the mismatch scenarios in both transports;
  ``test_deferred_periodic_check_needs_no_agreement_point``; ``test_models_gloo.py:
  test_collectives_that_diverged_before_a_call_are_reported_by_then``);
* the step's **end-of-call agreement** (``ragged/fsdp/_grad.py``): not about the calls issued
  but about what the data did (a loss that raised on one rank, a rank that left the schedule,
  late or missing gradients), so that every rank takes the same branch: raise, or rerun with
  the learnt schedule (``test_faults_gloo.py: test_error_inside_fsdp_step_makes_every_peer_raise``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ragged._errors import LayoutError, PlanMismatchError, RaggedError, RaggedTypeError, RaggedValueError
from ragged._pytree import flatten_with_keystr
from ragged.collectives._agree import agree, agree_collectives
from ragged.collectives._base import CallScope, poison_on_error
from ragged.collectives._channel import raised_on_every_rank
from ragged.spec._plan import LayoutPlan

__all__ = ["check_plan", "check_plans", "ranks_agree", "agree_on", "joins_next_agreement", "check_comm",
           "flatten_like_plan", "check_plan_type", "poisons"]


def poisons(comm_arg: str):
    """Decorates a transform entry point: errors raised inside poison the comm found in the
    argument ``comm_arg`` (``"comm"``, or ``"pending.comm"`` for an attribute of an argument),
    and ``comm.scope`` is restored on exit. See [Note: plan check before collectives]."""
    name, _, attr = comm_arg.partition(".")

    def decorate(fn):
        pos = list(inspect.signature(fn).parameters).index(name)

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            comm = args[pos] if len(args) > pos else kwargs.get(name)
            if attr and comm is not None:
                comm = getattr(comm, attr, None)
            if comm is None:
                return fn(*args, **kwargs)
            with poison_on_error(comm):
                return fn(*args, **kwargs)

        return entry

    return decorate


def joins_next_agreement(where: str):
    """Decorates an entry point that runs before a step's start-of-call agreement and does not
    communicate (``fsdp.make_step``, ``fsdp.value_and_grad``): an error it raises on this rank
    joins that agreement, the round its peers run next, so that every rank raises (see [Note: a
    rank's error joins the next agreement] in ``ragged/collectives/_agree.py``). Without a
    usable comm (none, an abstract one, a single rank) the error is raised as it is."""

    def decorate(fn):
        pos = list(inspect.signature(fn).parameters).index("comm")

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                comm = args[pos] if len(args) > pos else kwargs.get("comm")
                if getattr(e, "_ragged_every_rank", False) or not hasattr(comm, "all_reduce"):
                    raise
                try:
                    agree_on(comm, "", failure=e, where=where)
                except BaseException as joined:  # e itself, or the round's own failure (an abstract comm)
                    if joined is not e:
                        raise e from None
                    raise

        return entry

    return decorate


def check_plan_type(plan, where: str) -> LayoutPlan:
    if not isinstance(plan, LayoutPlan):
        raise RaggedTypeError(f"{where}: plan must be a ragged LayoutPlan (from rg.make_plan), got {type(plan).__name__}.")
    return plan


def check_comm(plan: LayoutPlan, comm, where: str) -> None:
    """A plan may shard over fewer ranks than the comm has (the rest hold empty shards, see
    ``redistribute``), never over more."""
    if comm.world_size < plan.world_size:
        raise RaggedValueError(
            f"{where}: the plan shards over world_size={plan.world_size} ranks but the comm's shard group has "
            f"{comm.world_size}. Fix: plan with rg.make_plan(..., world_size=comm.world_size)."
        )


def _hash62(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2  # -h fits int64


def ranks_agree(comm, token: str, label: str = "plan agreement") -> bool:
    """Whether every rank of ``comm``'s mesh (shard group x replicas) passed the same ``token``.

    One :func:`~ragged.collectives._agree.agree` round of two int64s (see [Note: plan check
    before collectives]); every rank gets the same answer. A ``"deferred"`` comm's digest of unverified calls rides along (two more
    int64s); if it differs, every rank raises :class:`~ragged.PlanMismatchError` naming the
    first call that differs.
    """
    if comm.world_size * comm.num_replicas == 1:
        return True
    h = _hash62(token)
    digest = getattr(comm, "ledger_digest", lambda: None)()
    got = agree(comm, [h, -h] if digest is None else [h, -h, digest, -digest], label=label).values
    if digest is not None:
        if got[2] != -got[3]:
            comm.explain_ledger()
        comm.confirm_ledger()
    return got[0] == -got[1]


def agree_on(comm, token: str, details: Callable[[], Any] = lambda: None, *, failure: BaseException | None = None,
             where: str = "", label: str = "plan agreement") -> list | None:
    """One :func:`ranks_agree` round on ``token``, joined with this rank's ``failure`` instead
    when it has one (see [Note: a rank's error joins the next agreement] in ``_agree.py``).

    Returns ``None`` when every rank passed the same token and none failed; otherwise every
    rank's ``details()`` in mesh order (the explanation round), for the caller to say what differs.

    Raises:
        the ``failure`` itself, on a rank that failed; :class:`~ragged.RaggedError` naming the
        first failing rank (mesh order), ``where`` it failed and its error, on the others.
    """
    said = None if failure is None else (where, f"{type(failure).__name__}: {str(failure).rstrip('.')}")
    agreed = ranks_agree(comm, f"failed|{said}" if said else token, label=label)  # the same answer on every rank
    if agreed and failure is None:
        return None
    everyone = None if agreed else agree(comm, explain=lambda _: (said, None if said else details())).details
    if failure is not None:  # this rank's own error, on every rank that raised one
        raise raised_on_every_rank(failure)
    failed = [(r, d[0]) for r, d in enumerate(everyone) if d[0] is not None]
    if not failed:
        return [d[1] for d in everyone]
    r, (place, text) = failed[0]
    replicas = " replica-major," if getattr(comm, "num_replicas", 1) > 1 else ""
    raise raised_on_every_rank(RaggedError(
        f"{place} failed on rank {r} (mesh order,{replicas} {len(failed)} of {len(everyone)} ranks failed): {text}. "
        f"Every rank raises this at the agreement the failed rank joined, instead of waiting for it."))


def agreement_collectives(comm, *, every_call: bool = True) -> tuple[tuple[str, str, int, int], ...]:
    """What one :func:`ranks_agree` round issues, as ``(kind, axis, calls, bytes)`` (see
    ``GradientTransformation.collectives``); with ``every_call=False``, what :func:`check_plans`
    issues once its plans are known (none under ``comm.plan_check == "first_use"``)."""
    if _first_use(comm, every_call):
        return ()
    return agree_collectives(comm, 2 if getattr(comm, "ledger_digest", lambda: None)() is None else 4)


def _first_use(comm, every_call: bool) -> bool:
    """Whether :func:`check_plans` agrees on a plan only the first time it sees it on ``comm``."""
    memo = getattr(comm, "checked_plans", None)
    return not every_call and getattr(comm, "plan_check", "every_call") == "first_use" and memo is not None


_SCOPES: dict[tuple, CallScope] = {}


def _scope(operation: str, plans, fps: tuple[str, ...]) -> CallScope:
    hit = _SCOPES.get((operation, fps))
    if hit is None:
        if len(_SCOPES) > 4096:
            _SCOPES.clear()
        hit = _SCOPES[(operation, fps)] = CallScope(_hash62(operation + "|" + ",".join(fps)),
                                                     f"{operation} on {_plans_in_words(plans, fps)}")
    return hit


def _plans_in_words(plans, fps) -> str:
    if len(plans) == 1:
        p = plans[0]
        return f"plan {fps[0][:10]} ({p.num_leaves} leaves, {p.shard_size} per rank of {p.world_size})"
    return f"{len(plans)} plans " + ",".join(fp[:8] for fp in fps)


def _fingerprint(plan: LayoutPlan, memo) -> str:
    if memo is None:
        return plan.fingerprint()
    hit = memo.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    if len(memo) > 4096:  # bound the memo; entries are cheap to recompute
        memo.clear()
    fp = plan.fingerprint()
    memo[id(plan)] = (plan, fp)
    return fp


def _summary(plan: LayoutPlan):
    return (
        plan.fingerprint(),
        plan.world_size,
        plan.shard_size,
        str(plan.dtype),
        tuple((l.path, l.shape, str(l.dtype), l.offset, l.granule) for l in plan.leaves),
        tuple((l.path, l.shape, str(l.dtype)) for l in plan.replicated),
    )


def _describe(mine, other) -> str:
    """The most basic difference first: world size, dtype, leaf set/shapes, then layout."""
    diffs = []
    if mine[1] != other[1]:
        diffs.append(f"world_size {mine[1]} vs {other[1]}")
    if mine[3] != other[3]:
        diffs.append(f"dtype {mine[3]} vs {other[3]}")
    fields = ("path", "shape", "dtype", "offset", "granule")
    for kind, la, lb in (("sharded", mine[4], other[4]), ("replicated", mine[5], other[5])):
        pa, pb = {x[0]: x for x in la}, {x[0]: x for x in lb}
        if set(pa) != set(pb):
            diffs.append(
                f"{kind} leaves: only on the first {sorted(set(pa) - set(pb))}, only on the second {sorted(set(pb) - set(pa))}"
            )
        for path in sorted(set(pa) & set(pb)):
            d = [f"{f} {x} vs {y}" for f, x, y in zip(fields[1:3], pa[path][1:3], pb[path][1:3]) if x != y]
            if d:
                diffs.append(f"leaf {path}: " + ", ".join(d))
    if not diffs and mine[2] != other[2]:
        diffs.append(f"shard_size {mine[2]} vs {other[2]}")
    if not diffs:
        for kind, la, lb in (("sharded", mine[4], other[4]),):
            pa, pb = {x[0]: x for x in la}, {x[0]: x for x in lb}
            for path in sorted(set(pa) & set(pb)):
                d = [f"{f} {x} vs {y}" for f, x, y in zip(fields[3:], pa[path][3:], pb[path][3:]) if x != y]
                if d:
                    diffs.append(f"leaf {path}: " + ", ".join(d))
    if not diffs:
        diffs.append("leaf order, tree structure or planning options (align/strategy/specs)")
    return "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")


def _explain(calls) -> str:
    """``calls``: per rank ``(operation, fingerprints, summaries, options)``; at least two differ."""
    distinct = list(dict.fromkeys((c[0], c[1]) for c in calls))
    (op_a, fps_a), (op_b, fps_b) = distinct[0], distinct[1]
    ranks_a = [r for r, c in enumerate(calls) if (c[0], c[1]) == (op_a, fps_a)]
    ranks_b = [r for r, c in enumerate(calls) if (c[0], c[1]) == (op_b, fps_b)]
    sums_a, sums_b = calls[ranks_a[0]][2], calls[ranks_b[0]][2]
    if op_a != op_b:
        what = f"the operation: {op_a} vs {op_b}"
    elif len(fps_a) != len(fps_b):
        what = f"the number of plans: {len(fps_a)} vs {len(fps_b)}"
    else:
        i = next(i for i, (x, y) in enumerate(zip(fps_a, fps_b)) if x != y)
        where = f"plan {i} of {len(fps_a)}: " if len(fps_a) > 1 else ""
        what = where + _describe(sums_a[i], sums_b[i])
    return (
        f"ranks hold different plans or call different operations: ranks {ranks_a} vs ranks {ranks_b} differ in "
        f"{what}. Every rank must build the plan from the same shapes, specs, world_size and options, and "
        f"issue the same transforms in the same order (check that all ranks build the same model and call "
        f"make_plan the same way)."
    )


def check_plans(plans: Sequence[LayoutPlan], comm, operation: str, *, every_call: bool = False,
                summary=None, explain=None, options: Sequence[tuple[str, str]] = (),
                failure: BaseException | None = None, where: str = "") -> None:
    """Makes every rank of ``comm`` agree on ``operation`` over ``plans`` before it communicates.

    See [Note: plan check before collectives]. ``operation`` names the call and anything else
    that decides the bytes moved (e.g. ``"gather:torch.bfloat16"``); ``every_call=True`` agrees
    even when ``comm.plan_check == "first_use"`` (``rg.fsdp``'s step, once per step). Plans of
    another layout type (anything with ``fingerprint()``, e.g. ``spec.MeshPlan``) bring their own
    ``summary(plan)`` (what each rank sends when they differ) and ``explain(calls)`` (the message
    from every rank's ``(operation, fingerprints, summaries, options)``). ``options``: ``(name,
    value)`` pairs of text the ranks must share too; a difference is named by option, with the
    value on each side. ``failure``: this rank's error since the last agreement, which joins the
    round instead (raised on every rank, see :func:`agree_on`; ``where`` says where it happened).

    Raises:
        PlanMismatchError: on every rank, if any rank holds other plans, options or calls another operation.
    """
    memo = getattr(comm, "checked_plans", None)
    fps = () if failure is not None else tuple(_fingerprint(p, memo) for p in plans)
    first_use = _first_use(comm, every_call) and failure is None and not options
    if first_use and all(fp in memo for fp in fps):
        _declare(comm, operation, plans, fps)
        return
    token = "|".join((operation, ",".join(fps), *(f"{k}={v}" for k, v in options)))
    calls = agree_on(comm, token, lambda: (operation, fps, [(summary or _summary)(p) for p in plans], tuple(options)),
                     failure=failure, where=where)  # one label for every round: the token compares
    if calls is not None:
        raise raised_on_every_rank(PlanMismatchError(_explain_options(calls) or (explain or _explain)(calls)))
    if first_use:
        for fp in fps:
            memo[fp] = True
    _declare(comm, operation, plans, fps)


def _explain_options(calls) -> str | None:
    """The options that differ between the first two groups of ranks (``None``: none do)."""
    groups: dict[tuple, list[int]] = {}
    for r, c in enumerate(calls):
        groups.setdefault(c[3], []).append(r)
    if len(groups) < 2:
        return None
    (a, ranks_a), (b, ranks_b) = list(groups.items())[:2]
    da, db = dict(a), dict(b)
    differ = [k for k in dict.fromkeys([*da, *db]) if da.get(k) != db.get(k)]
    said = "; ".join(f"{k}: {da.get(k, '(not set)')} on ranks {ranks_a} vs {db.get(k, '(not set)')} on ranks {ranks_b}"
                     for k in differ[:3])
    more = f" ({len(differ)} options differ)" if len(differ) > 3 else ""
    return (f"the ranks' {calls[0][0]} options differ: {said}{more}. Every rank must pass the same options (and "
            "the same optimizer settings) on every call; a value that depends on the rank (a callable that reads "
            "comm.rank, a setting read from a rank's own file) makes them differ.")


def _declare(comm, operation, plans, fps) -> None:
    """Sets the scope the following calls carry (see [Note: plan check before collectives])."""
    if hasattr(comm, "scope"):
        comm.scope = _scope(operation, plans, fps)


def check_plan(plan: LayoutPlan, comm, operation: str = "check") -> None:
    """:func:`check_plans` of one plan."""
    check_plans((plan,), comm, operation)


def flatten_like_plan(plan: LayoutPlan, tree, what: str, *, device=None, allow_dtypes=None):
    """Leaves of ``tree`` in plan leaf-index order, validated against ``plan``.

    Raises (before any communication) TypeError / LayoutError naming the key path, the shape
    and the fix.
    """
    paths, leaves, treedef = flatten_with_keystr(tree)
    if treedef != plan.treedef:
        expected = [l.path for l in sorted(plan.leaves + plan.replicated, key=lambda l: l.index)]
        missing, extra = sorted(set(expected) - set(paths)), sorted(set(paths) - set(expected))
        raise LayoutError(
            f"{what} does not have the plan's tree structure: missing {missing}, unexpected {extra}"
            + ("" if missing or extra else f" (structure {treedef} vs plan {plan.treedef})")
            + ". Fix: pass a tree shaped like the params the plan was made from."
        )
    for layout in plan.leaves + plan.replicated:
        leaf = leaves[layout.index]
        if not isinstance(leaf, torch.Tensor):
            raise RaggedTypeError(f"{what}{layout.path} is a {type(leaf).__name__}, not a torch.Tensor.")
        if tuple(leaf.shape) != layout.shape:
            raise LayoutError(
                f"{what}{layout.path} has shape {tuple(leaf.shape)} but the plan expects {layout.shape}. "
                "Fix: pass the tensors the plan was made from (or re-plan).",
                path=layout.path,
                shape=leaf.shape,
            )
        if leaf.is_meta:
            raise LayoutError(
                f"{what}{layout.path} is a meta tensor (shape {layout.shape}); it has no data to move. "
                "Fix: materialise the parameters (e.g. module.to_empty(device=...) then init) first.",
                path=layout.path,
                shape=leaf.shape,
            )
        if device is not None and leaf.device.type != torch.device(device).type:
            raise LayoutError(
                f"{what}{layout.path} is on {leaf.device} but the comm works on {device}. "
                f"Fix: move it with .to({str(device)!r}).",
                path=layout.path,
                shape=leaf.shape,
            )
        if not (leaf.is_floating_point() or leaf.is_complex()) and plan.dtype.is_floating_point:
            raise LayoutError(
                f"{what}{layout.path} has dtype {leaf.dtype} but the plan's buffer is {plan.dtype}: an integer "
                "or bool tensor cannot be cast into a floating buffer safely. Fix: plan integer buffers "
                "separately, or keep them out of the sharded tree.",
                path=layout.path,
                shape=leaf.shape,
            )
    return leaves
