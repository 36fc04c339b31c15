"""Hugging Face directories: read lazily (:func:`pretrained`), loaded by rank (what ``fsdp.init``
does with one, :meth:`Pretrained.load_by_rank`), and written by rank (``fsdp.save_pretrained``).

[Note: a pretrained directory is read lazily]
``pretrained(path)`` reads the directory's ``model.safetensors.index.json`` (or its single
``model.safetensors``) and every shard's header, nothing else: no tensor values, no ``config``
code, nothing unpickled (``.bin`` / ``torch.load`` checkpoints are refused). File names come from
the index and must be plain names inside the directory; files are opened without following
symlinks (see [Note: what a checkpoint may name] in ``_format.py``). Each value is a
:class:`TensorRef` (``shape``, ``dtype``, ``read(start, stop)`` of its flattened values, see
[Note: reading safetensors by byte range]) or a :class:`Concat` of refs (a parameter that
Hugging Face fuses on load). So ``fsdp.init(units, weights, ...)`` makes each rank read only the
element ranges of its own shard.

Names are the module's parameter names: keys are renamed where transformers renames them on load
(see :data:`HF_CONVERSIONS`: Mixtral's per-expert ``block_sparse_moe.experts.E.w1 / w2 / w3``
become the fused ``mlp.experts.gate_up_proj`` / ``down_proj``), then by ``rename=``.

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
import json
import os
import re
from collections.abc import Callable, Mapping

import torch

from ragged._dbuffer import DBuffer
from ragged._errors import RaggedTypeError, RaggedValueError
from ragged.checkpoint._dcp import on_every_rank
from ragged.checkpoint._peft import check_architecture, is_peft, merge_plan, save_adapters
from ragged.checkpoint._format import (CheckpointCorruptError, CheckpointMismatchError, RefMapping, check_name,
                                       open_regular, require_path, write_json_atomic)
from ragged.checkpoint._safetensors import Concat, TensorRef, read_header, write_file
from ragged.fsdp._placeholder import tied_names
from ragged.fsdp._units import Units
from ragged.spec._concat import replicated_size
from ragged.transforms import gather
from ragged.transforms._check import check_comm, check_plan, poisons

__all__ = ["Pretrained", "pretrained", "save_pretrained", "HF_CONVERSIONS", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHOWN = 4


def _mixtral_experts(refs: dict[str, TensorRef]) -> dict[str, TensorRef | Concat]:
    """transformers 5 loads Mixtral's per-expert ``w1 / w3`` as ``mlp.experts.gate_up_proj``
    ``(E, 2F, D)`` (expert e: ``cat(w1_e, w3_e)``) and ``w2`` as ``down_proj`` ``(E, D, F)``; the
    router ``block_sparse_moe.gate`` becomes ``mlp.gate``."""
    pattern = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
    experts: dict[str, dict[int, dict[str, TensorRef]]] = {}
    out: dict[str, TensorRef | Concat] = {}
    for key, ref in refs.items():
        m = pattern.fullmatch(key)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = ref
        else:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = ref
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        lacking = [(e, w) for e in ids for w in ("w1", "w2", "w3") if w not in by_expert[e]]
        if ids != list(range(len(ids))) or lacking:
            raise CheckpointCorruptError(
                f"{next(iter(by_expert[ids[0]].values())).file}: the experts of {prefix!r} are incomplete (experts "
                f"{ids[:8]}, lacking {lacking[:4]}): transformers fuses experts 0..E-1, each with w1, w2 and w3")
        w1, w2 = by_expert[0]["w1"], by_expert[0]["w2"]
        E = len(ids)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = Concat(
            parts=tuple(by_expert[e][w] for e in ids for w in ("w1", "w3")), shape=(E, 2 * w1.shape[0], *w1.shape[1:]))
        out[f"{prefix}.mlp.experts.down_proj"] = Concat(parts=tuple(by_expert[e]["w2"] for e in ids), shape=(E, *w2.shape))
    return out


HF_CONVERSIONS: dict[str, Callable[[dict[str, TensorRef]], dict[str, TensorRef | Concat]]] = {
    "mixtral": _mixtral_experts,
}
"""``{config.json model_type: conversion}``: the key conversions transformers applies on load
that are not a plain rename of one tensor (each a function of the file's ``{key: TensorRef}``)."""


class Pretrained(RefMapping):
    """``{parameter name: TensorRef | Concat}`` of a Hugging Face directory (see [Note: a
    pretrained directory is read lazily]); made by :func:`pretrained`.

    Attributes:
        path: the resolved directory.
        files: the safetensors files, in the index's order.
        config: ``config.json`` as a dict (``{}`` when there is none).

    Examples:
        >>> import tempfile, torch, transformers, ragged as rg
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...                                num_attention_heads=2, num_key_value_heads=1)
        >>> path = tempfile.mkdtemp()
        >>> transformers.LlamaForCausalLM(cfg).save_pretrained(path)
        >>> weights = rg.checkpoint.pretrained(path)
        >>> isinstance(weights, rg.checkpoint.Pretrained), tuple(weights["model.embed_tokens.weight"].shape)
        (True, (32, 8))
    """

    def __init__(self, path: str, refs: dict, files: tuple[str, ...], config: dict):
        self.path, self._refs, self.files, self.config = path, refs, files, config

    def __repr__(self) -> str:
        return f"pretrained({self.path!r}: {len(self)} tensors in {len(self.files)} file{'s' * (len(self.files) != 1)})"

    def load_by_rank(self, units: Units, optimizer, comm, *, device: torch.device) -> tuple[dict[str, DBuffer], None]:
        """``(shards, None)``: this rank's shards, what ``fsdp.init(units, self, ...)`` starts from
        (see [Note: loading pretrained weights by rank]); the optimizer starts afresh."""
        del optimizer
        return load_shards(units, self, comm, device=device), None


def _read_json(root: str, name: str, what: str) -> dict:
    with open_regular(os.path.join(root, name)) as f:
        raw = f.read(64 << 20)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{name}: {what} is not a JSON object")
    return obj


def pretrained(path: str | os.PathLike, *, rename: Mapping[str, str | None] | Callable[[str], str | None] | None = None,
               convert: bool = True) -> Pretrained:
    """A lazy ``{name: tensor-like}`` of the Hugging Face directory ``path`` (``model.safetensors``,
    or shards + ``model.safetensors.index.json``): headers only (see [Note: a pretrained
    directory is read lazily]).

    Args:
        path: the directory.
        rename: after transformers' own conversions (``convert``), a mapping ``{key: new name}``
            or a function ``key -> new name``; ``None`` drops the tensor (e.g. a buffer the units
            do not hold). Keys a mapping does not name keep their name.
        convert: apply :data:`HF_CONVERSIONS` for ``config.json``'s ``model_type``.

    Returns:
        A :class:`Pretrained` mapping.

    Raises:
        CheckpointNotFoundError: nothing at ``path`` (also a ``FileNotFoundError``).
        CheckpointCorruptError: no safetensors checkpoint, a file outside the directory or a
            symlink, an index naming tensors its files lack (or the reverse), a truncated file,
            a header that lies about its sizes (the message names the file and the key).

    Examples:
        >>> import os, tempfile, torch, ragged as rg
        >>> from ragged.checkpoint._safetensors import write_file
        >>> d = tempfile.mkdtemp()
        >>> _ = write_file(os.path.join(d, "model.safetensors"), {"lin.weight": torch.ones(3, 2), "old": torch.zeros(1)})
        >>> w = rg.checkpoint.pretrained(d, rename={"old": None})
        >>> w
        pretrained('...': 1 tensors in 1 file)
        >>> w["lin.weight"].shape, w["lin.weight"].dtype
        ((3, 2), torch.float32)
    """
    root = os.path.realpath(require_path(path, "rg.checkpoint.pretrained reads a Hugging Face model directory"))
    if not os.path.isdir(root):
        raise CheckpointCorruptError(f"{os.fspath(path)!r} is not a directory (rg.checkpoint.pretrained reads a Hugging "
                                     "Face model directory)")
    entries = set(os.listdir(root))
    if INDEX in entries:
        index = _read_json(root, INDEX, "the index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointCorruptError(f"{INDEX}: has no weight_map {{tensor name: file name}}")
        files = tuple(dict.fromkeys(check_name(v, f"{INDEX} (for {k!r})") for k, v in weight_map.items()))
    elif SINGLE in entries:
        weight_map, files = None, (SINGLE,)
    else:
        pickled = sorted(e for e in entries if e.endswith((".bin", ".pt", ".pth", ".ckpt")))
        raise CheckpointCorruptError(
            f"{root}: holds neither {SINGLE} nor {INDEX}"
            + (f"; {pickled[:3]} are pickle checkpoints, which are refused (they can run code): convert them to "
               "safetensors" if pickled else ""))
    refs: dict[str, TensorRef] = {}
    for file in files:
        if file not in entries:
            key = next(k for k, v in weight_map.items() if v == file)
            raise CheckpointCorruptError(f"{INDEX}: maps {key!r} to {file!r}, which is not in the directory")
        full = os.path.join(root, file)
        _, header = read_header(full)
        for key, e in header.items():
            if weight_map is not None and weight_map.get(key) != file:
                raise CheckpointCorruptError(f"{file}: {key!r} is in this file but {INDEX} maps it to "
                                             f"{weight_map.get(key)!r}")
            refs[key] = TensorRef(key=key, file=file, path=full, shape=e["shape"], dtype=e["dtype"], begin=e["begin"])
    if weight_map is not None:
        lacking = [k for k in weight_map if k not in refs]
        if lacking:
            raise CheckpointCorruptError(f"{weight_map[lacking[0]]}: {lacking[0]!r} is in {INDEX} but not in the file's "
                                         f"header ({len(lacking)} such tensors)")
    config = _read_json(root, "config.json", "config.json") if "config.json" in entries else {}
    named: dict = refs
    if convert and config.get("model_type") in HF_CONVERSIONS:
        named = HF_CONVERSIONS[config["model_type"]](refs)
    return Pretrained(root, renamed(named, rename, CheckpointCorruptError), files, config)


def renamed(named: dict, rename, error: type[Exception]) -> dict:
    """``named`` under the names ``rename`` gives (a mapping, whose missing keys keep their name,
    or a function; ``None`` drops the entry), for both formats' ``rename=``; two entries under
    one name raise ``error``."""
    if rename is None:
        return named
    fn = rename if callable(rename) else (lambda k: rename.get(k, k))
    out, source = {}, {}
    for key, value in named.items():
        new = fn(key)
        if new in out:
            raise error(f"rename maps {source[new]!r} and {key!r} both to {new!r}.")
        if new is not None:
            out[new], source[new] = value, key
    return out


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def _listed(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def check_weights(units: Units, weights, where: str, reader: str = "pretrained") -> None:
    """Refuses (:class:`CheckpointMismatchError`, the same on every rank: it reads headers only)
    a pretrained mapping that does not fit ``units``, listing every problem by name and file."""
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
def load_shards(units: Units, weights, comm, *, device: torch.device) -> dict[str, DBuffer]:
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
    shards = zero_shards(units, comm, device)
    with torch.no_grad():
        for name, _, start, stop, view in rank_ranges(units, shards):
            weights[name].read(start, stop, out=view)
    return shards


def zero_shards(units: Units, comm, device: torch.device) -> dict[str, DBuffer]:
    """``{unit name: DBuffer of zeros}`` of this rank on ``device``, every plan checked against
    ``comm`` first."""
    for u in units:
        check_comm(u.plan, comm, "fsdp.init")
        check_plan(u.plan, comm, "fsdp.init")
    return {u.name: DBuffer(data=torch.zeros(u.plan.shard_size if comm.rank < u.plan.world_size else 0,
                                             dtype=u.plan.dtype, device=device),
                            replicated=torch.zeros(replicated_size(u.plan), dtype=u.plan.dtype, device=device),
                            plan=u.plan, rank=comm.rank) for u in units}


def rank_ranges(units: Units, shards: dict[str, DBuffer], *, replicated: bool = True):
    """``(parameter name, leaf, start, stop, view)`` of every element range this rank holds of
    ``shards``: elements ``[start, stop)`` of the flattened leaf, ``view`` their flat slice of its
    shard; replicated leaves whole (with ``replicated``). The one map from a plan to the parts of
    a checkpoint's tensors, for Hugging Face files and FSDP2's DCP chunks alike."""
    for u in units:
        d = shards[u.name]
        if d.rank < d.plan.world_size:
            for p in d.plan.local_pieces(d.rank):
                yield u.paths[p.leaf.index], p.leaf, p.start, p.stop, d.data[p.local_offset : p.local_offset + p.numel]
        if replicated:
            for leaf in d.plan.replicated:
                yield u.paths[leaf.index], leaf, 0, leaf.numel, d.replicated[leaf.offset : leaf.stop]


def persistent_buffers(module: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    """``module``'s state-dict entries that are neither one of ``names`` nor a tied alias."""
    aliases = tied_names(module)
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in names and k not in aliases}


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
            [Note: saving a PEFT model] in ``_peft.py``).
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
    buffers = ({rename(k): v for k, v in persistent_buffers(module, names).items() if rename(k)}
               if module is not None else {})
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
