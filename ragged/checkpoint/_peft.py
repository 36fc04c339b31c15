"""A PEFT model out of ``fsdp.save_pretrained``: the adapter directory peft writes, or the merged model.

[Note: saving a PEFT model]
A ``peft.PeftModel``'s parameter names (``base_model.model.model.layers.0.self_attn.q_proj.
base_layer.weight``, ``...q_proj.lora_A.default.weight``) are no Hugging Face architecture's:
written as a model directory, ``from_pretrained`` would find none of its weights and initialise
every one at random. So ``save_pretrained(..., module=peft_model)`` writes one of the two
directories PEFT users load:

* by default the **adapter directory**, ``adapter_config.json`` and ``adapter_model.safetensors``
  (a subdirectory per adapter other than ``"default"``), for ``PeftModel.from_pretrained(base,
  path)``. Which tensors it holds, and under which names, is peft's own choice: its
  ``get_peft_model_state_dict`` is asked over the module's names (no value read, on every
  rank), the ranks gather only those tensors to rank 0 (the adapters only, unless peft also
  keeps a frozen embedding), and rank 0 writes them with the module's ``save_pretrained(path,
  state_dict=...)``, so the files are peft's, byte for byte. A parameter that trained but that
  the adapter format does not hold (e.g. a norm unfrozen by hand) would be lost: it is refused,
  on every rank, before anything is gathered or written;
* with ``merged=True`` the **merged model**, a plain Hugging Face directory of the base
  architecture for ``AutoModelForCausalLM.from_pretrained(path)``: each LoRA ``nn.Linear``'s
  weight becomes ``W + transpose(B @ A, fan_in_fan_out) * scaling`` for every active adapter in
  order (and its bias ``b + B.bias * scaling`` with ``lora_bias``), computed as peft's
  ``merge_and_unload()`` computes it (the same operations in the same dtypes: A and B cast to
  fp32 for the product when they are bf16/fp16 on the CPU), so the files equal
  ``peft_model.merge_and_unload().state_dict()`` bit for bit; the adapters and the ``base_layer``
  level of the names go away. It is written unit by unit, as any model: a layer's A, B and weight
  must lie in one unit (a decoder layer holds all three). What peft merges otherwise (DoRA and
  other LoRA variants, LoRA on embeddings or convolutions, ``modules_to_save``, trainable tokens,
  other PEFT methods) is refused by name: write the adapter directory instead.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch

from ragged._errors import RaggedValueError
from ragged._optional import optional
from ragged.fsdp._export import export
from ragged.fsdp._placeholder import tied_names
from ragged.fsdp._units import Units

__all__ = ["is_peft", "save_adapters", "merge_plan", "check_architecture"]


def is_peft(module) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (peft is not imported when never used)."""
    return "peft" in sys.modules and isinstance(module, optional("peft", "PeftModel"))


def _adapter_keys(module) -> set[str]:
    """The module's state-dict keys (first names) whose tensors peft's adapter files hold."""
    get_peft_model_state_dict = optional("peft", "get_peft_model_state_dict")  # peft: only a PeftModel needs it
    everything = module.state_dict(keep_vars=True)  # keep_vars: placeholders are not read
    first = {}
    for k, v in everything.items():
        first.setdefault(id(v), k)
    keys = set()
    for name in module.peft_config:
        picked = get_peft_model_state_dict(module, state_dict=everything, adapter_name=name)
        made = [k for k, v in picked.items() if id(v) not in first]
        if made:
            raise RaggedValueError(
                f"save_pretrained: peft's adapter {name!r} computes {made[0]!r} instead of selecting a tensor of the "
                "model, which ragged cannot gather. Fix: save_pretrained(..., merged=True), or "
                "fsdp.export(units, shards, comm, module=model, trainable_only=True) and peft's own save.")
        keys.update(first[id(v)] for v in picked.values())
    return keys


def save_adapters(units: Units, shards, comm, path: str, module, dtype, agreed: Callable) -> None:
    """The adapter directory of ``module`` (a PeftModel): see [Note: saving a PEFT model]."""
    keys = _adapter_keys(module)
    trained = [p for u in units for p in u.trainable_paths]
    dropped = [p for p in trained if p not in keys]
    if dropped:
        raise RaggedValueError(
            f"save_pretrained: trained parameters that peft's adapter format does not hold would be lost: "
            f"{dropped[0]!r}" + (f" and {len(dropped) - 1} more" if len(dropped) > 1 else "")
            + ". Fix: save_pretrained(..., merged=True) (the whole model, these included), or fsdp.export(units, "
            "shards, comm, module=model, trainable_only=True) and a format of your own.")
    params = {p for u in units for p in u.paths}
    trainable_only = all(k in trained for k in keys & params)  # only the adapters: the base is never gathered
    full = export(units, shards, comm, module=module, device="cpu", dtype=dtype, trainable_only=trainable_only)
    writer = full is not None
    buffers = module.state_dict(keep_vars=True)

    def write():
        if writer:
            state = {k: full[k] if k in params else buffers[k].detach().to("cpu") for k in keys}
            module.save_pretrained(path, state_dict=state)

    agreed(write)  # raised on every rank if the write failed on one


class _Layer:
    """One LoRA ``nn.Linear`` to merge: its (renamed) weight and bias keys and its adapters."""

    __slots__ = ("weight", "bias", "adapters")

    def __init__(self, weight, bias, adapters):
        self.weight, self.bias, self.adapters = weight, bias, adapters


