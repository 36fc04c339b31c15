"""Base types of ragged's functional optimizers (optax style).

A :class:`GradientTransformation` is a pair of pure functions:

* ``init(params) -> state``: builds the state for a pytree of parameters (usually a
  :class:`~ragged.DBuffer`, whose pytree children are its two flat tensors).
* ``update(updates, state, params=None) -> (updates, state)``: transforms a pytree of
  gradients (same structure as ``params``) and returns the new state. Nothing is mutated.

[Note: one kernel per buffer]
Every transform maps over pytrees through :data:`ragged.pytree`. A DBuffer has two tensor
children (``data``, ``replicated``), so an element-wise step such as Adam's moment update is one
kernel over each whole flat buffer, never one per leaf. Padding elements hold zero parameters
and zero gradients; every transform here maps (param 0, grad 0, state 0) to update 0 and state
0, so padding stays exactly zero.

[Note: an optimizer's collectives are declared, not recorded]
``step.lower(...)`` counts what an update communicates from ``GradientTransformation.collectives``,
declared by each transformation that communicates and gathered by the combinators. Each
declaration is computed from the values its update issues from, beside it: ``agree`` issues the
calls ``agree_collectives`` declares (``apply_if_finite``, clipping's ``error_if_nonfinite``, the
plan check), the norm core issues ``norm_collectives`` (``clip_by_global_norm``), Muon declares the
exchanges of the same ``MuonPlan`` waves its update runs. The lowering tests compare them with the
calls a real gloo step issues, in both transports (``tests/distributed/test_lower_gloo.py``).

Counting the real calls instead (running ``update`` once on meta shards with the comm recording
instead of communicating, and deleting the declarations) would make things worse:

* the comm to record on is the one the optimizer was built with, a live one whenever a running
  job's step is lowered (the lowering tests lower the gloo step they ran). Recording would be a
  mode of every backend, the ``Collectives`` protocol included, and would have to disarm what
  the update's helpers do to that comm besides calling it: ``check_plans`` memoises plans as
  agreed (a recorded round would let the next real call skip the agreement), a deferred comm's
  ``confirm_ledger`` marks its calls verified, ``poison_on_error`` poisons it on a failure;
* the update would have to run on meta tensors. Of the optimizers the lowering tests cover, only
  ``adamw`` and the schedules do: ``adamw_8bit`` reads its hyperparameters to the host, SOAP and
  Shampoo branch on ``int(state.count)`` (a refresh step or not: the recorder would have to
  choose), ``muon``'s ``multi_transform`` masks live on the CPU, and ``apply_if_finite`` and
  clipping branch on an agreed host value, each needing an answer on meta. A user's schedule or
  transformation with Python control flow on a tensor would make ``step.lower()`` fail where it
  works now;
* every lowering (each configuration of ``plan --predict --sweep``) would run an update.
"""

from __future__ import annotations

import collections
import difflib
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from ragged._dbuffer import DBuffer, is_dbuffer
from ragged._pytree import flatten_with_keystr, pytree
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged.optim._count import host_count

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "Schedule",
    "identity",
    "apply_updates",
    "check_floating",
    "keywords_checked",
]

Params = Any
Updates = Any

# torch.optim's (and other libraries') spellings of ragged's keywords: difflib finds typos, not these
_OTHER_NAMES = {"lr": ("learning_rate",), "betas": ("b1", "b2"), "beta1": ("b1",), "beta2": ("b2",),
                "epsilon": ("eps",), "max_grad_norm": ("max_norm",), "weight_decay_mask": ("mask",)}


def keywords_checked(fn: Callable) -> Callable:
    """Decorates a public ``rg.optim`` function: a keyword it does not take is a
    ``RaggedTypeError`` that names the keyword it probably meant (``rg.optim.adamw(lr=1e-3)``:
    "did you mean `learning_rate`?") and lists the ones it takes, before ``fn`` runs.

    Examples:
        >>> import ragged as rg
        >>> rg.optim.adamw(lr=1e-3)
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedTypeError: rg.optim.adamw() got an unexpected keyword argument 'lr': did you mean `learning_rate`? ...
    """
    signature = inspect.signature(fn)
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn
    names = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    known = frozenset(names)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        for key in kwargs:
            if key not in known:
                raise _unknown_keyword(fn.__name__, key, names)
        out = fn(*args, **kwargs)
        if isinstance(out, GradientTransformation):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if not any(_holds_transformation(v) for v in bound.arguments.values()):  # a combinator says it itself
                out = out._replace(fingerprint=_fingerprint(fn.__name__, signature, bound.arguments))
        return out

    return checked


