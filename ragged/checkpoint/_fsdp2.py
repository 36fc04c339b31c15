"""``torch.distributed.checkpoint`` directories of FSDP2 / torchtitan, weights and AdamW state:
read lazily (:func:`fsdp2`), loaded by rank (what ``fsdp.init`` does with one,
:meth:`FSDP2Checkpoint.load_by_rank`) and written by rank (``fsdp.save_fsdp2``).

[Note: what an FSDP2 checkpoint holds]
FSDP2 users save ``{"model": get_model_state_dict(model), "optimizer":
get_optimizer_state_dict(model, optim)}`` with ``dcp.save``; DCP flattens the nesting into keys
(torch 2.13, measured by running it):

* ``model.<fqn>``: each parameter, an N-D tensor stored as FSDP2's ``Shard(0)`` row blocks;
* ``optimizer.state.<fqn>.exp_avg`` / ``exp_avg_sq`` (like the parameter) and ``.step`` (a 0-d
  float32 tensor per parameter);
* ``optimizer.param_groups.<i>.<name>`` (``lr``, ``betas``, ``eps``, ``weight_decay``,
  ``amsgrad``, ``maximize``, ``decoupled_weight_decay``, ..., and ``params``: the group's fqns),
  each stored as bytes; with ``StateDictOptions(flatten_optimizer_state_dict=True)``
  (torchtitan) ``optimizer.param_groups.<fqn>.<name>`` instead, one copy per parameter.

torchtitan puts the model's keys at the top level (``model_key=""``). :func:`fsdp2` reads the
``.metadata`` with ragged's restricted unpickler and checks it against the directory (see
[Note: reading .metadata safely] in ``_metadata.py``), then reads only the small values (the
param groups, with ``torch.load(weights_only=True)``, and the step counts), on each rank alone
(no collective): every rank comes to the same verdict, so a checkpoint that is not AdamW-shaped
is refused everywhere before anything else happens. Tensors stay unread: ``fsdp.init(units,
rg.checkpoint.fsdp2(path), opt, comm)`` then reads each rank's element ranges (see [Note:
loading an FSDP2 checkpoint by rank]).

[Note: loading an FSDP2 checkpoint by rank]
A rank's piece of a leaf is one flat element range; the checkpoint stores FSDP2's ``Shard(0)``
row blocks of the N-D tensor. The range becomes the few N-D boxes that tile it (see [Note: a flat
range as boxes] in ``checkpoint/_boxes.py``), each a view of the rank's flat shard, and DCP reads
exactly their overlap with the saved blocks (one plan for the whole model, parameters and both
moments), casting into the master dtype on copy. Memory during the load: the rank's state plus
one saved block at a time (DCP reads a stored chunk, then copies the overlap). Before any
collective, the checkpoint is checked against the units and the optimizer on every rank from its
metadata and small values alone (see [Note: what an FSDP2 checkpoint holds]), so every rank
raises the same error naming the key: missing or unexpected parameters, shapes, dtypes that do
not cast, moments missing for a parameter, and an ``lr`` / ``betas`` / ``eps`` /
``weight_decay`` of a param group that differs from the ragged optimizer's (an ``lr`` schedule
is compared at the checkpoint's step: ``schedule(step)`` is the learning rate of the next
update, as a torch LR scheduler leaves it in the group). The loaded state is ragged's AdamW
state: ``mu = exp_avg``, ``nu = exp_avg_sq``, ``count = step``.

[Note: saving for FSDP2]
``save_fsdp2`` writes the keys FSDP2's own ``dcp.save`` writes (``model.<fqn>``,
``optimizer.state.<fqn>.exp_avg`` / ``exp_avg_sq`` / ``step``, the param group), each rank its
boxes as chunks of the N-D tensors; DCP's load planner reads any chunking into FSDP2's row
blocks, so ``dcp.load`` into ``get_model_state_dict`` / ``get_optimizer_state_dict`` of a
``fully_shard`` model at any world size, then ``set_model_state_dict`` /
``set_optimizer_state_dict``, continues the run. The param group is what
``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` holds in this torch (its other
options at their defaults), ``lr`` the next update's (a schedule's value at the step); a torch
LR scheduler's own state is not written.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from ragged._errors import RaggedTypeError
from ragged.checkpoint._boxes import box_range, boxes
from ragged.checkpoint._dcp import Blob, Chunk, SingleProcess, dcp_load, dcp_save
from ragged.checkpoint._format import CheckpointCorruptError, CheckpointMismatchError, RefMapping, require_path
from ragged.checkpoint._metadata import check_foreign, read_metadata
from ragged.checkpoint._pretrained import check_weights, persistent_buffers, rank_ranges, renamed, zero_shards
from ragged.checkpoint._torch_adamw import adamw_hyperparams, check_groups, read_groups, torch_group
from ragged.fsdp._placeholder import tied_names
from ragged.fsdp._units import Units
from ragged.optim._transform import ScaleByAdamState, ScaleByScheduleState
from ragged.transforms._check import poisons

__all__ = ["DCPRef", "FSDP2Checkpoint", "fsdp2", "save_fsdp2", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DCPRef:
    """One tensor of a DCP checkpoint, not read: ``key`` (its DCP key), ``shape``, ``dtype``."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def where(self) -> str:
        return repr(self.key)


