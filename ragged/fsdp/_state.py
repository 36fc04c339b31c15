"""How the state a training step threads (``_trainable.TrainState``) is made and read: :func:`init`,
and the :class:`Units` layout of the verbs (``rg.shard`` / ``rg.gather`` / ``rg.reduce_scatter`` /
``rg.global_norm`` of ``units`` over ``{unit name: DBuffer}``, see [Note: one verb, any layout] in
``ragged/transforms/_layouts.py``).

[Note: what fsdp.init accepts]
``params`` is the model's full parameters, equal on every rank, as

* the module the units were made from (``make_units(model)``): its ``named_parameters()``. Its
  parameters are then replaced by placeholders (see [Note: releasing the module's parameters]):
  no full copy of the weights is left on the rank. A module built on ``meta`` is materialised one
  unit at a time (see [Note: initialising a meta module unit by unit]);
* a mapping ``{parameter name: tensor}``: ``dict(model.named_parameters())``,
  ``model.state_dict()`` (an OrderedDict; buffers and tied aliases in it are ignored) or a
  loaded checkpoint; every parameter name of the units must be there;
* for units made from a pytree, a pytree with the same key paths (dict or OrderedDict alike);
* ``rg.checkpoint.pretrained(path)``, a Hugging Face directory: each rank reads only its own
  element ranges (see [Note: loading pretrained weights by rank] in ``checkpoint/_pretrained.py``).
* ``rg.checkpoint.fsdp2(path)``, a DCP directory FSDP2 or torchtitan wrote: each rank reads its
  own element ranges of the parameters and, when the directory holds AdamW state, of its moments,
  and the optimizer state continues from the saved step (see [Note: loading an FSDP2 checkpoint
  by rank] in ``checkpoint/_fsdp2.py``).

Misuse is refused before any communication, with a short message naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ragged import transforms
from ragged._dbuffer import DBuffer, norm
from ragged._errors import RaggedKeyError, RaggedTypeError, RaggedValueError
from ragged._pytree import flatten_with_keystr
from ragged.fsdp._materialize import default_init, materialize_buffers, materialize_unit
from ragged.fsdp._placeholder import LOCK, Placeholder, release
from ragged.fsdp._units import Units, picked_leaves
from ragged.fsdp._equal_start import check_equal, check_source, shard_from, sync_buffers
from ragged.fsdp._step import data_groups_option
from ragged.fsdp._trainable import TrainState, check_not_donated, check_trainable, trainable_shards
from ragged.transforms._layouts import LayoutOps, register_layout

__all__ = ["init", "unit_trees"]


def _shard(units: Units, params, comm) -> dict[str, DBuffer]:
    """``rg.shard(units, params, comm)``: this rank's shard of every unit (``params``: the full
    tree or the module, same on every rank; see [Note: what fsdp.init accepts]).

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> params = {"a": torch.arange(6.0).view(3, 2), "b": torch.ones(4)}
        >>> units = fsdp.make_units(params, world_size=2, groups=lambda p: p)
        >>> def fn(comm):
        ...     return {k: v.data.tolist() for k, v in rg.shard(units, params, comm).items()}
        >>> rg.collectives.simulate(2, fn)[1]["['a']"]
        [4.0, 5.0, 0.0, 0.0]
    """
    return _shard_trees(units, unit_trees(units, params), comm)


def _short(names, k: int = 3) -> str:
    names = list(names)
    return ", ".join(map(repr, names[:k])) + (f" and {len(names) - k} more" if len(names) > k else "")


def _check_leaf(path: str, t, meta: bool) -> None:
    if isinstance(t, Placeholder):
        raise RaggedValueError(
            f"params[{path!r}] is a placeholder: this module's parameters were already sharded (and released) by "
            "rg.fsdp.init. Fix: reuse that TrainState, or pass full values (rg.fsdp.export(...), a checkpoint, a "
            "freshly built module)."
        )
    if not isinstance(t, torch.Tensor):
        raise RaggedTypeError(f"params[{path!r}] is a {type(t).__name__}, not a torch.Tensor.")
    if t.is_meta and not meta:
        raise RaggedValueError(
            f"params[{path!r}] is a meta tensor: it has no values. Fix: pass the meta *module* (fsdp.init materialises "
            "it unit by unit, see init_fn), or real tensors."
        )


def unit_trees(units: Units, params, *, meta: bool = False) -> dict[str, dict[str, Any]]:
    """``{unit name: {path: tensor}}`` from any form :func:`init` accepts (see [Note: what
    fsdp.init accepts]); the tensors are checked to be real (no placeholders; meta only if
    ``meta``)."""
    if not isinstance(units, Units):
        raise RaggedTypeError(
            f"units must be rg.fsdp.make_units(model, world_size=...), got {type(units).__name__}. "
            "The order is fsdp.init(units, params, optimizer, comm)."
        )
    expected = [p for u in units for p in u.paths]
    if isinstance(params, torch.nn.Module):
        if not units.is_module:
            raise RaggedTypeError("params is a module but the units were made from a pytree: pass that pytree.")
        got = dict(params.named_parameters())
    elif isinstance(params, Mapping) and units.is_module:
        got = params
    elif units.is_module:
        raise RaggedTypeError(
            f"params is a {type(params).__name__}; the units were made from a module, so pass the module, "
            "dict(model.named_parameters()) or model.state_dict()."
        )
    else:
        paths, leaves, _ = flatten_with_keystr(params)
        got = dict(zip(paths, leaves))
    missing = [p for p in expected if p not in got]
    if missing:
        raise RaggedKeyError(
            f"params lacks {len(missing)} of the units' {len(expected)} parameters: {_short(missing)}; its keys look "
            f"like {_short(got, 2) or 'nothing'}. Fix: pass the model the units were made from (or its state_dict())."
        )
    if not units.is_module and len(got) != len(expected):
        extra = [p for p in got if p not in set(expected)]
        raise RaggedKeyError(f"params has leaves the units do not: {_short(extra)}. Fix: pass the tree make_units got.")
    for p in expected:
        _check_leaf(p, got[p], meta)
    check_trainable(units, ((p, got[p]) for p in expected), "fsdp.init")
    return {u.name: {p: got[p] for p in u.paths} for u in units}


def _gather(units: Units, shards: dict[str, DBuffer], comm, dtype: torch.dtype | None = None):
    """``rg.gather(units, shards, comm, dtype)``: the full parameter tree (e.g. ``{name:
    tensor}`` for a module), not differentiable; each unit's leaves are views of that unit's
    gathered buffer."""
    check_not_donated(shards, "gather")
    with torch.no_grad():
        return units.merge({u.name: transforms.gather(shards[u.name], comm, dtype=dtype) for u in units})


def _reduce_scatter(units: Units, grads, comm, op: str = "mean", dtype: torch.dtype | None = None):
    """``rg.reduce_scatter(units, grads, comm, op, dtype)``: ``{unit name: DBuffer}`` of the
    reduced gradients of the whole model (``grads``: a tree like the params), over each unit's
    ``trainable_plan`` (units where nothing trains are left out; frozen leaves' entries of
    ``grads`` are ignored)."""
    trees = units.split(grads)
    return {u.name: transforms.reduce_scatter(u.trainable_plan, {p: trees[u.name][p] for p in u.trainable_paths}, comm,
                                              op=op, dtype=dtype)
            for u in units if u.trainable_plan is not None}


def _global_norm(units: Units, grads: dict[str, DBuffer], comm, *, data_groups=()) -> torch.Tensor:
    """``rg.global_norm(units, grads, comm, data_groups=...)``: the L2 norm of a whole model's
    gradients ``{unit name: DBuffer}``, equal on every rank.

    Without ``data_groups`` it is :func:`ragged.optim.tree_norm` over ``comm``. With the
    ``data_groups`` of :func:`make_step` (e.g. expert parallelism), the other ranks of each data
    group hold other parameters (their experts) as well as copies of the replicated ones (router,
    norms): each element is weighted by 1 / (its number of copies over the data groups), and the
    weighted sums are all-reduced over ``comm`` and over every data group, so every element counts
    once. For ``rg.optim.clip_by_global_norm(max_norm, comm=comm, norm=lambda g:
    rg.global_norm(units, g, comm, data_groups=data_groups))``.
    """
    groups = data_groups_option(data_groups, "global_norm")
    parts = []
    for u in units:
        if u.trainable_plan is not None:
            weights: dict[int, float] = {}
            for group in groups:
                for i in picked_leaves(u, group.is_replicated):
                    weights[i] = weights.get(i, 1.0) / group.comm.world_size
            parts.append((grads[u.name], weights))
    return norm(parts, comm, others=[g.comm for g in groups])


def _read_and_agree(units: Units, read: Callable[[], dict], comm, source: int | None, module):
    """``read()`` (this rank's unit trees), then every rank checks that every rank read them and
    holds the same values (and ``module``'s real buffers), or with ``source``, sets the module's
    buffers to rank ``source``'s (see [Note: ranks start from the same values]). A rank whose
    ``read()`` raised still joins the check, so that every rank raises and none waits."""
    try:
        trees, failure = read(), None
    except Exception as e:  # noqa: BLE001  (re-raised by check_equal, on this rank as it is)
        trees, failure = None, e
    items = [] if trees is None else [
        (f"{p if p.startswith('[') else repr(p)} (unit {u.name!r})", t)  # a key path reads as it is
        for u in units for p, t in trees[u.name].items()]
    if module is not None and trees is not None:
        items += [(f"buffer {n!r}", b) for n, b in module.named_buffers() if not b.is_meta]
    check_equal(items, comm, failure=failure, values=source is None)
    if source is not None and module is not None:
        sync_buffers(module, comm, source)
    return trees


def _shard_trees(units: Units, trees, comm, source: int | None = None) -> dict[str, DBuffer]:
    """:func:`_shard` of ``unit_trees`` (rank ``source``'s values with ``source``)."""
    if source is not None:
        return {u.name: shard_from(u.plan, trees[u.name], comm, source) for u in units}
    return {u.name: transforms.shard(u.plan, {p: t.detach() for p, t in trees[u.name].items()}, comm) for u in units}


register_layout(Units, LayoutOps(shard=_shard, gather=_gather, reduce_scatter=_reduce_scatter, global_norm=_global_norm))


def init(
    units: Units,
    params,
    optimizer,
    comm,
    *,
    init_fn: Callable[[torch.nn.Module], None] | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    release_module: bool = True,
    module: torch.nn.Module | None = None,
    broadcast_from: int | None = None,
) -> TrainState:
    """Shards ``params`` and initialises ``optimizer`` over the shards.

    Args:
        units: from :func:`ragged.fsdp.make_units`.
        params: the module the units were made from, a mapping ``{name: tensor}`` (e.g.
            ``model.state_dict()``), ``rg.checkpoint.pretrained(path)``,
            ``rg.checkpoint.fsdp2(path)`` (its AdamW state too) or, for pytree units, the pytree;
            see [Note: what fsdp.init accepts]. Equal on every rank.
        optimizer: a ``rg.optim`` GradientTransformation.
        comm: the shard group's collectives.
        init_fn: for a module built on ``meta``: ``init_fn(module)`` fills the parameters and
            buffers that ``module`` itself holds (it gets a copy of each such module with its own
            tensors real, under a generator seeded per module). Default: the module's
            ``reset_parameters()``, or Hugging Face's ``_init_weights(module)``. See [Note:
            initialising a meta module unit by unit].
        seed: seeds the meta initialisation (with each module's name): equal parameters on
            every rank and every world size.
        device: where a meta module's (or a pretrained directory's) shards and buffers are made
            (default: ``comm.device``).
        release_module: after sharding a module, replace its parameters by placeholders (default;
            always for a meta module), so that no full copy of the weights is left on the rank.
            ``False`` keeps the module's own tensors (one more model copy per rank).
        module: with ``params = rg.checkpoint.pretrained(path)`` (or ``fsdp2(path)``), the module (built on ``meta``)
            the units were made from: its meta buffers are computed (as for a meta module) and
            its parameters replaced by placeholders, so a step can run it.
        broadcast_from: ``None`` (default): every rank must bring the same values, which is
            checked (a CRC-32 of each value's bytes, one small all-reduce) and refused with
            :class:`ParamsMismatchError` on every rank otherwise. A rank ``r`` (e.g. ``0``):
            every rank starts from rank r's parameters (and, for a module, floating-point and
            integer buffers), bit for bit, as FSDP1's ``sync_module_states=True``; the other
            ranks' values are not read, only their shapes. A module built on ``meta``, a
            pretrained directory and an FSDP2 checkpoint are equal on every rank by
            construction: neither is needed (values the user made real in a meta module are
            checked or broadcast). See [Note: ranks start from the same values] in
            ``fsdp/_equal_start.py``.

    Returns:
        ``TrainState(shards, optimizer.init(shards))``; from ``rg.checkpoint.fsdp2(path)`` with
        optimizer state, that state (moments and step count) instead.

    Raises:
        RaggedTypeError, RaggedKeyError, RaggedValueError: a misuse (the message names the fix),
            before anything is sharded: of the options, before any communication; of what
            ``params`` holds, after the ranks' check of their values (a rank that could not read
            its params raises its error, every other rank a RaggedError naming it, so none waits).
        ParamsMismatchError: the ranks hold different values (the message names the first one
            and the ranks on each side), on every rank, before anything is sharded.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> with torch.device("meta"):
        ...     model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> units = fsdp.make_units(model, world_size=2, groups=["0", "1"])
        >>> def run(comm):
        ...     state = fsdp.init(units, model, rg.optim.sgd(0.1), comm)
        ...     return fsdp.export(units, state.shards, comm, module=model, rank0_only=False)
        >>> full = rg.collectives.simulate(2, run)
        >>> torch.equal(full[0]["1.weight"], full[1]["1.weight"]), model[1].weight
        (True, Placeholder('1.weight', shape=(2, 8), dtype=torch.float32))
    """
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise RaggedTypeError(
            f"optimizer must be a rg.optim GradientTransformation (init / update), got {type(optimizer).__name__}. "
            "The order is fsdp.init(units, params, optimizer, comm)."
        )
    if not isinstance(getattr(comm, "world_size", None), int):
        raise RaggedTypeError(f"comm must be ragged collectives (rg.collectives.from_torch()), got {type(comm).__name__}.")
    if isinstance(units, Units) and units.world_size != comm.world_size:
        raise RaggedValueError(
            f"the units were planned for world_size={units.world_size} but comm has {comm.world_size} ranks. "
            "Fix: make_units(model, world_size=comm.world_size)."
        )
    source = check_source(broadcast_from, comm)
    # rg.checkpoint.pretrained(path) and fsdp2(path) load each rank's own ranges themselves (the
    # formats live in ragged.checkpoint, above fsdp)
    pretrained = callable(getattr(params, "load_by_rank", None))
    if module is not None and not (pretrained and isinstance(module, torch.nn.Module) and getattr(units, "is_module", 0)):
        raise RaggedTypeError("module= is the meta module the units were made from, for params = "
                              "rg.checkpoint.pretrained(path) or rg.checkpoint.fsdp2(path) (its buffers are computed, "
                              "its parameters released).")
    if not pretrained:
        module = params if isinstance(params, torch.nn.Module) else None
    meta = not pretrained and module is not None and any(
        p.is_meta and not isinstance(p, Placeholder) for p in module.parameters())
    if (init_fn is not None and not meta) or (device is not None and not (meta or pretrained)):
        raise RaggedValueError(f"{'init_fn' if init_fn is not None else 'device'} is for a module built on meta, but "
                               f"params has real values (their shards stay on their device). Fix: drop "
                               f"{'init_fn' if init_fn is not None else 'device'}, or build the model under "
                               "torch.device('meta').")
    if pretrained:
        device = torch.device(device) if device is not None else comm.device
        shards, opt_state = params.load_by_rank(units, optimizer, comm, device=device)
        buffers = {} if module is None else materialize_buffers(module, default_init(module), seed=seed, device=device)
    elif not meta:
        trees = _read_and_agree(units, lambda: unit_trees(units, params), comm, source, module)
        shards = _shard_trees(units, trees, comm, source)
        buffers = {}
    else:
        def read():  # the same checks; only the values the user made real are compared
            trees = unit_trees(units, module, meta=True)
            return {u.name: {p: t for p, t in trees[u.name].items() if not t.is_meta} for u in units}

        real = _read_and_agree(units, read, comm, source, module)
        device = torch.device(device) if device is not None else comm.device
        fn = default_init(module) if init_fn is None else lambda name, m: init_fn(m)
        shards = {}
        for u in units:  # one unit real at a time
            tree = materialize_unit(module, u, fn, seed=seed, device=device)
            brought = source is not None and real[u.name]  # only the values the user made real need rank source's
            shards[u.name] = shard_from(u.plan, tree, comm, source) if brought else transforms.shard(u.plan, tree, comm)
            del tree
        buffers = materialize_buffers(module, fn, seed=seed, device=device)
    if module is not None and (release_module or meta or pretrained):
        comm.barrier()  # simulated ranks share the module: every rank has read it before anyone releases it
        with LOCK:
            for name, values in buffers.items():
                owner = module.get_submodule(name) if name else module
                owner._buffers.update(values)
            release(module)
    if pretrained and opt_state is not None:
        return TrainState(shards, opt_state)
    return TrainState(shards, optimizer.init(trainable_shards(units, shards)))