def _unknown_keyword(name: str, key: str, names: list[str]) -> RaggedTypeError:
    guess = [n for n in _OTHER_NAMES.get(key, ()) if n in names] or difflib.get_close_matches(key, names, n=1)
    hint = f": did you mean {' and '.join(f'`{g}`' for g in guess)}?" if guess else "."
    takes = f"Its keywords: {', '.join(names)}." if names else "It takes no keywords."
    return RaggedTypeError(f"rg.optim.{name}() got an unexpected keyword argument {key!r}{hint} {takes}")
OptState = Any
Schedule = Callable[[Any], Any]
"""A learning-rate schedule: ``count`` (0-d int tensor or int) -> learning rate."""


class GradientTransformation(NamedTuple):
    """A pair ``(init, update)`` of pure functions; see the module docstring for the contract.

    ``donates`` says that ``update`` writes into the buffers of the state and of the updates it
    is given (the in-place mode of ``donate=True``, e.g. ``adamw(..., donate=True)``: the old
    state must not be read after the call). Combinators carry it (``chain``, ``masked``,
    ``multi_transform``, ``apply_if_finite``: true when any part donates), and
    :func:`ragged.fsdp.make_step` reads it: a step donates exactly when its optimizer does (see
    [Note: one donate decision per step] in ``ragged/fsdp/_trainable.py``). To wrap an update (e.g.
    ``torch.compile``), keep it: ``opt._replace(update=torch.compile(opt.update))``.

    ``hyperparams``, where an optimizer has a ``torch.optim`` counterpart, is what that
    optimizer's param group would hold (:func:`ragged.optim.adamw`: ``{"optimizer": "AdamW",
    "lr", "betas", "eps", "weight_decay"}``, ``lr`` a float or the schedule): checkpoint interop
    with FSDP2 checks a torch optimizer's state against it and writes it
    (:func:`ragged.checkpoint.fsdp2`, :func:`ragged.fsdp.save_fsdp2`). Combinators drop it.

    ``collectives``, for a transformation that communicates, says what one ``update`` issues for
    params shaped like ``params`` (meta tensors will do): ``collectives(params)`` is a tuple of
    ``(kind, axis, calls, bytes)`` with the meaning of :class:`ragged.fsdp.Collective` (bytes sent
    per rank; ``axis`` ``"shard"`` or ``"replica"``). ``step.lower(...)`` adds them to the step's
    own. ``None``: the update issues none. Combinators gather their parts' (see [Note: an
    optimizer's collectives are declared, not recorded]).

    ``fingerprint(state)`` gives the settings the ranks of a step must share, as ``(name, value)``
    pairs of text: the function's name and arguments (floats exactly, schedules by their value at
    the state's step count, a learning rate checked finite and >= 0), the parts' prefixed by a
    combinator. Every public ``rg.optim`` function sets it (see [Note: the optimizer's settings
    join the step's agreement]); ``None``: nothing to compare.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.sgd(0.1)
        >>> params = {"w": torch.ones(3)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.full((3,), 2.0)}, state, params)
        >>> rg.optim.apply_updates(params, updates)["w"]
        tensor([0.8000, 0.8000, 0.8000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    donates: bool = False
    hyperparams: Mapping[str, Any] | None = None
    collectives: Callable[[Params], tuple[tuple[str, str, int, int], ...]] | None = None
    fingerprint: Callable[[OptState], tuple[tuple[str, str], ...]] | None = None


def collectives_of(parts):
    """The ``collectives`` of a combinator that runs each of ``parts`` on the same params."""
    parts = tuple(t for t in parts if t.collectives is not None)
    if not parts:
        return None
    return lambda params: tuple(c for t in parts for c in t.collectives(params))


class EmptyState(NamedTuple):
    """State of a stateless transformation.

    Examples:
        >>> import torch, ragged as rg
        >>> rg.optim.identity().init(torch.zeros(2))
        EmptyState()
    """


@keywords_checked
def identity() -> GradientTransformation:
    """The transformation that returns the updates unchanged.

    Examples:
        >>> import torch, ragged as rg
        >>> opt = rg.optim.identity()
        >>> opt.update(torch.ones(2), opt.init(torch.ones(2)))[0]
        tensor([1., 1.])
    """

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        del params
        return updates, state

    return GradientTransformation(init, update)


def apply_updates(params, updates, *, donate: bool = False):
    """Returns ``params + updates`` leaf by leaf (one add per flat buffer of a DBuffer).

    Updates are cast to each parameter's dtype. Neither argument is modified, unless
    ``donate=True``: then the sum is written into ``params``' buffers (no allocation; the
    caller must not rely on the old values) and the same buffers are returned.

    Args:
        params: a pytree of tensors, e.g. a :class:`~ragged.DBuffer`.
        updates: a pytree with the same structure (the output of ``opt.update``).
        donate: add in place.

    Returns:
        A pytree like ``params``.

    Examples:
        >>> import torch, ragged as rg
        >>> rg.optim.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    if donate:
        with torch.no_grad():
            return pytree.map(lambda p, u: p.add_(u.to(p.dtype)), params, updates)
    return pytree.map(lambda p, u: p + u.to(p.dtype), params, updates)


