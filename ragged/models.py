"""Bundled model shapes (Llama-3-70B, GPT-OSS-120B, DeepSeek-V3-671B) and user shapes JSON,
as per-FSDP-unit trees of meta tensors. See ``ragged._models`` for the JSON format."""

from ragged._models import MODELS as MODELS
from ragged._models import ModelUnit as ModelUnit
from ragged._models import expand_names as expand_names
from ragged._models import model_shapes as model_shapes
from ragged._models import model_units as model_units
from ragged._models import unit_numel as unit_numel