class FSDP2Checkpoint(RefMapping):
    """``{parameter fqn: DCPRef}`` of an FSDP2 / torchtitan DCP directory, with its AdamW state
    (see [Note: what an FSDP2 checkpoint holds]); made by :func:`fsdp2`.

    Attributes:
        path: the resolved directory.
        metadata: DCP's ``Metadata`` (read with the restricted unpickler).
        model_key, optimizer_key: the prefixes of the model's and the optimizer's keys.
        moments: ``{fqn: (exp_avg ref, exp_avg_sq ref)}``; ``None`` without optimizer state.
        step: the optimizer's step count (equal for every parameter); ``None`` without it.
        param_groups: ``{fqn: {name: value}}``: each parameter's group (``lr``, ``betas``, ...,
            and ``key``: where it is stored, e.g. ``"optimizer.param_groups.0"``).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> import torch.distributed.checkpoint as dcp
        >>> from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.99))
        >>> for _ in range(3):
        ...     model(torch.ones(1, 3)).sum().backward(); opt.step()
        >>> path = os.path.join(tempfile.mkdtemp(), "titan")
        >>> _ = dcp.save({**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
        ...              checkpoint_id=path, no_dist=True)            # torchtitan: model keys at the top level
        >>> ckpt = rg.checkpoint.fsdp2(path, model_key="")
        >>> isinstance(ckpt, rg.checkpoint.FSDP2Checkpoint), sorted(ckpt), ckpt.step
        (True, ['bias', 'weight'], 3)
        >>> ckpt.moments["weight"][1], ckpt.param_groups["weight"]["betas"]
        (DCPRef(key='optimizer.state.weight.exp_avg_sq', shape=(2, 3), dtype=torch.float32), (0.8, 0.99))
    """

    def __init__(self, path, metadata, model_key, optimizer_key, refs, moments, step, param_groups):
        self.path, self.metadata, self._refs = path, metadata, refs
        self.model_key, self.optimizer_key = model_key, optimizer_key
        self.moments, self.step, self.param_groups = moments, step, param_groups

    def __repr__(self) -> str:
        opt = f", AdamW state at step {self.step}" if self.moments is not None else ""
        return f"fsdp2({self.path!r}: {len(self)} tensors{opt})"

    def load_by_rank(self, units: Units, optimizer, comm, *, device: torch.device):
        """``(shards, opt_state)`` of this rank, what ``fsdp.init(units, self, optimizer, ...)``
        starts from (see :func:`load_fsdp2`)."""
        return load_fsdp2(units, self, optimizer, comm, device=device)


def _prefix(key: str) -> str:
    return f"{key}." if key else ""


def _ref(key: str, md) -> DCPRef:
    if not isinstance(md, dcp_md.TensorStorageMetadata):
        raise CheckpointMismatchError(f"DCP key {key!r} holds bytes, not a tensor.")
    return DCPRef(key=key, shape=tuple(md.size), dtype=md.properties.dtype)