def check_like_state(updates, state_tree, where: str, what: str = "updates") -> None:
    """Raises a clear error when ``updates`` (or the params, ``what="params"``) is not structured
    like the state (other plan, other rank, other tree): the usual cause is an ``opt_state``
    built for other params. Once it passes, an update may zip ``pytree.leaves`` of both trees
    (rather than ``treedef.flatten_up_to``: see [Note: torch 2.11 to 2.14] in ``ragged/_compat.py``)."""
    got, want = pytree.structure(updates), pytree.structure(state_tree)
    if got == want:
        return
    def describe(tree):
        leaves = pytree.leaves(tree, is_leaf=is_dbuffer)
        parts = []
        for x in leaves[:3]:
            if isinstance(x, DBuffer):
                parts.append(f"DBuffer(rank={x.rank}, {x.plan!r})")
            else:
                parts.append(f"{type(x).__name__}{tuple(getattr(x, 'shape', ()))}")
        return f"{len(leaves)} buffer(s): " + ", ".join(parts) + (", ..." if len(leaves) > 3 else "")

    raise RaggedValueError(
        f"{where}: the {what} do not match the optimizer state: {what} are {describe(updates)}; the state "
        f"was built for {describe(state_tree)}. Fix: call opt.init on the same DBuffer(s) (same plan, same "
        "rank) that you pass to opt.update as params and whose gradients you pass."
    )


def check_floating(params, where: str) -> None:
    """Refuses parameters that are not real floating point: an optimizer's update of an integer
    tensor would be rounded (or fail deep inside torch), a complex one squared wrongly."""
    paths, leaves, _ = flatten_with_keystr(params)
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and leaf.numel() and not leaf.is_floating_point():
            owner = " (a DBuffer's buffer)" if path.endswith((".data", ".replicated")) else ""
            raise RaggedTypeError(
                f"{where}: params{'' if path == '<root>' else path}{owner} has dtype {leaf.dtype}; optimizers update "
                "real floating-point parameters (an integer update would be rounded away). Fix: keep integer "
                "tensors (step counters, indices, masks) out of the optimized tree, e.g. plan them in a "
                "separate DBuffer, or convert them with .float()."
            )


# ---- learning rates and settings -------------------------------------------------------------
# [Note: the optimizer's settings join the step's agreement]
# Ranks that train with different optimizer settings (``soap(3e-3)`` on one, ``soap(3e-2)`` on
# another, another ``precondition_frequency``) would drift apart with nothing failing, and a
# learning-rate schedule that turns negative trains by gradient ascent. So every public
# ``rg.optim`` function gives its result a ``fingerprint(state)``: its name and arguments as text
# (numbers exactly; a comm, a mask, a function by their kind only, which every rank shares), each
# schedule evaluated on the host at the state's step count (the first ``count`` of the state:
# the one the update reads), a learning rate checked finite and >= 0 there (:func:`check_rate`).
# A combinator's is its parts', prefixed (``chain[1].learning_rate``, ``['decay'].b1``).
# ``rg.fsdp``'s step evaluates it before its start-of-call agreement, whose token it joins (see
# [Note: one agreement at the start of a call, one at the end] in ``fsdp/_grad.py``): different
# settings raise :class:`~ragged.PlanMismatchError` on every rank naming the setting and its value
# on each side, and a bad learning rate, on one rank or all, raises on every rank (the failed
# rank's error joins the same round), before any parameter changes. The count is the host's
# (:func:`host_count`: the optimizers count with :func:`next_count`, so the host knows it without
# reading the device; a count it did not make is read once), and the schedule runs on the host
# (:func:`host_schedule_value`): no host sync. An update outside a step checks a schedule's value
# as it computes it (:func:`checked_schedule`) where that needs no sync (a number, or a tensor on
# the CPU); on an accelerator only the step's check runs.

