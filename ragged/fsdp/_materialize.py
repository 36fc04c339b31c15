"""Building on ``meta``: real values for one unit at a time, and for the module's buffers.

[Note: initialising a meta module unit by unit]
``fsdp.init(units, meta_model, ...)`` never materialises the whole model on a rank. For each unit
it takes the modules that directly hold the unit's parameters ("owners"; the first owner of a
tied weight), makes for each a shallow copy whose *own* parameters and buffers are real, empty
tensors on ``device`` (the ``to_empty`` of that module alone; children stay meta, and the
caller's module is not touched, so simulated ranks can share it), runs ``init_fn(copy)`` under
a generator seeded from ``(seed, owner name)``, shards the unit and drops the copies. At most one
unit is real at a time. The values depend on the owner's name and the seed only: the same on
every rank, for every world size, every unit grouping and every plan.

The default ``init_fn`` is what the module's authors wrote for initialisation: for a module
inside a Hugging Face ``PreTrainedModel`` (anything with ``_init_weights`` and ``config``), the
nearest such model's ``_init_weights(module)`` (transformers 5 also recomputes rotary
``inv_freq`` there); otherwise ``module.reset_parameters()`` when the module has one.

Buffers are not sharded. Meta buffers are computed the same way, module by module (the owner's
parameters are scratch then), and set on the caller's module on ``device``; real buffers are
kept.

Uninitialised memory is the one way this could be silently wrong (``to_empty`` leaves garbage),
so nothing is taken unchecked: floating-point tensors start as NaN and any NaN left after
``init_fn`` is refused; other dtypes (and every buffer) are initialised twice from two different
fills and must come out equal. A module the init does not cover (no ``reset_parameters``, not
an HF module, e.g. a raw ``nn.Parameter`` in a custom module) is thus refused with its name.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable

import torch

from ragged._errors import RaggedValueError
from ragged.fsdp._placeholder import LOCK

__all__ = ["default_init", "materialize_unit", "materialize_buffers", "owner_seed"]


def owner_seed(seed: int, owner: str) -> int:
    """The generator seed of module ``owner`` (a module name) under ``seed``."""
    digest = hashlib.sha256(f"{int(seed)}:{owner}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _hf_models(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules()
            if callable(getattr(type(m), "_init_weights", None)) and hasattr(m, "config")}


def default_init(model: torch.nn.Module) -> Callable[[str, torch.nn.Module], None]:
    """The default ``init_fn`` of ``fsdp.init`` for ``model`` as ``fn(owner name, module copy)``:
    see [Note: initialising a meta module unit by unit]."""
    hf = _hf_models(model)

    def init(name: str, module: torch.nn.Module) -> None:
        parts = name.split(".") if name else []
        for k in range(len(parts), -1, -1):
            ancestor = hf.get(".".join(parts[:k]))
            if ancestor is not None:
                ancestor._init_weights(module)
                return
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    return init


def _empty(like: torch.Tensor, device, fill) -> torch.Tensor:
    t = torch.empty(tuple(like.shape), dtype=like.dtype, device=device)
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan") if fill == 0 else fill)
    return t.fill_(fill)


def _scratch(owner: torch.nn.Module, device, fill) -> torch.nn.Module:
    """A shallow copy of ``owner`` whose own parameters and buffers are new real tensors."""
    clone = copy.copy(owner)
    clone.__dict__["_parameters"] = {
        k: None if p is None else torch.nn.Parameter(
            _empty(p, device, fill) if p.is_meta else p.detach().to(device, copy=True), requires_grad=p.requires_grad)
        for k, p in owner._parameters.items()
    }
    clone.__dict__["_buffers"] = {
        k: None if b is None else _empty(b, device, fill) if b.is_meta else b.detach().to(device, copy=True)
        for k, b in owner._buffers.items()
    }
    return clone


def _run_init(init_fn, name: str, owner: torch.nn.Module, seed: int, device, fill) -> torch.nn.Module:
    clone = _scratch(owner, device, fill)
    device = torch.device(device)
    with LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        # simulated ranks are threads sharing the default generators: seed and draw under one lock
        torch.random.default_generator.manual_seed(owner_seed(seed, name))
        if device.type == "cuda":
            torch.cuda.manual_seed(owner_seed(seed, name))
        with torch.no_grad():
            init_fn(name, clone)
    return clone


def _describe(kind: str, full: str, name: str, owner: torch.nn.Module) -> str:
    return f"{kind} {full!r} (module {name or '<root>'!r}, {type(owner).__name__})"


def _read(kind: str, store: dict, key: str, like: torch.Tensor, full: str, name: str, owner) -> torch.Tensor:
    value = store.get(key)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(like.shape) or value.dtype != like.dtype:
        raise RaggedValueError(
            f"init_fn replaced {_describe(kind, full, name, owner)}: expected a tensor of shape {tuple(like.shape)} "
            f"and dtype {like.dtype}, got {type(value).__name__}"
            f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}. Fix: write values in place "
            "(torch.nn.init.*_, tensor.copy_), do not assign new tensors."
        )
    return value.detach()


def _unwritten_error(kind: str, full: str, name: str, owner, how: str) -> RaggedValueError:
    return RaggedValueError(
        f"{_describe(kind, full, name, owner)} was not initialised from meta: {how}. The default init calls "
        "module.reset_parameters() or, inside a Hugging Face model, its _init_weights(module); this module has "
        "neither, or they skip this tensor. Fix: pass fsdp.init(..., init_fn=fn), fn(module) filling every "
        "parameter and buffer the module itself holds (it is called on each module with its own tensors real), "
        "or build the model with real tensors."
    )


def _initialise(model, name: str, keys, kind: str, init_fn, seed: int, device) -> dict[str, torch.Tensor]:
    """``{key: value}`` of ``owner._parameters`` / ``_buffers`` entries ``keys`` after ``init_fn``."""
    owner = model.get_submodule(name) if name else model
    originals = getattr(owner, kind)
    prefix = f"{name}." if name else ""
    what = "parameter" if kind == "_parameters" else "buffer"
    first = getattr(_run_init(init_fn, name, owner, seed, device, 0), kind)
    out = {k: _read(what, first, k, originals[k], prefix + k, name, owner) for k in keys}
    twice = [k for k in keys if kind == "_buffers" or not (out[k].is_floating_point() or out[k].is_complex())]
    if twice:
        second = getattr(_run_init(init_fn, name, owner, seed, device, 1), kind)
        for k in twice:
            again = _read(what, second, k, originals[k], prefix + k, name, owner)
            if not torch.equal(out[k], again):
                raise _unwritten_error(what, prefix + k, name, owner,
                                       "two runs from different starting contents gave different values")
    for k in keys:
        v = out[k]
        if (v.is_floating_point() or v.is_complex()) and v.numel() and bool(torch.isnan(v).any()):
            left = int(torch.isnan(v).sum())
            raise _unwritten_error(what, prefix + k, name, owner, f"{left} of {v.numel()} elements were left unwritten")
    return out


def materialize_unit(model: torch.nn.Module, unit, init_fn, *, seed: int, device) -> dict[str, torch.Tensor]:
    """``{path: real tensor}`` for the parameters of ``unit`` (a unit of ``make_units(model)``):
    meta ones initialised per [Note: initialising a meta module unit by unit], real ones as they are."""
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    owners: dict[str, list[tuple[str, str]]] = {}
    for path in unit.paths:
        p = params[path]
        if not p.is_meta:
            out[path] = p.detach()
            continue
        owner, _, key = path.rpartition(".")
        owners.setdefault(owner, []).append((path, key))
    for owner, items in owners.items():
        values = _initialise(model, owner, [k for _, k in items], "_parameters", init_fn, seed, device)
        for path, key in items:
            out[path] = values[key]
    return out


def materialize_buffers(model: torch.nn.Module, init_fn, *, seed: int, device) -> dict[str, dict[str, torch.Tensor]]:
    """``{module name: {buffer key: real tensor}}`` for every meta buffer of ``model``."""
    out = {}
    for name, module in model.named_modules():
        keys = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if keys:
            out[name] = _initialise(model, name, keys, "_buffers", init_fn, seed, device)
    return out