def _refuse(name: str, what: str) -> RaggedValueError:
    return RaggedValueError(
        f"save_pretrained(..., merged=True): {name!r} is {what}, which ragged does not merge. Fix: write the adapter "
        "directory (merged=False, the default) and merge after loading it with peft (merge_and_unload()).")


def _lora_layer(name: str, m, lora_linear) -> list[tuple]:
    """``[(A key, B key, scaling, fan_in_fan_out, lora B bias key or None)]`` of the adapters
    peft's ``merge_and_unload`` merges into layer ``m`` (named ``name``)."""
    if type(m) is not lora_linear:
        raise _refuse(name, f"a {type(m).__module__}.{type(m).__name__}")
    out = []
    for a in m.active_adapters:
        if a not in m.lora_A or a in m.merged_adapters:
            continue
        if a in m.lora_variant:
            raise _refuse(name, f"a {type(m.lora_variant[a]).__name__} adapter ({a!r})")
        bias = f"{name}.lora_B.{a}.bias" if m.lora_bias[a] else None
        out.append((f"{name}.lora_A.{a}.weight", f"{name}.lora_B.{a}.weight", m.scaling[a], m.fan_in_fan_out, bias))
    return out


def merge_plan(units: Units, module):
    """``(rename, merge)`` for the merged model of ``module`` (a PeftModel, see [Note: saving a
    PEFT model]): ``rename(key)`` is the base architecture's name of a state-dict key (``None``
    for an adapter's), ``merge(unit, gathered, dtype)`` the unit's tensors to write under those
    names. Every refusal is raised here, on every rank, before anything is gathered."""
    # peft is no dependency: only a PeftModel being saved needs it
    LoraLinear = optional("peft.tuners.lora.layer", "Linear")  # noqa: N806 - a class
    BaseTunerLayer = optional("peft.tuners.tuners_utils", "BaseTunerLayer")  # noqa: N806
    PeftType = optional("peft.utils", "PeftType")  # noqa: N806
    AuxiliaryTrainingWrapper = optional("peft.utils.other", "AuxiliaryTrainingWrapper")  # noqa: N806

    kinds = {str(c.peft_type) for c in module.peft_config.values() if c.peft_type != PeftType.LORA}
    if kinds:
        raise _refuse(type(module).__name__, f"a {'/'.join(sorted(kinds))} model")
    base = module.get_base_model()
    prefix = next(n for n, m in module.named_modules() if m is base) + "."
    unit_of = {p: u.name for u in units for p in u.paths}
    layers: dict[str, _Layer] = {}
    dropped: list[str] = []
    for name, m in module.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper):
            raise _refuse(name, f"a {type(m).__name__} (modules_to_save / trainable tokens)")
        if not isinstance(m, BaseTunerLayer):
            continue
        adapters = _lora_layer(name, m, LoraLinear)
        weight = f"{name}.base_layer.weight"
        bias = f"{name}.base_layer.bias" if any(a[4] for a in adapters) else None
        keys = [weight] + ([bias] if bias else []) + [k for a in adapters for k in (a[0], a[1], a[4]) if k]
        if bias and bias not in unit_of:
            raise _refuse(name, "a LoRA layer with lora_bias=True whose base layer has no bias (peft cannot merge it)")
        held = {unit_of.get(k) for k in keys}
        if None in held or len(held) > 1:
            raise RaggedValueError(
                f"save_pretrained(..., merged=True): the LoRA layer {name!r} needs its weight and adapters in one "
                f"unit, but they lie in units {sorted(map(str, held))}. Fix: make_units with a grouping that keeps "
                "each module whole (the default keeps every decoder layer whole).")
        layers[weight] = _Layer(weight, bias, adapters)
        dropped.append(f"{name}.lora_")

    def rename(key: str) -> str | None:
        if any(key.startswith(d) for d in dropped):
            return None
        if not key.startswith(prefix):
            raise RaggedValueError(f"save_pretrained(..., merged=True): {key!r} is outside the base model "
                                   f"({prefix[:-1]!r}); ragged does not know where peft puts it.")
        return key[len(prefix):].replace(".base_layer.", ".")

    for key in module.state_dict(keep_vars=True):  # every refusal before any gather
        rename(key)

    def merge(unit, full: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
        out = {}
        for p in unit.paths:
            new = rename(p)
            if new is None:
                continue
            value = full[p]
            layer = layers.get(p)
            if layer is not None:
                value = _merged(layer, full)
            elif getattr(layers.get(p[: -len("bias")] + "weight"), "bias", None) == p:
                value = _merged_bias(layers[p[: -len("bias")] + "weight"], full)
            out[new] = value if dtype is None else value.to(dtype)
        return out

    return rename, merge


def _delta(a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> torch.Tensor:
    """peft's ``get_delta_weight`` of ``lora.Linear``, the same operations in the same dtypes."""
    low = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    product = b.float() @ a.float() if low else b @ a
    delta = (product.T if fan_in_fan_out else product) * scaling
    return delta.to(b.dtype) if low else delta


def _merged(layer: _Layer, full) -> torch.Tensor:
    weight = full[layer.weight].clone()
    for a, b, scaling, fan_in_fan_out, _ in layer.adapters:
        weight += _delta(full[a], full[b], scaling, fan_in_fan_out)
    return weight


def _merged_bias(layer: _Layer, full) -> torch.Tensor:
    bias = full[layer.bias].clone()
    for _, _, scaling, _, lora_bias in layer.adapters:
        if lora_bias is not None:
            bias += full[lora_bias] * scaling
    return bias


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
