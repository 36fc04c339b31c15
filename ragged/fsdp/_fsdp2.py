"""FSDP2 / torchtitan checkpoints in and out by rank, AdamW state included: :func:`load_fsdp2`
(what ``fsdp.init`` does with ``rg.checkpoint.fsdp2(path)``) and :func:`save_fsdp2`.

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

import math
import os
import sys

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import RaggedTypeError
from ragged.fsdp._placeholder import tied_names
from ragged.fsdp._pretrained import _buffers, check_weights
from ragged.fsdp._units import Units
from ragged.spec._concat import replicated_size
from ragged.transforms._check import check_comm, check_plan, poisons

__all__ = ["is_fsdp2", "load_fsdp2", "save_fsdp2"]

_HYPER = ("lr", "betas", "eps", "weight_decay")


def is_fsdp2(params) -> bool:
    """Whether ``params`` is ``rg.checkpoint.fsdp2(...)`` (without importing ``ragged.checkpoint``)."""
    mod = sys.modules.get("ragged.checkpoint._fsdp2")
    return mod is not None and isinstance(params, mod.FSDP2Checkpoint)


def _mismatch(text: str):
    # ragged.checkpoint loads torch.distributed.checkpoint: only when a checkpoint is read or written
    from ragged.checkpoint._format import CheckpointMismatchError

    return CheckpointMismatchError(text)


def _adamw(optimizer, where: str) -> dict:
    hp = getattr(optimizer, "hyperparams", None)
    if not hp or hp.get("optimizer") != "AdamW":
        raise _mismatch(f"{where}: the checkpoint holds torch.optim.AdamW state, so the optimizer must be "
                        "rg.optim.adamw(lr, b1, b2, eps, weight_decay) (without mask= or wrappers), got "
                        f"{'one without hyperparams' if not hp else hp.get('optimizer')}. Fix: pass rg.optim.adamw(...), "
                        "or load the weights only with rg.checkpoint.fsdp2(path, optimizer=False).")
    return hp


def _lr_at(hp: dict, step: int) -> float:
    lr = hp["lr"]
    return float(lr(torch.tensor(step))) if callable(lr) else float(lr)


def _check_units(units: Units, where: str) -> None:
    if not isinstance(units, Units):
        raise RaggedTypeError(f"units must be rg.fsdp.make_units(model, world_size=...), got {type(units).__name__}.")
    frozen = sorted(p for u in units for p in u.frozen)
    if frozen:
        raise _mismatch(f"{where}: parameters {frozen[:3]} are frozen; FSDP2 interop covers fully trainable units only "
                        "(not done yet). Fix: make the units with every parameter trainable.")


def _same(a, b) -> bool:
    """Equal hyperparameters (numbers, or tuples of them like ``betas``) within 1e-9 relative."""
    a, b = (tuple(a), tuple(b)) if isinstance(a, (tuple, list)) else ((a,), (b,))
    return len(a) == len(b) and all(math.isclose(float(x), float(y), rel_tol=1e-9) for x, y in zip(a, b))


def _check_optimizer(units: Units, ckpt, optimizer, where: str) -> None:
    hp = _adamw(optimizer, where)
    shapes = {u.paths[leaf.index]: leaf.shape for u in units for leaf in u.plan.leaves + u.plan.replicated}
    missing = [p for p in shapes if p not in ckpt.moments]
    extra = [p for p in ckpt.moments if p not in shapes]
    if missing or extra:
        listed = "; ".join(f"{what} {names[:4]!r}" for what, names in (("missing", missing), ("unexpected", extra)) if names)
        raise _mismatch(f"{where}: the optimizer state of {ckpt.path} does not cover the units' parameters: {listed} "
                        f"({ckpt.optimizer_key}.state.<name>.exp_avg). Fix: map names with rg.checkpoint.fsdp2(path, "
                        "rename=...), or load the weights only (optimizer=False).")
    ours = {"lr": _lr_at(hp, ckpt.step), "betas": hp["betas"], "eps": hp["eps"], "weight_decay": hp["weight_decay"]}
    scheduled = f" (its schedule at step {ckpt.step})" if callable(hp["lr"]) else ""
    for p, shape in shapes.items():
        for ref in ckpt.moments[p]:
            if tuple(ref.shape) != tuple(shape):
                raise _mismatch(f"{where}: {ref.where()} is {tuple(ref.shape)}, the parameter {p!r} is {tuple(shape)}.")
        group = ckpt.param_groups[p]
        for k in _HYPER:
            if not _same(ours[k], group[k]):
                raise _mismatch(f"{where}: the param group of {p!r} has {k}={group[k]!r} ({group['key']}.{k}), the "
                                f"ragged optimizer {k}={ours[k]!r}{scheduled if k == 'lr' else ''}. Fix: build "
                                "rg.optim.adamw with the checkpoint's hyperparameters.")


def _chunks(key: str, shape, flat: torch.Tensor, start: int, stop: int) -> list:
    """Chunks of the flat range ``[start, stop)`` of the tensor ``key`` of ``shape``, their data
    the views of ``flat`` (which holds exactly that range)."""
    # ragged.checkpoint loads torch.distributed.checkpoint: only when a checkpoint is read or written
    from ragged.checkpoint._boxes import box_range, boxes
    from ragged.checkpoint._dcp import Chunk

    out = []
    for offsets, sizes in boxes(tuple(shape), start, stop):
        lo, hi = box_range(tuple(shape), (offsets, sizes))
        out.append(Chunk(key, offsets, tuple(shape), flat[lo - start : hi - start].view(sizes)))
    return out


def _unit_chunks(u, d: DBuffer, keys_of, *, replicated: bool = True) -> list:
    """The chunks of this rank's pieces of ``d`` (a DBuffer over ``u.plan``), under each key of
    ``keys_of(parameter name)``; replicated leaves whole (when ``replicated``)."""
    out = []
    if d.rank < d.plan.world_size:
        for piece in d.plan.local_pieces(d.rank):
            flat = d.data[piece.local_offset : piece.local_offset + piece.numel]
            for key in keys_of(u.paths[piece.leaf.index]):
                out += _chunks(key, piece.leaf.shape, flat, piece.start, piece.stop)
    if replicated:
        for leaf in d.plan.replicated:
            for key in keys_of(u.paths[leaf.index]):
                out += _chunks(key, leaf.shape, d.replicated[leaf.offset : leaf.stop], 0, leaf.numel)
    return out


@poisons("comm")
def load_fsdp2(units: Units, ckpt, optimizer, comm, *, device=None):
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
    # ragged.checkpoint loads torch.distributed.checkpoint: only when a checkpoint is read or written
    from ragged.checkpoint._dcp import dcp_load
    from ragged.optim._transform import ScaleByAdamState, ScaleByScheduleState

    where = f"fsdp.init(units, {ckpt!r})"
    _check_units(units, where)
    check_weights(units, ckpt, where, reader="rg.checkpoint.fsdp2")
    if ckpt.moments is not None:
        _check_optimizer(units, ckpt, optimizer, where)
    device = torch.device(device) if device is not None else getattr(comm, "device", None) or torch.device("cpu")
    model = lambda p: [ckpt[p].key]  # noqa: E731
    moment = lambda i: (lambda p: [ckpt.moments[p][i].key])  # noqa: E731
    shards, mus, nus, chunks = {}, {}, {}, []
    for u in units:
        check_comm(u.plan, comm, "fsdp.init")
        check_plan(u.plan, comm, "fsdp.init")
        plan, rank = u.plan, comm.rank
        make = lambda: DBuffer(  # noqa: E731
            data=torch.zeros(plan.shard_size if rank < plan.world_size else 0, dtype=plan.dtype, device=device),
            replicated=torch.zeros(replicated_size(plan), dtype=plan.dtype, device=device), plan=plan, rank=rank)
        shards[u.name] = make()
        chunks += _unit_chunks(u, shards[u.name], model)
        if ckpt.moments is not None:
            mus[u.name], nus[u.name] = make(), make()
            chunks += _unit_chunks(u, mus[u.name], moment(0)) + _unit_chunks(u, nus[u.name], moment(1))
    with torch.no_grad():
        dcp_load(ckpt.path, [c for c in chunks if c.tensor.numel()], ckpt.metadata, comm, f"fsdp.init({ckpt.path!r})")
    if ckpt.moments is None:
        return shards, None
    # the state's structure from the optimizer itself, over meta stand-ins (no memory for moments it would zero)
    fresh = optimizer.init({k: d.replace(data=d.data.to("meta"), replicated=d.replicated.to("meta"))
                            for k, d in shards.items()})
    if not (isinstance(fresh, tuple) and len(fresh) == 3 and isinstance(fresh[0], ScaleByAdamState)):
        raise _mismatch(f"{where}: the optimizer's state is not rg.optim.adamw's (ScaleByAdamState, ...).")
    count = torch.full((), ckpt.step, dtype=fresh[0].count.dtype, device=device)
    lr_state = ScaleByScheduleState(count.clone()) if isinstance(fresh[2], ScaleByScheduleState) else fresh[2]
    return shards, (ScaleByAdamState(count=count, mu=mus, nu=nus), fresh[1], lr_state)


def _group(hp: dict, step: int) -> dict:
    """The param group ``torch.optim.AdamW`` holds for these hyperparameters (no ``params``)."""
    probe = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=_lr_at(hp, step), betas=tuple(hp["betas"]),
                              eps=hp["eps"], weight_decay=hp["weight_decay"])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


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
    # ragged.checkpoint loads torch.distributed.checkpoint: only when a checkpoint is read or written
    from ragged.checkpoint._dcp import Blob, Chunk, dcp_save

    where = f"fsdp.save_fsdp2(units, state, comm, {os.fspath(path)!r})"
    _check_units(units, where)
    shards, opt_state = state
    hp = _adamw(optimizer, where) if optimizer is not None else None
    m, o = (f"{model_key}." if model_key else ""), f"{optimizer_key}."
    writer = comm.rank == 0 and getattr(comm, "replica_rank", 0) == 0
    names = [p for u in units for p in u.paths]
    aliases: dict[str, list[str]] = {}
    chunks = []
    if module is not None:
        for alias, first in tied_names(module).items():
            aliases.setdefault(first, []).append(alias)
        if writer:
            for k, v in _buffers(module, set(names)).items():
                chunks += _chunks(m + k, tuple(v.shape), v.detach().reshape(-1), 0, v.numel())
    for u in units:
        chunks += _unit_chunks(u, shards[u.name], lambda p: [m + a for a in (p, *aliases.get(p, ()))], replicated=writer)
    if hp is not None:
        adam = opt_state[0]
        step = int(adam.count)
        for u in units:
            chunks += _unit_chunks(u, adam.mu[u.name], lambda p: [f"{o}state.{p}.exp_avg"], replicated=writer)
            chunks += _unit_chunks(u, adam.nu[u.name], lambda p: [f"{o}state.{p}.exp_avg_sq"], replicated=writer)
        if writer:
            group = _group(hp, step)
            for p in names:
                chunks.append(Chunk(f"{o}state.{p}.step", (), (), torch.tensor(float(step), dtype=torch.float32)))
                if flatten_optimizer:
                    chunks += [Blob(f"{o}param_groups.{p}.{k}", v) for k, v in group.items()]
            if not flatten_optimizer:
                chunks += [Blob(f"{o}param_groups.0.{k}", v) for k, v in group.items()]
                chunks.append(Blob(f"{o}param_groups.0.params", names))
    chunks = [c for c in chunks if isinstance(c, Blob) or c.tensor.numel()]
    return dcp_save(os.fspath(path), chunks, comm, f"save_fsdp2({os.fspath(path)!r})")