def check_rate(where: str, value, count=None) -> float:
    """``value`` as a float when it is a finite number >= 0; else a ``RaggedValueError`` naming
    ``where`` (and the step ``count`` a schedule returned it at).

    Examples:
        >>> check_rate("learning_rate", 3e-3)
        0.003
        >>> check_rate("learning_rate", -3e-3, count=7)
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedValueError: learning_rate must be a finite float >= 0, got -0.003 (its schedule's value at count 7): ...
    """
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError):
        v = None
    if v is None or isinstance(value, bool) or not 0.0 <= v < math.inf:
        at = "" if count is None else f" (its schedule's value at count {int(count)})"
        raise RaggedValueError(
            f"{where} must be a finite float >= 0, got {value if v is None else v!r}{at}: a negative rate trains by "
            "gradient ascent, a NaN or inf one ruins every parameter. Fix: pass a rate, or a schedule whose every "
            "value is finite and >= 0 (rg.optim.warmup_cosine_decay_schedule(0.0, peak, warmup, steps), ...).")
    return v


def checked_schedule(where: str, schedule: Schedule) -> Schedule:
    """``schedule`` with each value it returns checked by :func:`check_rate` where that needs no
    device sync: a Python number or a tensor on the CPU (see [Note: the optimizer's settings
    join the step's agreement]).

    Examples:
        >>> lr = checked_schedule("learning_rate", lambda count: 1e-3 - 1e-4 * count)
        >>> round(lr(2), 6)
        0.0008
        >>> lr(11)
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedValueError: learning_rate must be a finite float >= 0, got -0.0001... (its schedule's value at count 11): ...
    """
    def checked(count):
        value = schedule(count)
        if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
            check_rate(where, value, count)
        return value

    return checked


def host_schedule_value(schedule, count: int) -> float:
    """``schedule`` at a step count the host knows, as a float: host values only (the built-in
    schedules make CPU tensors of it), whatever device the optimizer's state is on."""
    value = schedule(torch.tensor(count, dtype=torch.int64))
    return float(value) if isinstance(value, (torch.Tensor, int, float)) else value


def step_count(state) -> torch.Tensor | None:
    """The first ``count`` field of ``state``'s named tuples, breadth first (the step count an
    update reads), or None."""
    queue = collections.deque([state])
    while queue:
        x = queue.popleft()
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            if "count" in x._fields and isinstance(x.count, torch.Tensor):
                return x.count
            queue.extend(x)
        elif isinstance(x, (tuple, list)):
            queue.extend(x)
        elif isinstance(x, dict):
            queue.extend(x.values())
    return None


def settings_of(transform: GradientTransformation, state, prefix: str = "") -> tuple[tuple[str, str], ...]:
    """``transform``'s fingerprint of ``state``, each name under ``prefix`` (a combinator's part);
    nothing for a transformation without one."""
    fingerprint = getattr(transform, "fingerprint", None)
    if fingerprint is None:
        return ()
    return tuple((f"{prefix}.{k}" if prefix and k else prefix or k, v) for k, v in fingerprint(state))


def _holds_transformation(value) -> bool:
    if isinstance(value, GradientTransformation):
        return True
    values = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    return any(isinstance(v, GradientTransformation) for v in values)


def _text(value) -> str:
    """An argument as the ranks compare it: numbers, strings and dtypes exactly; anything else (a
    comm, a mask, a function) by its kind only, whose text is the same on every rank."""
    plain = (bool, int, float, str, torch.dtype, type(None))
    if isinstance(value, plain) or (isinstance(value, tuple) and all(isinstance(v, plain) for v in value)):
        return repr(value)
    return f"<{type(value).__name__}>"


def _fingerprint(name: str, signature: inspect.Signature, arguments: dict):
    """The ``fingerprint`` of what ``name(**arguments)`` returned (see [Note: the optimizer's
    settings join the step's agreement])."""
    static, schedules = [("", name)], []
    for key, value in arguments.items():
        if callable(value) and "Schedule" in str(signature.parameters[key].annotation):
            schedules.append((key, value))
        else:
            static.append((key, _text(value)))
    static = tuple(static)
    if not schedules:
        return lambda state: static

    def fingerprint(state):
        count = step_count(state)
        out = list(static)
        for key, schedule in schedules:
            if count is None:
                out.append((key, "<schedule>"))
                continue
            at = host_count(count)
            value = host_schedule_value(schedule, at)
            value = check_rate(f"{name}: {key}", value, at) if key == "learning_rate" else float(value)
            out.append((key, f"{value!r} at count {at}"))
        return tuple(out)

    return fingerprint
