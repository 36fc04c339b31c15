"""Hugging Face weights in and out by rank: :func:`load_shards` (what ``fsdp.init`` does with
``rg.checkpoint.pretrained(path)``) and :func:`save_pretrained`.

[Note: loading pretrained weights by rank]
In a unit's plan every rank's piece of a sharded leaf is one contiguous element range of the
flattened leaf (``plan.local_pieces(rank)``), so a rank fills its shard by reading exactly those
ranges from the safetensors files (see [Note: reading safetensors by byte range]), cast into
the plan's master dtype on copy through a bounded read buffer; replicated leaves
(``spec.Replicate()``) are read whole. A rank's memory during the load is its shards plus that
buffer: no rank ever holds a whole unit, let alone the model. Before anything is read or any
collective runs, the whole directory is checked against the units, from the headers alone, so
every rank raises the same :class:`CheckpointMismatchError` listing the missing and unexpected
names, wrong shapes and dtypes that cannot be cast (floating-point files cast into any
floating-point master dtype; otherwise the dtypes must be equal). A tied weight is one parameter
of the units, under its first name (``model.embed_tokens.weight``), which is the one tensor
transformers saves; a file that also holds the alias (``lm_head.weight``) lists it as
unexpected: drop it with ``pretrained(path, rename={"lm_head.weight": None})``.

[Note: saving pretrained weights by rank]
``save_pretrained`` all-gathers one unit at a time (every rank holds at most one gathered unit)
and rank 0 writes it as one safetensors file, straight from the gathered buffer (no copy per
tensor unless a ``dtype`` cast is asked), then the index (``model.safetensors.index.json``,
written last) and the module's ``config.json`` (its ``dtype`` set to the saved dtype). Names are
the module's parameter names, which ``from_pretrained`` loads as they are, persistent buffers
go into one more file; tied aliases are left out, as transformers does. An error while
writing on rank 0 is raised on every rank once the gathers are done.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged.spec._concat import replicated_size
from ragged.transforms import gather
from ragged.transforms._check import check_comm, check_plan, poisons
from ragged.fsdp._placeholder import tied_names
from ragged.fsdp._peft import is_peft, merge_plan, save_adapters
from ragged.fsdp._units import Units

__all__ = ["is_pretrained", "load_shards", "save_pretrained"]

_SHOWN = 4


def is_pretrained(params) -> bool:
    """Whether ``params`` is ``rg.checkpoint.pretrained(...)`` (without importing
    ``ragged.checkpoint``, which loads torch.distributed.checkpoint, when it was never used)."""
    mod = sys.modules.get("ragged.checkpoint._pretrained")
    return mod is not None and isinstance(params, mod.Pretrained)


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def _listed(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def check_weights(units: Units, weights, where: str, reader: str = "pretrained") -> None:
    """Refuses (:class:`CheckpointMismatchError`, the same on every rank: it reads headers only)
    a pretrained mapping that does not fit ``units``, listing every problem by name and file."""
    # ragged.checkpoint loads torch.distributed.checkpoint: only when a checkpoint is read or written
    from ragged.checkpoint._format import CheckpointMismatchError

    expected = {u.paths[leaf.index]: (leaf, u.plan.dtype) for u in units for leaf in u.plan.leaves + u.plan.replicated}
    missing = [repr(p) for p in expected if p not in weights]
    unexpected = [weights[k].where() for k in weights if k not in expected]
    shapes, dtypes = [], []
    for p, (leaf, master) in expected.items():
        if p not in weights:
            continue
        ref = weights[p]
        if tuple(ref.shape) != tuple(leaf.shape):
            shapes.append(f"{ref.where()} is {tuple(ref.shape)}, {p!r} is {tuple(leaf.shape)}")
        if not _castable(ref.dtype, master):
            dtypes.append(f"{ref.where()} is {ref.dtype}, {p!r} is {master}")
    problems = [f"{len(items)} {what}: {_listed(items)}" for what, items in (
        ("missing", missing), ("unexpected", unexpected), ("wrong shapes", shapes), ("dtypes that do not cast", dtypes))
        if items]
    if problems:
        raise CheckpointMismatchError(
            f"{where}: {weights.path} does not fit the units: {'; '.join(problems)}. Fix: load the checkpoint of this "
            f"model (same config), map its names with {reader}(path, rename={{key: name or None}}), or make the units "
            "from the model the checkpoint was saved from.")


@poisons("comm")
def load_shards(units: Units, weights, comm, *, device=None) -> dict[str, DBuffer]:
    """``{unit name: DBuffer}`` of this rank, read from ``weights`` (``rg.checkpoint.pretrained``)
    range by range (see [Note: loading pretrained weights by rank]).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> from ragged import fsdp
        >>> from ragged.checkpoint._safetensors import write_file
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
        >>> d = tempfile.mkdtemp()
        >>> _ = write_file(os.path.join(d, "model.safetensors"), {k: v.bfloat16() for k, v in model.state_dict().items()})
        >>> units = fsdp.make_units(model, world_size=2, groups=["0", "1"])
        >>> def run(comm):
        ...     state = fsdp.init(units, rg.checkpoint.pretrained(d), rg.optim.adamw(1e-3), comm)
        ...     return fsdp.export(units, state.shards, comm)
        >>> full = rg.collectives.simulate(2, run)[0]
        >>> torch.equal(full["1.weight"], model[1].weight.bfloat16().double()), full["1.weight"].dtype
        (True, torch.float64)
    """
    if not isinstance(units, Units):
        raise RaggedTypeError(f"units must be rg.fsdp.make_units(model, world_size=...), got {type(units).__name__}.")
    check_weights(units, weights, f"fsdp.init(units, {weights!r})")
    device = torch.device(device) if device is not None else getattr(comm, "device", None) or torch.device("cpu")
    shards = {}
    with torch.no_grad():
        for u in units:
            plan = u.plan
            check_comm(plan, comm, "fsdp.init")
            check_plan(plan, comm, "fsdp.init")
            rank = comm.rank
            data = torch.zeros(plan.shard_size if rank < plan.world_size else 0, dtype=plan.dtype, device=device)
            replicated = torch.zeros(replicated_size(plan), dtype=plan.dtype, device=device)
            if rank < plan.world_size:
                for piece in plan.local_pieces(rank):
                    weights[u.paths[piece.leaf.index]].read(
                        piece.start, piece.stop, out=data[piece.local_offset : piece.local_offset + piece.numel])
            for leaf in plan.replicated:
                weights[u.paths[leaf.index]].read(out=replicated[leaf.offset : leaf.stop])
            shards[u.name] = DBuffer(data=data, replicated=replicated, plan=plan, rank=rank)
    return shards


def _buffers(module: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    aliases = tied_names(module)
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in names and k not in aliases}


def check_architecture(keys: list[str], module: torch.nn.Module) -> None:
    """Refuses (every rank, from names only) ``keys`` that a Hugging Face ``module``'s
    architecture, built afresh from its config on meta, does not have or lacks (tied aliases
    aside): ``from_pretrained`` would drop the one and initialise the other at random."""
    config, build = getattr(module, "config", None), getattr(type(module), "_from_config", None)
    if config is None or not callable(build):
        return
    with torch.device("meta"):
        reference = build(copy.deepcopy(config))
    aliases = tied_names(reference)
    expected = [k for k in reference.state_dict(keep_vars=True) if k not in aliases]
    have, want = set(keys), set(expected)
    unknown = [k for k in keys if k not in want]
    missing = [k for k in expected if k not in have]
    if not (unknown or missing):
        return
    more = lambda ks: f" (and {len(ks) - 1} more)" if len(ks) > 1 else ""  # noqa: E731
    them = lambda ks: "them" if len(ks) > 1 else "it"  # noqa: E731
    parts = ([f"has no weight {unknown[0]!r}{more(unknown)} (from_pretrained would drop {them(unknown)})"]
             if unknown else []) + ([f"needs {missing[0]!r}{more(missing)}, which the module does not hold "
                                     f"(from_pretrained would initialise {them(missing)} at random)"] if missing else [])
    fix = ("the module holds PEFT layers: pass the PeftModel itself (module=peft_model; merged=True for the merged "
           "model)" if any(".lora_" in k or ".base_layer." in k for k in unknown) else
           "save the module the units were made from, or fsdp.export the state dict and write a format of your own")
    raise RaggedValueError(f"save_pretrained: {type(reference).__name__} (the module's architecture, built from its "
                           f"config) {' and '.join(parts)}. Fix: {fix}.")


def save_pretrained(units: Units, shards: dict[str, DBuffer], comm, path: str | os.PathLike, *,
                    module: torch.nn.Module | None = None, dtype: torch.dtype | None = None,
                    merged: bool = False) -> None:
    """Writes the model as a Hugging Face directory (safetensors shards, one per unit, plus
    ``model.safetensors.index.json`` and, with ``module``, its ``config.json``): see [Note:
    saving pretrained weights by rank]. Every rank calls it.

    Args:
        units: the units ``shards`` was made for.
        shards: ``state.shards``.
        comm: the shard group's collectives.
        path: the directory (made if absent; files of the same names are replaced).
        module: the module the units were made from: its persistent buffers are saved too, and
            its ``config`` (when it has one) with ``config.save_pretrained``. A Hugging Face
            model's names are checked against its architecture (a fresh ``type(module)`` from
            its config, on meta): a name the architecture does not have, or one of its weights
            left out, is refused. A ``peft.PeftModel``: the adapter directory peft writes
            (``adapter_config.json``, ``adapter_model.safetensors``) for
            ``PeftModel.from_pretrained(base, path)``, or with ``merged=True`` the base model
            with the LoRA adapters merged in, as ``merge_and_unload()`` computes them (see
            [Note: saving a PEFT model] in ``fsdp/_peft.py``).
        dtype: the saved dtype (default: each unit's master dtype, so ``from_pretrained(path,
            dtype=that)`` gives the parameters bit for bit).
        merged: for a PEFT model, write the merged model instead of the adapters.

    Raises:
        RaggedValueError: a name the architecture does not have (or lacks), a trained parameter
            the adapter format would drop, a PEFT model ``merged=True`` cannot merge: on every
            rank, before anything is gathered or written.
        CheckpointError: writing failed on rank 0 (raised on every rank).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> ref = {k: v.clone() for k, v in model.state_dict().items()}
        >>> units = fsdp.make_units(model, world_size=2, groups=["0", "1"])
        >>> d = tempfile.mkdtemp()
        >>> def run(comm):
        ...     state = fsdp.init(units, model.state_dict(), rg.optim.sgd(0.1), comm)
        ...     fsdp.save_pretrained(units, state.shards, comm, d, dtype=torch.bfloat16)
        >>> _ = rg.collectives.simulate(2, run)
        >>> sorted(os.listdir(d))
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
        >>> saved = rg.checkpoint.pretrained(d)["1.weight"]
        >>> saved.file, torch.equal(saved.read().view(saved.shape), ref["1.weight"].bfloat16())
        ('model-00002-of-00002.safetensors', True)
    """
    # ragged.checkpoint loads torch.distributed.checkpoint: only when a checkpoint is read or written
    from ragged.checkpoint._dcp import on_every_rank
    from ragged.checkpoint._format import write_json_atomic
    from ragged.checkpoint._safetensors import write_file
    from ragged.checkpoint._pretrained import INDEX

    path = os.fspath(path)
    agreed = lambda fn: on_every_rank(comm, f"save_pretrained({path!r})", "write", fn)  # noqa: E731
    if module is not None and is_peft(module) and not merged:
        return save_adapters(units, shards, comm, path, module, dtype, agreed)
    if merged and not is_peft(module):
        raise RaggedValueError("save_pretrained: merged=True merges a PEFT model's adapters; module is "
                               f"{type(module).__name__}. Fix: drop merged=True.")
    rename, merge = merge_plan(units, module) if merged else (lambda key: key, None)
    base = module.get_base_model() if merged else module
    writer = comm.rank == 0 and getattr(comm, "replica_rank", 0) == 0
    names = {p for u in units for p in u.paths}
    buffers = {rename(k): v for k, v in _buffers(module, names).items() if rename(k)} if module is not None else {}
    if base is not None:
        check_architecture([rename(p) for u in units for p in u.paths if rename(p)] + list(buffers), base)
    count = len(units) + (1 if buffers else 0)
    file_of = lambda i: f"model-{i + 1:05d}-of-{count:05d}.safetensors"  # noqa: E731
    weight_map, total, failure = {}, 0, None
    if writer:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            failure = exc
    with torch.no_grad():
        for i, u in enumerate(units):  # one gathered unit alive at a time
            full = gather(shards[u.name], comm, dtype=None if merge else dtype)  # merged: in the master dtype
            if writer and failure is None:
                try:
                    tensors = merge(u, full, dtype) if merge else {p: full[p] for p in u.paths}
                    total += write_file(os.path.join(path, file_of(i)), tensors)
                    weight_map.update(dict.fromkeys(tensors, file_of(i)))
                except Exception as exc:  # noqa: BLE001 - raised on every rank by agreed below
                    failure = exc
            del full
    if writer and failure is None:
        try:
            if buffers:
                total += write_file(os.path.join(path, file_of(count - 1)), {k: v.detach() for k, v in buffers.items()})
                weight_map.update(dict.fromkeys(buffers, file_of(count - 1)))
            config = getattr(base, "config", None)
            if callable(getattr(config, "save_pretrained", None)):
                config = copy.deepcopy(config)
                config.dtype = dtype if dtype is not None else units[0].plan.dtype
                config.save_pretrained(path)
                generation = getattr(base, "generation_config", None)
                if callable(getattr(generation, "save_pretrained", None)):
                    generation.save_pretrained(path)
            write_json_atomic(os.path.join(path, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
        except Exception as exc:  # noqa: BLE001
            failure = exc

    def outcome():
        if failure is not None:
            raise failure
    agreed(outcome)