def _read_small(path: str, metadata, blobs: list[str], scalars: list[str]) -> dict[str, Any]:
    """The values of byte entries ``blobs`` and 0-d tensors ``scalars`` (as floats), read on this
    rank alone."""
    out: dict[str, Any] = {}
    pieces: list = [Blob(k, into=out) for k in blobs]
    dest = {k: torch.empty((), dtype=torch.float64) for k in scalars}
    pieces += [Chunk(k, (), (), t) for k, t in dest.items()]
    dcp_load(path, pieces, metadata, SingleProcess(), f"fsdp2({path!r})")
    out.update({k: t.item() for k, t in dest.items()})
    return out


def fsdp2(path: str | os.PathLike, *, model_key: str = "model", optimizer_key: str = "optimizer",
          optimizer: bool = True, rename: Mapping[str, str | None] | Callable[[str], str | None] | None = None
          ) -> FSDP2Checkpoint:
    """A lazy ``{fqn: tensor-like}`` of a DCP directory written by FSDP2 / torchtitan, with its
    AdamW moments and step (see [Note: what an FSDP2 checkpoint holds]), for
    ``fsdp.init(units, rg.checkpoint.fsdp2(path), rg.optim.adamw(...), comm)``.

    Args:
        path: the directory ``dcp.save`` wrote.
        model_key: the key the model's state dict was saved under (``""``: at the top level, as
            torchtitan saves it).
        optimizer_key: the key of ``get_optimizer_state_dict``'s output.
        optimizer: read the optimizer state (``False``: the weights only; ``fsdp.init`` then
            starts the optimizer afresh).
        rename: ``{fqn: new name}`` or a function ``fqn -> new name`` (for the model's keys and
            the optimizer's alike); ``None`` drops the entry: e.g. a tied alias
            (``lm_head.weight``, which the units hold under its first name) or a persistent
            buffer the units do not hold.

    Returns:
        An :class:`FSDP2Checkpoint`.

    Raises:
        CheckpointNotFoundError: nothing at ``path`` (also a ``FileNotFoundError``).
        CheckpointCorruptError: no ``.metadata``, metadata that is not DCP's (nothing in it is
            run), or storage entries outside the directory's files.
        CheckpointMismatchError: no model keys, optimizer state that is not AdamW's (another
            state key, ``amsgrad``, a missing moment or ``step``, a param group lacking ``lr`` /
            ``betas`` / ``eps`` / ``weight_decay``), or steps that differ between parameters;
            the message names the key.

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> import torch.distributed.checkpoint as dcp
        >>> from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
        >>> path = os.path.join(tempfile.mkdtemp(), "step1")
        >>> _ = dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
        ...              checkpoint_id=path, no_dist=True)
        >>> ckpt = rg.checkpoint.fsdp2(path)
        >>> ckpt
        fsdp2('...': 2 tensors, AdamW state at step 1)
        >>> ckpt["weight"].shape, ckpt.param_groups["bias"]["lr"]
        ((2, 3), 0.01)
    """
    root = os.path.realpath(require_path(path, "rg.checkpoint.fsdp2 reads the directory torch.distributed.checkpoint.save wrote"))
    if not os.path.isdir(root):
        raise CheckpointCorruptError(f"{os.fspath(path)!r} is not a directory (rg.checkpoint.fsdp2 reads the directory "
                                     "torch.distributed.checkpoint.save wrote).")
    metadata = read_metadata(root)
    try:
        check_foreign(metadata, root)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"checkpoint {root!r}: {exc}") from None
    stored = metadata.state_dict_metadata
    opt_head = _prefix(optimizer_key)
    model_head = _prefix(model_key)
    is_opt = (lambda k: k.startswith(opt_head)) if optimizer_key else (lambda k: False)
    model = {k[len(model_head):]: k for k, md in stored.items()
             if k.startswith(model_head) and not is_opt(k) and (model_key or isinstance(md, dcp_md.TensorStorageMetadata))}
    refs = {name: _ref(k, stored[k]) for name, k in renamed(model, rename, CheckpointMismatchError).items()}
    if not refs:
        raise CheckpointMismatchError(f"checkpoint {root!r} has no keys under {model_key!r} (its keys start "
                                      f"{sorted({k.split('.')[0] for k in stored})[:6]}); pass model_key= (\"\" for "
                                      "torchtitan's top-level model keys).")
    if not optimizer or not any(is_opt(k) for k in stored):
        return FSDP2Checkpoint(root, metadata, model_key, optimizer_key, refs, None, None, {})
    state_head, group_head = opt_head + "state.", opt_head + "param_groups."
    found: dict[str, dict[str, str]] = {}
    for key in sorted(stored):
        if key.startswith(state_head):
            fqn, _, name = key[len(state_head):].rpartition(".")
            if name not in (*MOMENTS, "step"):
                why = " (AdamW with amsgrad=True, which ragged's adamw does not have)" if name == "max_exp_avg_sq" else ""
                raise CheckpointMismatchError(f"DCP key {key!r}: optimizer state {name!r} is not AdamW's (exp_avg, "
                                              f"exp_avg_sq, step){why}; ragged loads torch.optim.AdamW state only.")
            found.setdefault(fqn, {})[name] = key
        elif is_opt(key) and not key.startswith(group_head):
            raise CheckpointMismatchError(f"DCP key {key!r} is neither optimizer state nor a param group.")
    for fqn, names in found.items():
        lacking = [n for n in (*MOMENTS, "step") if n not in names]
        if lacking:
            raise CheckpointMismatchError(f"the optimizer state of {fqn!r} lacks {lacking} ({state_head}{fqn}.*): "
                                          "not an AdamW state.")
    groups = [k for k in stored if k.startswith(group_head)]
    small = _read_small(root, metadata, groups, [names["step"] for names in found.values()])
    steps = {fqn: small[names["step"]] for fqn, names in found.items()}
    if len(set(steps.values())) > 1 or any(s != int(s) or s < 0 for s in steps.values()):
        raise CheckpointMismatchError(f"the optimizer's steps differ between parameters or are not counts: "
                                      f"{dict(list(steps.items())[:4])}; ragged keeps one step count per optimizer.")
    param_groups = read_groups({k: small[k] for k in groups}, group_head, sorted(found))
    moments, by_name = {}, {}
    for new, (fqn, names) in renamed({f: (f, n) for f, n in found.items()}, rename, CheckpointMismatchError).items():
        moments[new] = tuple(_ref(names[m], stored[names[m]]) for m in MOMENTS)
        by_name[new] = param_groups[fqn]
    step = int(next(iter(steps.values()))) if steps else 0
    return FSDP2Checkpoint(root, metadata, model_key, optimizer_key, refs, moments, step, by_name)


