"""Bundled model shapes (Llama-3-70B, GPT-OSS-120B, DeepSeek-V3-671B) and your own shapes
JSON, as per-FSDP-unit trees of meta tensors (no memory, no downloads).

Examples:
    >>> from ragged.models import model_units
    >>> units = model_units("gpt-oss-120b")          # embed, 36 MoE decoder layers, head
    >>> units[1].name, units[1].kind, units[1].params["mlp.experts.down_proj"].shape
    ('layers.0', 'moe_layer', torch.Size([128, 2880, 2880]))

Shapes format (``python -m ragged plan --shapes my.json``, or ``model_units(path)``):
A model is a JSON object with a ``"units"`` list; each unit is one FSDP unit (one shared
communication buffer)::

    {
      "name": "my-moe",
      "units": [
        {"name": "embed", "kind": "embed", "params": {"embed_tokens.weight": [32000, 4096]}},
        {"name": "layers.{0..1}", "kind": "dense_layer",
         "params": {"attn.qkv.weight": [12288, 4096], "mlp.up.weight": [11008, 4096]}},
        {"name": "layers.{2..31}", "kind": "moe_layer",
         "params": {"attn.qkv.weight": [12288, 4096], "experts.{0..7}.w1.weight": [1408, 4096]}},
        {"name": "head", "kind": "head", "params": {"norm.weight": [4096], "lm_head.weight": [32000, 4096]}}
      ],
      "config": {"num_experts_per_tok": 2}
    }

* ``params`` maps parameter names to shapes (lists of ints, ``[]`` for a scalar).
* ``{a..b}`` (inclusive) in a *parameter* name expands into one tensor per index
  (``experts.{0..255}.w1.weight`` is 256 tensors); several ranges expand as a product.
* ``{a..b}`` in a *unit* name repeats the unit once per index (``layers.{0..79}`` is 80
  decoder layers). Repeated units are the ones ``layers_per_unit`` may merge: ``k``
  consecutive repeated units (in list order, across entries) become one unit.
* ``kind`` labels units whose shapes are identical (tables group by it). For ``plan --predict``'s
  flops and activations, ``"embed"`` marks the embedding (a lookup: no flops; its ``[vocab, hidden]``
  matrix gives the hidden and vocabulary sizes) and ``"head"`` the output layer (its logits).
* ``config`` (optional) holds the model's hyperparameters in HuggingFace's names; ``plan --predict``
  reads ``num_experts_per_tok`` when a unit has routed experts (parameters under a ``experts.``
  name part: ``experts.{0..7}.w1.weight``, or stacked ``experts.w1`` of shape ``[experts, ...]``).
  The bundled models carry their HuggingFace config.
"""

from ragged._models import MODELS as MODELS
from ragged._models import ModelUnit as ModelUnit
from ragged._models import expand_names as expand_names
from ragged._models import model_shapes as model_shapes
from ragged._models import model_units as model_units
from ragged._models import unit_numel as unit_numel
