"""A small decoder-only GPT: RMSNorm, causal SDPA, gated SiLU MLP; dense or MoE.

Plain ``nn.Module`` code with nothing FSDP-specific in it: :mod:`ragged.fsdp` runs it through
``torch.func.functional_call`` and splits it into units (each block, plus the rest).

The MoE variant replaces the MLP of every ``moe_every``-th block with ``num_experts`` experts
whose weights are fused in one 3-D parameter per projection, routed top-``top_k``.

Examples:
    >>> import torch
    >>> from ragged.examples.gpt import GPT, GPTConfig
    >>> cfg = GPTConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=48, max_seq_len=16,
    ...                 num_experts=4, moe_every=2)
    >>> model = GPT(cfg)
    >>> tokens = torch.randint(0, 64, (3, 16))
    >>> model(tokens).shape
    torch.Size([3, 16, 64])
    >>> tuple(model.blocks[1].mlp.w_gate.shape)
    (4, 32, 48)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ragged._errors import RaggedValueError

__all__ = ["GPTConfig", "GPT", "Block", "Attention", "MLP", "MoE", "loss_fn"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Model hyper-parameters.

    Attributes:
        vocab_size, dim, num_layers, num_heads, ffn_dim, max_seq_len: the usual sizes.
        num_experts: experts per MoE block; 0 means a dense model.
        moe_every: every ``moe_every``-th block (1-based: blocks moe_every-1, 2*moe_every-1, ...)
            is an MoE block when ``num_experts > 0``.
        top_k: experts per token.
        init_std: std of the normal initialisation of weight matrices.
    """

    vocab_size: int = 256
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 352
    max_seq_len: int = 128
    num_experts: int = 0
    moe_every: int = 2
    top_k: int = 2
    init_std: float = 0.02

    replace = dataclasses.replace

    def is_moe_block(self, index: int) -> bool:
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.dim % cfg.num_heads:
            raise RaggedValueError(f"dim ({cfg.dim}) must be a multiple of num_heads ({cfg.num_heads}).")
        self.num_heads = cfg.num_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.num_heads

        def heads(y):
            return y.view(b, t, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Gated SiLU MLP: ``w_down(silu(w_gate x) * w_up x)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    """Top-k routed gated-SiLU experts, each projection fused in one 3-D parameter
    (``w_gate``/``w_up``: experts x dim x ffn, ``w_down``: experts x ffn x dim)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        e, d, f = cfg.num_experts, cfg.dim, cfg.ffn_dim
        self.top_k = cfg.top_k
        self.router = nn.Linear(d, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, d, f))
        self.w_up = nn.Parameter(torch.empty(e, d, f))
        self.w_down = nn.Parameter(torch.empty(e, f, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.w_gate.shape[0]):
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            if token.numel() == 0:
                continue
            xe = x[token]
            ye = (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
            out = out.index_add(0, token, ye * weights[token, slot, None])
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, index: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = MoE(cfg) if cfg.is_moe_block(index) else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token + learned position embeddings, ``num_layers`` blocks, final RMSNorm, untied head."""

    def __init__(self, cfg: GPTConfig, *, device=None):
        super().__init__()
        self.cfg = cfg
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
            self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
            self.norm = nn.RMSNorm(cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) weights (output projections scaled by 1/sqrt(2 * layers)), unit norms."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            s = std / math.sqrt(2 * self.cfg.num_layers) if name.endswith(("wo.weight", "w_down.weight", "w_down")) else std
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * s)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise RaggedValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}.")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model: nn.Module, *, checkpoint: bool = False):
    """``loss(params, batch)``: mean next-token cross entropy of ``model`` run with ``params``
    through ``torch.func.functional_call``; ``batch = (inputs, targets)`` of token ids.

    ``checkpoint=True``: activation checkpointing of every block (``torch.utils.checkpoint``,
    non-reentrant), with the block's parameters passed to the checkpointed function as inputs, so
    that the recomputation in backward reads ``params`` (under ``rg.fsdp``: the step's gathered
    units), not the module's own tensors (which ``functional_call`` has restored by then).

    Examples:
        >>> import torch
        >>> cfg = GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, ffn_dim=24, max_seq_len=8)
        >>> model = GPT(cfg)
        >>> batch = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
        >>> params = dict(model.named_parameters())
        >>> torch.allclose(loss_fn(model)(params, batch), loss_fn(model, checkpoint=True)(params, batch))
        True
    """

    def loss(params, batch):
        inputs, targets = batch
        if checkpoint:
            logits = _checkpointed_forward(model, params, inputs)
        else:
            logits = torch.func.functional_call(model, params, (inputs,))
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return loss


def _checkpointed_forward(model: GPT, params, tokens: torch.Tensor) -> torch.Tensor:
    """``GPT.forward`` with each block under non-reentrant ``torch.utils.checkpoint``."""
    def sub(prefix):
        return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}

    def run_block(block_params, x, block):
        return torch.func.functional_call(block, block_params, (x,))

    t = tokens.shape[1]
    if t > model.cfg.max_seq_len:
        raise RaggedValueError(f"sequence length {t} exceeds max_seq_len={model.cfg.max_seq_len}.")
    call = torch.func.functional_call
    x = call(model.tok_emb, sub("tok_emb."), (tokens,)) + call(model.pos_emb, sub("pos_emb."), (torch.arange(t, device=tokens.device),))
    for i, block in enumerate(model.blocks):
        x = torch.utils.checkpoint.checkpoint(run_block, sub(f"blocks.{i}."), x, block, use_reentrant=False)
    return call(model.head, sub("head."), (call(model.norm, sub("norm."), (x,)),))