def _check_units(units: Units, where: str) -> None:
    if not isinstance(units, Units):
        raise RaggedTypeError(f"units must be rg.fsdp.make_units(model, world_size=...), got {type(units).__name__}.")
    frozen = sorted(p for u in units for p in u.frozen)
    if frozen:
        raise CheckpointMismatchError(
            f"{where}: parameters {frozen[:3]} are frozen; FSDP2 interop covers fully trainable units only "
            "(not done yet). Fix: make the units with every parameter trainable.")


def _check_optimizer(units: Units, ckpt, optimizer, where: str) -> None:
    hp = adamw_hyperparams(optimizer, where)
    shapes = {u.paths[leaf.index]: leaf.shape for u in units for leaf in u.plan.leaves + u.plan.replicated}
    missing = [p for p in shapes if p not in ckpt.moments]
    extra = [p for p in ckpt.moments if p not in shapes]
    if missing or extra:
        listed = "; ".join(f"{what} {names[:4]!r}" for what, names in (("missing", missing), ("unexpected", extra)) if names)
        raise CheckpointMismatchError(
            f"{where}: the optimizer state of {ckpt.path} does not cover the units' parameters: {listed} "
            f"({ckpt.optimizer_key}.state.<name>.exp_avg). Fix: map names with rg.checkpoint.fsdp2(path, "
            "rename=...), or load the weights only (optimizer=False).")
    for p, shape in shapes.items():
        for ref in ckpt.moments[p]:
            if tuple(ref.shape) != tuple(shape):
                raise CheckpointMismatchError(f"{where}: {ref.where()} is {tuple(ref.shape)}, the parameter {p!r} is "
                                              f"{tuple(shape)}.")
    check_groups(ckpt.param_groups, shapes, hp, ckpt.step, where)


