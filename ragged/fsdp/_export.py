"""Full parameters out of a training state: :func:`export`.

[Note: exporting a module's state dict]
``export(units, shards, comm, module=model)`` all-gathers one unit at a time and copies each leaf
into its own tensor (on ``device``; no leaf shares storage with another or with a gathered
buffer, as ``safetensors`` and ``save_pretrained`` require). With ``module`` the result is a state
dict in ``module.state_dict()`` order with every key it has: each tied alias (e.g. HF's
``lm_head.weight`` tied to ``model.embed_tokens.weight``, which ``named_parameters()`` and so the
units list once) maps to the *same* tensor as its first name, and persistent buffers are copied
from the module. So ``fresh.load_state_dict(full, strict=True)`` works, and
``model.load_state_dict(full, assign=True)`` turns a released module back into one with real
weights (re-tie afterwards: ``model.tie_weights()`` in HF). For Hugging Face models,
``model.save_pretrained(path, state_dict=full)`` writes safetensors (it drops tied aliases
itself) that ``from_pretrained(path)`` reloads.

Every rank takes part in the all-gathers; with ``rank0_only`` only rank 0 (replica 0 under HSDP)
keeps the values, so the other ranks never hold more than one gathered unit.
"""

from __future__ import annotations

import torch

from ragged import transforms
from ragged._dbuffer import DBuffer
from ragged._errors import RaggedKeyError, RaggedTypeError
from ragged.fsdp._placeholder import tied_names
from ragged.fsdp._trainable import trainable_shards
from ragged.fsdp._units import Units

__all__ = ["export"]


def export(
    units: Units,
    shards: dict[str, DBuffer],
    comm,
    *,
    module: torch.nn.Module | None = None,
    rank0_only: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    trainable_only: bool = False,
) -> dict[str, torch.Tensor] | None:
    """The model's full parameters, one tensor per name (see [Note: exporting a module's state dict]).

    Args:
        units: the units ``shards`` was made for.
        shards: ``state.shards`` (``{unit name: DBuffer}``).
        comm: the shard group's collectives (every rank must call).
        module: the module the units were made from: the result is then its whole state dict
            (tied aliases, persistent buffers) for ``load_state_dict(strict=True)``. Without it:
            the units' tree (``{name: tensor}`` for a module's units).
        rank0_only: only rank 0 gets the result (``None`` elsewhere); ``False``: every rank.
        device: where the tensors go, e.g. ``"cpu"`` (default: the shards' device).
        dtype: cast the parameters (default: the master dtype); buffers keep theirs.
        trainable_only: only the trainable parameters (``{name: tensor}``, no buffers or tied
            aliases), gathering only each unit's trainable buffers: e.g. LoRA adapters for
            ``peft_model.save_pretrained(path, state_dict=adapters)``, without gathering the base.

    Returns:
        ``{name: tensor}``, or ``None`` on the ranks that do not keep it.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        >>> model[1].weight = model[0].weight  # tied
        >>> reference = {k: v.clone() for k, v in model.state_dict().items()}
        >>> units = fsdp.make_units(model, world_size=2)
        >>> def run(comm):
        ...     state = fsdp.init(units, model, rg.optim.sgd(0.1), comm)
        ...     return fsdp.export(units, state.shards, comm, module=model, device="cpu")
        >>> full = rg.collectives.simulate(2, run)[0]
        >>> sorted(full), full["1.weight"] is full["0.weight"]
        (['0.weight', '1.weight'], True)
        >>> fresh = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        >>> fresh.load_state_dict(full, strict=True)
        <All keys matched successfully>
        >>> torch.equal(fresh[1].weight, reference["1.weight"])
        True
    """
    if not isinstance(units, Units):
        raise RaggedTypeError(f"export: units must be rg.fsdp.make_units(...), got {type(units).__name__}.")
    missing = [u.name for u in units if u.name not in getattr(shards, "keys", lambda: ())()]
    if missing:
        raise RaggedKeyError(f"export: shards lacks units {missing}; pass state.shards of rg.fsdp.init / the step.")
    if module is not None and not (isinstance(module, torch.nn.Module) and units.is_module):
        raise RaggedTypeError("export: module= needs units made from that module (make_units(model)).")
    names = dict(module.named_parameters()) if module is not None else None
    if names is not None:
        unknown = [p for u in units for p in u.paths if p not in names]
        if unknown:
            raise RaggedKeyError(f"export: the units name parameters {unknown[:3]} that module does not have. "
                                 "Fix: pass the module the units were made from.")
    keep = not rank0_only or (comm.rank == 0 and getattr(comm, "replica_rank", 0) == 0)
    parts = trainable_shards(units, shards) if trainable_only else shards
    leaves: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for u in units:  # one gathered unit alive at a time
            if u.name not in parts:
                continue
            full = transforms.gather(parts[u.name], comm, dtype=dtype)
            if keep:
                leaves[u.name] = {p: full[p].to(device if device is not None else full[p].device, copy=True)
                                  for p in (u.trainable_paths if trainable_only else u.paths)}
            del full
    if not keep:
        return None
    if trainable_only:
        return {p: t for tree in leaves.values() for p, t in tree.items()}
    tree = units.merge(leaves)
    if module is None:
        return tree
    aliases = tied_names(module)
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in tree:
            out[key] = tree[key]
        elif aliases.get(key) in tree:
            out[key] = tree[aliases[key]]
        elif key in names:
            raise RaggedKeyError(f"export: parameter {key!r} of the module is in no unit. "
                                 "Fix: pass the module the units were made from.")
        else:  # a persistent buffer: not sharded, the module holds it
            out[key] = value.detach().to(device if device is not None else value.device, copy=True)
    return out
