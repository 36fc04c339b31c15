"""Tiny Hugging Face models saved by transformers itself (random init, nothing downloaded), for the
pretrained load / save tests."""

from __future__ import annotations

import contextlib
import os

import torch

KINDS = ("llama", "qwen2", "mixtral")
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)


def config(kind: str):
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**COMMON)
    if kind == "qwen2":  # q/k/v biases, tied embeddings (as Qwen2's small models)
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    return transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)


def build(kind: str, dtype=torch.float64, seed: int = 0):
    """A random model of ``kind`` in ``dtype`` (eager experts: float64 kernels)."""
    import transformers

    torch.manual_seed(seed)
    kw = {"experts_implementation": "eager"} if kind == "mixtral" else {}
    return transformers.AutoModelForCausalLM.from_config(config(kind), dtype=dtype, **kw)


def save(kind: str, dtype, sharded: bool, root: str) -> str:
    """``root/<kind>-<dtype>-<one|sharded>``, written by ``save_pretrained`` (>= 3 files when sharded)."""
    path = os.path.join(root, f"{kind}-{str(dtype).replace('torch.', '')}-{'sharded' if sharded else 'one'}")
    model = build(kind, torch.float32).to(dtype)
    model.save_pretrained(path, **({"max_shard_size": "8KB"} if sharded else {}))
    return path


def from_pretrained(path: str, kind: str, dtype=torch.float64):
    import transformers

    kw = {"experts_implementation": "eager"} if kind == "mixtral" else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)


@contextlib.contextmanager
def exact_norms():
    """Hugging Face's RMSNorms compute in float32 inside a float64 model: a 1e-16 difference
    upstream (another memory layout of the same float64 values, e.g. W=3) then flips a float32
    rounding, and after a few AdamW steps the parameters differ by ~1e-5. Inside this context the
    Llama / Qwen2 / Mixtral norms compute the same formula in the input dtype (restored on exit)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    classes = (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_mixtral.MixtralRMSNorm)
    saved = [c.forward for c in classes]
    for c in classes:
        c.forward = forward
    try:
        yield
    finally:
        for c, f in zip(classes, saved):
            c.forward = f
