"""A Hugging Face directory as a lazy ``{name: tensor-like}``: :func:`pretrained`.

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping

import torch

from ragged.checkpoint._format import CheckpointCorruptError, RefMapping, check_name, open_regular, require_path
from ragged.checkpoint._safetensors import read_header, read_range

__all__ = ["TensorRef", "Concat", "Pretrained", "pretrained", "HF_CONVERSIONS", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """One tensor of a safetensors file, not read.

    Attributes:
        key: its name in the file.
        file: the file's name in the directory.
        path: the file's resolved path.
        shape, dtype: as the header says.
        begin: absolute byte offset of its first element.
    """

    key: str
    file: str
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sources(self) -> tuple[TensorRef, ...]:
        return (self,)

    def read(self, start: int = 0, stop: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor, read from the file only (into
        ``out`` when given: 1-D, any dtype and device, cast on copy).

        Examples:
            >>> import os, tempfile, torch, ragged as rg
            >>> from ragged.checkpoint._safetensors import write_file
            >>> d = tempfile.mkdtemp()
            >>> _ = write_file(os.path.join(d, "model.safetensors"), {"w": torch.arange(6.0).view(2, 3).bfloat16()})
            >>> w = rg.checkpoint.pretrained(d)["w"]
            >>> w.read(2, 5).tolist(), w.read(out=torch.empty(6, dtype=torch.float64)).dtype
            ([2.0, 3.0, 4.0], torch.float64)
        """
        stop = self.numel if stop is None else stop
        if not 0 <= start <= stop <= self.numel:
            raise IndexError(f"{self.file}: {self.key!r} has {self.numel} elements; [{start}, {stop}) is out of range")
        out = torch.empty(stop - start, dtype=self.dtype) if out is None else out
        entry = {"dtype": self.dtype, "begin": self.begin}
        read_range(self.path, self.key, entry, start, stop, out)
        return out

    def where(self) -> str:
        return f"{self.file}: {self.key!r}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Concat:
    """A tensor whose flattened values are its parts' flattened values one after another (a
    stack or a dim-0 concatenation, e.g. Hugging Face's fused experts), not read.

    Examples:
        >>> import os, tempfile, torch
        >>> from ragged.checkpoint._pretrained import pretrained, Concat
        >>> from ragged.checkpoint._safetensors import write_file
        >>> d = tempfile.mkdtemp()
        >>> _ = write_file(os.path.join(d, "model.safetensors"), {"a": torch.zeros(2, 2), "b": torch.ones(2, 2)})
        >>> w = pretrained(d)
        >>> Concat(parts=(w["a"], w["b"]), shape=(2, 2, 2)).read(3, 6).tolist()
        [0.0, 1.0, 1.0]
    """

    parts: tuple[TensorRef, ...]
    shape: tuple[int, ...]

    def __post_init__(self):
        if len({p.dtype for p in self.parts}) > 1:
            raise CheckpointCorruptError(f"{self.parts[0].where()}: the parts of one fused tensor have different dtypes "
                                         f"{sorted({str(p.dtype) for p in self.parts})}")
        total = math.prod(self.shape)
        if sum(p.numel for p in self.parts) != total:
            raise CheckpointCorruptError(
                f"{self.parts[0].where()}: the parts {[p.key for p in self.parts][:4]}... hold "
                f"{sum(p.numel for p in self.parts)} elements, not the {total} of the fused shape {self.shape}")

    dtype = property(lambda self: self.parts[0].dtype)
    sources = property(lambda self: self.parts)
    numel = property(lambda self: sum(p.numel for p in self.parts))

    def where(self) -> str:
        return f"{self.parts[0].file}: {self.parts[0].key!r} (+{len(self.parts) - 1} fused)"

    def read(self, start: int = 0, stop: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened fused tensor (see :meth:`TensorRef.read`)."""
        stop = self.numel if stop is None else stop
        out = torch.empty(stop - start, dtype=self.dtype) if out is None else out
        base = 0
        for p in self.parts:
            lo, hi = max(start, base), min(stop, base + p.numel)
            if lo < hi:
                p.read(lo - base, hi - base, out=out[lo - start : hi - start])
            base += p.numel
        return out


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
    if rename is not None:
        fn = rename if callable(rename) else (lambda k: rename.get(k, k))
        renamed: dict = {}
        for key, ref in named.items():
            new = fn(key)
            if new is None:
                continue
            if new in renamed:
                raise CheckpointCorruptError(f"{ref.where()}: rename maps it and {renamed[new].where()} both to {new!r}")
            renamed[new] = ref
        named = renamed
    return Pretrained(root, named, files, config)