def _chunks(key: str, shape, flat: torch.Tensor, start: int, stop: int) -> list[Chunk]:
    """Chunks of the flat range ``[start, stop)`` of the tensor ``key`` of ``shape``, their data
    the views of ``flat`` (which holds exactly that range)."""
    out = []
    for offsets, sizes in boxes(tuple(shape), start, stop):
        lo, hi = box_range(tuple(shape), (offsets, sizes))
        out.append(Chunk(key, offsets, tuple(shape), flat[lo - start : hi - start].view(sizes)))
    return out


def _rank_chunks(units: Units, shards, keys_of, *, replicated: bool = True) -> list[Chunk]:
    """The chunks of this rank's ranges of ``shards`` (see :func:`rank_ranges`), under each key of
    ``keys_of(parameter name)``."""
    return [c for name, leaf, start, stop, view in rank_ranges(units, shards, replicated=replicated)
            for key in keys_of(name) for c in _chunks(key, leaf.shape, view, start, stop)]


@poisons("comm")
def load_fsdp2(units: Units, ckpt, optimizer, comm, *, device: torch.device):
    """``(shards, opt_state)`` of this rank from ``ckpt`` (``rg.checkpoint.fsdp2(path)``); the
    optimizer state is ``None`` when ``ckpt`` holds none (see [Note: loading an FSDP2 checkpoint
    by rank]).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> import torch.distributed.checkpoint as dcp
        >>> from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
        >>> torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> model(torch.ones(1, 3, dtype=torch.float64)).sum().backward(); torch_opt.step()
        >>> path = os.path.join(tempfile.mkdtemp(), "fsdp2")
        >>> _ = dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, torch_opt)},
        ...              checkpoint_id=path, no_dist=True)
        >>> units = fsdp.make_units(model, world_size=3, groups=["0", "1"])
        >>> def run(comm):
        ...     state = fsdp.init(units, rg.checkpoint.fsdp2(path), rg.optim.adamw(1e-2, weight_decay=0.01), comm)
        ...     return fsdp.export(units, state.shards, comm), int(state.opt_state[0].count)
        >>> full, step = rg.collectives.simulate(3, run)[0]
        >>> torch.equal(full["1.weight"], model[1].weight.detach()), step
        (True, 1)
    """
    where = f"fsdp.init(units, {ckpt!r})"
    _check_units(units, where)
    check_weights(units, ckpt, where, reader="rg.checkpoint.fsdp2")
    if ckpt.moments is not None:
        _check_optimizer(units, ckpt, optimizer, where)
    shards = zero_shards(units, comm, device)
    chunks = _rank_chunks(units, shards, lambda p: [ckpt[p].key])
    if ckpt.moments is not None:
        mus, nus = ({k: d.zeros_like() for k, d in shards.items()} for _ in MOMENTS)
        for i, moments in enumerate((mus, nus)):
            chunks += _rank_chunks(units, moments, lambda p, i=i: [ckpt.moments[p][i].key])
    with torch.no_grad():
        dcp_load(ckpt.path, [c for c in chunks if c.tensor.numel()], ckpt.metadata, comm, f"fsdp.init({ckpt.path!r})")
    if ckpt.moments is None:
        return shards, None
    # the state's structure from the optimizer itself, over meta stand-ins (no memory for moments it would zero)
    fresh = optimizer.init({k: d.replace(data=d.data.to("meta"), replicated=d.replicated.to("meta"))
                            for k, d in shards.items()})
    if not (isinstance(fresh, tuple) and len(fresh) == 3 and isinstance(fresh[0], ScaleByAdamState)):
        raise CheckpointMismatchError(f"{where}: the optimizer's state is not rg.optim.adamw's (ScaleByAdamState, ...).")
    count = torch.full((), ckpt.step, dtype=fresh[0].count.dtype, device=device)
    lr_state = ScaleByScheduleState(count.clone()) if isinstance(fresh[2], ScaleByScheduleState) else fresh[2]
    return shards, (ScaleByAdamState(count=count, mu=mus, nu=nus), fresh[1], lr_state)


