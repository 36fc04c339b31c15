"""A ``torch.distributed.checkpoint`` directory written by FSDP2 or torchtitan as a lazy source
of weights and AdamW state: :func:`fsdp2`.

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
loading an FSDP2 checkpoint by rank] in ``fsdp/_fsdp2.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from ragged.checkpoint._dcp import Blob, Chunk, SingleProcess, dcp_load
from ragged.checkpoint._format import CheckpointCorruptError, CheckpointMismatchError, RefMapping, require_path
from ragged.checkpoint._metadata import check_foreign, read_metadata

__all__ = ["DCPRef", "FSDP2Checkpoint", "fsdp2", "MOMENTS", "ADAMW_REQUIRED"]

MOMENTS = ("exp_avg", "exp_avg_sq")
ADAMW_REQUIRED = ("lr", "betas", "eps", "weight_decay")
_ADAMW_FLAGS = {"amsgrad": False, "maximize": False}  # torch.optim.AdamW options ragged's adamw does not have


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


def _param_groups(entries: dict[str, Any], head: str, fqns: list[str]) -> dict[str, dict[str, Any]]:
    """``{fqn: its group}`` from the ``param_groups`` entries (nested by index or flat by fqn);
    each group also says where it is stored (``"key"``: its DCP key prefix)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in entries.items():
        group, _, name = key[len(head):].rpartition(".")
        groups.setdefault(group, {})[name] = value
    by_fqn: dict[str, dict[str, Any]] = {}
    for group, values in groups.items():
        if group.isdigit():  # nested: param_groups.<i>.<name>, the group's fqns in "params"
            members = values.get("params")
            if not isinstance(members, list) or not all(isinstance(f, str) for f in members):
                raise CheckpointMismatchError(f"DCP key {head + group + '.params'!r} is not the group's list of "
                                              "parameter names (a param group of get_optimizer_state_dict).")
            for fqn in members:
                by_fqn[fqn] = {k: v for k, v in values.items() if k != "params"} | {"key": head + group}
        else:  # flat (flatten_optimizer_state_dict=True): param_groups.<fqn>.<name>
            by_fqn[group] = values | {"key": head + group}
    lacking = [f for f in fqns if f not in by_fqn]
    if lacking:
        raise CheckpointMismatchError(f"no param group of {head[:-1]!r} holds {lacking[0]!r} ({len(lacking)} such "
                                      "parameters have optimizer state but no group).")
    for fqn in fqns:
        group = by_fqn[fqn]
        missing = [k for k in ADAMW_REQUIRED if k not in group]
        if missing:
            raise CheckpointMismatchError(f"the param group of {fqn!r} lacks {missing} ({group['key']}.*): not an "
                                          "AdamW state (ragged loads torch.optim.AdamW's).")
        odd = {k: group[k] for k, v in _ADAMW_FLAGS.items() if group.get(k, v) != v}
        if group.get("weight_decay") and group.get("decoupled_weight_decay", True) is not True:
            odd["decoupled_weight_decay"] = group["decoupled_weight_decay"]
        if odd:
            raise CheckpointMismatchError(f"the param group of {fqn!r} ({group['key']}.*) has {odd}: that is not "
                                          "torch.optim.AdamW's update (ragged's adamw has no such option).")
    return by_fqn


def _renamer(rename):
    if rename is None:
        return lambda k: k
    return rename if callable(rename) else (lambda k: rename.get(k, k))


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
    rename_fn = _renamer(rename)
    refs = {}
    for k, md in stored.items():
        if k.startswith(model_head) and not is_opt(k) and (model_key or isinstance(md, dcp_md.TensorStorageMetadata)):
            new = rename_fn(k[len(model_head):])
            if new is None:
                continue
            if new in refs:
                raise CheckpointMismatchError(f"rename maps DCP keys {refs[new].key!r} and {k!r} both to {new!r}.")
            refs[new] = _ref(k, md)
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
    param_groups = _param_groups({k: small[k] for k in groups}, group_head, sorted(found))
    moments, by_name = {}, {}
    for fqn, names in found.items():
        new = rename_fn(fqn)
        if new is not None:
            moments[new] = tuple(_ref(names[m], stored[names[m]]) for m in MOMENTS)
            by_name[new] = param_groups[fqn]
    step = int(next(iter(steps.values()))) if steps else 0
    return FSDP2Checkpoint(root, metadata, model_key, optimizer_key, refs, moments, step, by_name)
