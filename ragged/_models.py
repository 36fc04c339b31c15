"""Parameter shapes of real models as per-FSDP-unit meta-tensor trees (no memory, no downloads).

[Note: the shapes format]
The JSON format of a model's shapes is documented once, in the public module
:mod:`ragged.models` (its docstring is what ``help(ragged.models)`` shows and what
tests/spec/test_models.py loads as an example).

The three bundled models (:data:`MODELS`) are built from ``ragged/data/model_shapes.json``
(HuggingFace names; one dense and one MoE layer example for DeepSeek-V3, whose layers 0-2
are dense and 3-60 MoE; the multi-token-prediction layer is left out).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
from importlib import resources
from typing import Any, NamedTuple

import torch

from ragged._errors import RaggedValueError, check_int, is_sizes
from ragged._pytree import pytree

__all__ = ["MODELS", "ModelUnit", "model_shapes", "model_units", "expand_names"]

#: Bundled model names.
MODELS = ("llama3-70b", "gpt-oss-120b", "deepseek-v3-671b")
_BUNDLED_KEYS = {"llama3-70b": "llama3_70b", "gpt-oss-120b": "gpt_oss_120b", "deepseek-v3-671b": "deepseek_v3_671b"}
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


class ModelUnit(NamedTuple):
    """One FSDP unit: a name (``"layers.3"``), a kind (``"moe_layer"``) and a dict of meta
    tensors keyed by parameter name (for merged units: a dict of such dicts, one per layer).

    Examples:
        >>> from ragged.models import model_units
        >>> unit = model_units("llama3-70b")[1]
        >>> unit.name, unit.kind, len(unit.params)
        ('layers.0', 'layer', 9)
    """

    name: str
    kind: str
    params: dict


def expand_names(name: str) -> list[str]:
    """Expands every ``{a..b}`` range in ``name`` (inclusive; a product over several).

    Examples:
        >>> expand_names("experts.{0..2}.w")
        ['experts.0.w', 'experts.1.w', 'experts.2.w']
        >>> expand_names("l{0..1}.e{5..6}")
        ['l0.e5', 'l0.e6', 'l1.e5', 'l1.e6']
        >>> expand_names("norm.weight")
        ['norm.weight']
    """
    ranges = [(int(a), int(b)) for a, b in _RANGE.findall(name)]
    if not ranges:
        return [name]
    for a, b in ranges:
        if b < a:
            raise RaggedValueError(f"range {{{a}..{b}}} in {name!r} is empty; write {{low..high}} with low <= high.")
    parts = _RANGE.split(name)[::3]  # text between ranges
    return ["".join(p + str(c) for p, c in zip(parts, combo)) + parts[-1]
            for combo in itertools.product(*(range(a, b + 1) for a, b in ranges))]


@functools.lru_cache(maxsize=1)
def _bundled() -> dict:
    with resources.files("ragged").joinpath("data/model_shapes.json").open() as f:
        return json.load(f)


def _bundled_model(model: str) -> dict:
    raw = _bundled()[_BUNDLED_KEYS[model]]
    cfg = raw["config"]
    nl = raw["non_layer_params"]
    embed = {"name": "embed", "kind": "embed", "params": {"model.embed_tokens.weight": nl["model.embed_tokens.weight"]}}
    head = {
        "name": "head",
        "kind": "head",
        "params": {"model.norm.weight": nl["model.norm.weight"], "lm_head.weight": nl["lm_head.weight"]},
    }
    n = cfg["num_hidden_layers"]
    if model == "deepseek-v3-671b":
        k = cfg["first_k_dense_replace"]
        layers = [
            {"name": f"layers.{{0..{k - 1}}}", "kind": "dense_layer", "params": raw["dense_layer_example"]["params"]},
            {"name": f"layers.{{{k}..{n - 1}}}", "kind": "moe_layer", "params": raw["moe_layer_example"]["params_compact"]},
        ]
    else:
        kind = "moe_layer" if model == "gpt-oss-120b" else "layer"
        layers = [{"name": f"layers.{{0..{n - 1}}}", "kind": kind, "params": raw["layer_example"]["params"]}]
    return {"name": model, "units": [embed, *layers, head], "config": cfg}


def model_shapes(model: str | os.PathLike | dict) -> dict:
    """The shapes description (see [Note: the shapes format]) of a bundled model, a JSON
    file, or an already-loaded dict (validated).

    Raises:
        ValueError: unknown model name, or a malformed description (the message names the
            unit / parameter and the expected form).

    Examples:
        >>> spec = model_shapes("deepseek-v3-671b")
        >>> [(u["name"], u["kind"]) for u in spec["units"]]
        [('embed', 'embed'), ('layers.{0..2}', 'dense_layer'), ('layers.{3..60}', 'moe_layer'), ('head', 'head')]
    """
    if isinstance(model, dict):
        desc = model
    elif isinstance(model, str) and model in MODELS:
        desc = _bundled_model(model)
    else:
        path = os.fspath(model)
        if not os.path.exists(path):
            raise RaggedValueError(
                f"model {str(model)!r} is neither a bundled model {MODELS} nor an existing JSON file. "
                "Fix: pass one of the bundled names, or a path to a shapes JSON (see ragged.models docs)."
            )
        with open(path) as f:
            desc = json.load(f)
    _validate(desc)
    return desc


def _validate(desc: Any) -> None:
    form = 'Expected {"units": [{"name": str, "kind": str, "params": {name: [int, ...]}}, ...]}.'
    if not isinstance(desc, dict) or not isinstance(desc.get("units"), list) or not desc["units"]:
        raise RaggedValueError(f"a shapes description must be an object with a non-empty 'units' list. {form}")
    if not isinstance(desc.get("config", {}), dict):
        raise RaggedValueError(f"'config' must be an object (e.g. {{\"num_experts_per_tok\": 8}}), got {desc['config']!r}.")
    for i, unit in enumerate(desc["units"]):
        where = f"units[{i}]"
        if not isinstance(unit, dict) or not isinstance(unit.get("name"), str) or not isinstance(unit.get("params"), dict):
            raise RaggedValueError(f"{where} must be an object with a string 'name' and a 'params' object. {form}")
        if not unit["params"]:
            raise RaggedValueError(f"{where} ({unit['name']!r}) has no params; every FSDP unit needs at least one tensor.")
        for name, shape in unit["params"].items():
            if not isinstance(shape, list) or not is_sizes(shape):
                raise RaggedValueError(
                    f"{where} ({unit['name']!r}) params[{name!r}] is {shape!r}; a shape is a list of "
                    "non-negative ints, e.g. [4096, 1024] ([] for a scalar)."
                )


@functools.lru_cache(maxsize=256)
def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # One meta tensor per (shape, dtype), shared by every leaf of that shape: planning reads
    # only .shape and .dtype, so a 671B model costs a few dozen tensor objects.
    return torch.empty(shape, dtype=dtype, device="meta")


def _unit_params(params: dict, dtype: torch.dtype) -> dict:
    return {full: _meta(tuple(shape), dtype) for name, shape in params.items() for full in expand_names(name)}


def model_units(
    model: str | os.PathLike | dict = "llama3-70b",
    *,
    dtype: torch.dtype = torch.bfloat16,
    layers_per_unit: int = 1,
) -> list[ModelUnit]:
    """Every FSDP unit of a model as a tree of meta tensors.

    Args:
        model: a bundled name (:data:`MODELS`), a path to a shapes JSON, or a loaded dict (see
            [Note: the shapes format] in this module).
        dtype: dtype of every meta tensor (one buffer has one dtype).
        layers_per_unit: merge this many consecutive repeated units (decoder layers) into one
            unit; a merged unit's params are ``{layer_name: {param: tensor}}``. The last unit
            may hold fewer layers.

    Returns:
        The units in model order. Identical shapes share one meta tensor object.

    Examples:
        >>> units = model_units("deepseek-v3-671b")
        >>> len(units), units[3].name, units[3].kind, len(units[3].params)
        (63, 'layers.2', 'dense_layer', 12)
        >>> units[4].kind, len(units[4].params)
        ('moe_layer', 782)
        >>> sum(t.numel() for u in units for t in u.params.values())
        671026419200
        >>> [u.name for u in model_units("llama3-70b", layers_per_unit=40)]
        ['embed', 'layers.0-39', 'layers.40-79', 'head']
    """
    check_int("layers_per_unit", layers_per_unit)
    desc = model_shapes(model)
    units: list[ModelUnit | list] = []
    pending: list[ModelUnit] = []

    def flush():
        for k in range(0, len(pending), layers_per_unit):
            group = pending[k : k + layers_per_unit]
            if len(group) == 1:
                units.append(group[0])
                continue
            first, last = group[0].name, group[-1].name
            prefix = os.path.commonprefix([first, last])
            name = f"{first}-{last[prefix.rfind('.') + 1:]}"  # "layers.0-39": the common dotted prefix once
            kind = "+".join(dict.fromkeys(u.kind for u in group)) + f" x{len(group)}"
            units.append(ModelUnit(name, kind, {u.name: u.params for u in group}))
        pending.clear()

    for entry in desc["units"]:
        params = _unit_params(entry["params"], dtype)
        names = expand_names(entry["name"])
        kind = entry.get("kind", entry["name"])
        if len(names) == 1 and not _RANGE.search(entry["name"]):
            flush()
            units.append(ModelUnit(entry["name"], kind, params))
        else:
            pending.extend(ModelUnit(n, kind, params) for n in names)
    flush()
    return units


def unit_numel(unit: ModelUnit) -> int:
    """Elements of one unit.

    Args:
        unit: a :class:`ModelUnit` (from :func:`model_units`).

    Examples:
        >>> from ragged.models import model_units, unit_numel
        >>> units = model_units("llama3-70b")
        >>> round(sum(unit_numel(u) for u in units) / 1e9, 1)   # parameters, in billions
        70.6
    """
    return sum(math.prod(t.shape) for t in pytree.leaves(unit.params))