def save_fsdp2(units: Units, state, comm, path: str | os.PathLike, *, optimizer=None, module=None,
               model_key: str = "model", optimizer_key: str = "optimizer", flatten_optimizer: bool = False) -> list[str]:
    """Writes ``state`` as the DCP checkpoint FSDP2 itself writes, so that a ``fully_shard``
    model at any world size loads it with plain ``dcp.load`` and continues (see [Note: saving
    for FSDP2]). Every rank calls it; each writes its own ranges.

    Args:
        units: the units ``state`` was made for.
        state: a ``TrainState`` (``state.opt_state`` is written when ``optimizer`` is given).
        comm: the shard group's collectives.
        path: a new directory (DCP does not overwrite files of an earlier save).
        optimizer: the ``rg.optim.adamw`` that made ``state.opt_state``; ``None`` writes the
            model only.
        module: the module the units were made from: its persistent buffers (rank 0) and its
            tied aliases (``lm_head.weight``: the parameter's chunks once more) are written too,
            as the ``get_model_state_dict`` that FSDP2 loads into holds them.
        model_key: the key of the model's state dict (``""``: top level, as torchtitan).
        optimizer_key: the key of the optimizer's state dict.
        flatten_optimizer: write the param group once per parameter
            (``param_groups.<fqn>.<name>``), as ``StateDictOptions(flatten_optimizer_state_dict=True)``
            (torchtitan) expects; default: ``param_groups.0.<name>`` and its ``params`` list.

    Returns:
        The files this rank wrote.

    Raises:
        CheckpointMismatchError: ``optimizer`` is not ``rg.optim.adamw``, or frozen parameters.
        CheckpointError: writing failed (raised on every rank).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> import torch.distributed.checkpoint as dcp
        >>> from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> units = fsdp.make_units(model, world_size=2, groups=["0", "1"])
        >>> path = os.path.join(tempfile.mkdtemp(), "for-fsdp2")
        >>> def run(comm):
        ...     state = fsdp.init(units, model.state_dict(), rg.optim.adamw(1e-3), comm)
        ...     return fsdp.save_fsdp2(units, state, comm, path)
        >>> _ = rg.collectives.simulate(2, run)
        >>> other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> sd = {"model": get_model_state_dict(other)}
        >>> dcp.load(sd, checkpoint_id=path, no_dist=True)
        >>> _ = set_model_state_dict(other, sd["model"])
        >>> torch.equal(other[1].weight, model[1].weight)
        True
    """
    where = f"fsdp.save_fsdp2(units, state, comm, {os.fspath(path)!r})"
    _check_units(units, where)
    shards, opt_state = state
    hp = adamw_hyperparams(optimizer, where) if optimizer is not None else None
    m, o = (f"{model_key}." if model_key else ""), f"{optimizer_key}."
    writer = comm.rank == 0 and getattr(comm, "replica_rank", 0) == 0
    names = [p for u in units for p in u.paths]
    aliases: dict[str, list[str]] = {}
    chunks = []
    if module is not None:
        for alias, first in tied_names(module).items():
            aliases.setdefault(first, []).append(alias)
        if writer:
            for k, v in persistent_buffers(module, set(names)).items():
                chunks += _chunks(m + k, tuple(v.shape), v.detach().reshape(-1), 0, v.numel())
    chunks += _rank_chunks(units, shards, lambda p: [m + a for a in (p, *aliases.get(p, ()))], replicated=writer)
    if hp is not None:
        adam = opt_state[0]
        step = int(adam.count)
        for moments, name in zip((adam.mu, adam.nu), MOMENTS):
            chunks += _rank_chunks(units, moments, lambda p, name=name: [f"{o}state.{p}.{name}"], replicated=writer)
        if writer:
            group = torch_group(hp, step)
            for p in names:
                chunks.append(Chunk(f"{o}state.{p}.step", (), (), torch.tensor(float(step), dtype=torch.float32)))
                if flatten_optimizer:
                    chunks += [Blob(f"{o}param_groups.{p}.{k}", v) for k, v in group.items()]
            if not flatten_optimizer:
                chunks += [Blob(f"{o}param_groups.0.{k}", v) for k, v in group.items()]
                chunks.append(Blob(f"{o}param_groups.0.params", names))
    chunks = [c for c in chunks if isinstance(c, Blob) or c.tensor.numel()]
    return dcp_save(os.fspath(path), chunks, comm, f"save_fsdp2({os.fspath(path)!r})")
