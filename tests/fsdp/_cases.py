"""Shared cases for the FSDP step tests (simulated backend and gloo workers).

``fsdp_run(comm, case)`` trains a tiny GPT with ``rg.fsdp`` on this rank's rows of every global
batch; ``reference_run(case)`` trains the same model unsharded in one process with
``torch.optim.AdamW`` on the whole global batch. Both return ``{name: tensor}`` parameters.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import ragged as rg
from ragged import fsdp
from ragged.examples.data import SyntheticLM, rank_slice
from ragged.examples.gpt import GPT, GPTConfig, loss_fn


@dataclasses.dataclass(frozen=True)
class Case:
    moe: bool = False
    steps: int = 3
    batch: int = 8  # global
    micro_batches: int = 1
    lr: float = 1e-2
    weight_decay: float = 0.1
    dtype: torch.dtype = torch.float64
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    prefetch: bool = True
    reshard_after_forward: bool = True
    num_layers: int = 3
    seed: int = 0
    optimizer: str = "adamw"  # or "sgd"
    donate: bool = False
    max_inflight_reduce: int = 1
    replicate_vectors: bool = False  # spec.Replicate() for every 1-D parameter (norms, biases)
    activation_checkpointing: bool = False  # examples.gpt.loss_fn(checkpoint=True): blocks recomputed in backward
    max_buffers: int | str = 1  # make_units(max_buffers=...)
    split_buffers: bool = False  # every unit one buffer per granule (rg.testing.with_buffers), whatever the padding
    frozen: tuple[str, ...] = ()  # parameters whose name starts with one of these get requires_grad=False
    chunks: int | None = None  # make_step(chunks=...), each rank's rows from fsdp.local_chunks

    def make_optimizer(self):
        if self.optimizer == "sgd":
            return rg.optim.sgd(self.lr, donate=self.donate)
        return rg.optim.adamw(self.lr, weight_decay=self.weight_decay, donate=self.donate)

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=64, dim=32, num_layers=self.num_layers, num_heads=4, ffn_dim=48,
                         max_seq_len=16, num_experts=4 if self.moe else 0)

    def model(self) -> GPT:
        model = GPT(self.config())
        # an explicit generator: simulated ranks are threads, the global RNG is shared between them
        model.reset_parameters(torch.Generator().manual_seed(self.seed))
        model = model.to(self.dtype)
        for name, p in model.named_parameters():
            if name.startswith(self.frozen):
                p.requires_grad_(False)
        return model

    def task(self) -> SyntheticLM:
        return SyntheticLM(64, 16, seed=self.seed + 1)


def fsdp_run(comm, case: Case, *, trace: bool = False, save: str | None = None):
    """Returns (full params after training, list of per-step metrics); ``save``: a checkpoint
    directory the final state is saved to."""
    model = case.model()
    specs = (lambda path, t: rg.spec.Replicate() if t.dim() == 1 else None) if case.replicate_vectors else None
    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs, max_buffers=case.max_buffers)
    if case.split_buffers:
        assert not case.frozen, "with_buffers would mix a unit's trainable and frozen buffers"
        units = units.replace(units=tuple(u.replace(plan=rg.testing.with_buffers(u.plan)) for u in units))
    opt = case.make_optimizer()
    state = fsdp.init(units, model, opt, comm)
    loss = loss_fn(copy.deepcopy(model), checkpoint=case.activation_checkpointing)
    step = fsdp.make_step(units, loss, opt, comm, micro_batches=None if case.chunks else case.micro_batches,
                          policy=fsdp.MixedPrecision(compute_dtype=case.compute_dtype, reduce_dtype=case.reduce_dtype),
                          prefetch=case.prefetch,
                          reshard_after_forward=case.reshard_after_forward, trace=trace, donate=case.donate,
                          max_inflight_reduce=case.max_inflight_reduce, chunks=case.chunks)
    task, metrics = case.task(), []
    replicas = getattr(comm, "num_replicas", 1)  # HSDP: replica-major data-parallel index
    index, total = getattr(comm, "replica_rank", 0) * comm.world_size + comm.rank, comm.world_size * replicas
    for s in range(case.steps):
        batch = task.batch(s, case.batch)
        batch = fsdp.local_chunks(batch, case.chunks, comm) if case.chunks else rank_slice(batch, index, total)
        state, m = step(state, batch)
        metrics.append(m)
    if save is not None:
        rg.checkpoint.save(save, state, comm)
    full = rg.gather(units, state.shards, comm)
    return {k: v.clone() for k, v in full.items()}, metrics


def reference_run(case: Case):
    """Unsharded single-process torch.optim.AdamW on the global batch: (params, losses)."""
    model = case.model()
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=case.weight_decay)
    task, losses, fn = case.task(), [], loss_fn(model)
    for s in range(case.steps):
        opt.zero_grad()
        loss = fn(dict(model.named_parameters()), task.batch(s, case.batch))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.named_parameters()}, losses


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    diffs = {k: (a[k].double() - b[k].double()).abs().max().item() for k in b}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


# ---- real-model cases: a ModuleList-expert MoE with experts idle on some ranks, Hugging Face models ----

class Expert(torch.nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.w_in = torch.nn.Linear(dim, ffn, bias=False)
        self.w_out = torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.w_out(torch.nn.functional.silu(self.w_in(x)))


class HashMoE(torch.nn.Module):
    """Experts as a ModuleList of separate MLPs; token ``t`` goes to expert ``t % num_experts``
    (weighted by a learnt softmax gate), so which experts run is decided by the data: an expert
    without tokens on a rank is never called there."""

    def __init__(self, dim: int, ffn: int, num_experts: int):
        super().__init__()
        self.router = torch.nn.Linear(dim, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(Expert(dim, ffn) for _ in range(num_experts))

    def forward(self, x, tokens):
        flat, choice = x.reshape(-1, x.shape[-1]), tokens.reshape(-1) % len(self.experts)
        gate = torch.softmax(self.router(flat), dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            (idx,) = torch.nonzero(choice == e, as_tuple=True)
            if idx.numel():
                out = out.index_add(0, idx, expert(flat[idx]) * gate[idx, e : e + 1])
        return out.view_as(x)


class MoEBlock(torch.nn.Module):
    def __init__(self, dim, ffn, num_experts, checkpoint: bool):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.moe = HashMoE(dim, ffn, num_experts)
        self.checkpoint, self.calls = checkpoint, 0

    def _forward(self, h, tokens):
        self.calls += 1  # counts recomputation too
        return h + self.moe(self.norm(h), tokens)

    def forward(self, h, tokens):
        if self.checkpoint:  # activation checkpointing inside the module's forward
            return torch.utils.checkpoint.checkpoint(self._forward, h, tokens, use_reentrant=False)
        return self._forward(h, tokens)


class TinyMoE(torch.nn.Module):
    def __init__(self, vocab=16, dim=8, ffn=12, layers=2, num_experts=4, checkpoint=False):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(MoEBlock(dim, ffn, num_experts, checkpoint) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_emb(tokens)
        for layer in self.layers:
            h = layer(h, tokens)
        return self.head(h)


def tiny_moe(checkpoint=False, seed=0):
    torch.manual_seed(seed)
    return TinyMoE(checkpoint=checkpoint).to(torch.float64)


def moe_batches(steps=3, rows=2, seq=8):
    """Per step ``(tokens, targets)`` of 2 ranks x ``rows`` rows: rank 0's tokens route to experts
    0 and 1, rank 1's to experts 1 and 2 (token % 4); expert 3 gets no token anywhere."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        r0 = torch.tensor([0, 1])[torch.randint(0, 2, (rows, seq), generator=g)] + 4 * torch.randint(0, 4, (rows, seq), generator=g)
        r1 = torch.tensor([1, 2])[torch.randint(0, 2, (rows, seq), generator=g)] + 4 * torch.randint(0, 4, (rows, seq), generator=g)
        out.append((torch.cat([r0, r1]), torch.randint(0, 16, (2 * rows, seq), generator=g)))
    return out


def cross_entropy(logits, targets):
    """float64 all the way (Hugging Face's ``labels=`` loss upcasts to fp32)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def hf_model(kind: str, *, tied=False, checkpointing=None):
    """A tiny random-init Hugging Face causal LM in float64 (nothing downloaded): ``"llama"``,
    ``"mixtral"`` (experts fused in 3-D parameters, eager kernels); ``checkpointing``: None, or
    the ``use_reentrant`` value for ``gradient_checkpointing_enable``."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM._from_config(cfg, experts_implementation="eager")
    model = model.to(torch.float64)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    return model.train()


def lm_batches(steps=3, rows=2, seq=12, vocab=64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (2 * rows, seq), generator=g), torch.randint(0, vocab, (2 * rows, seq), generator=g))
            for _ in range(steps)]


def logits_of(model, tokens, params=None):
    """``model``'s logits on ``tokens``; with ``params`` through ``torch.func.functional_call``."""
    hf = hasattr(model, "config")
    args, kwargs = ((), {"input_ids": tokens}) if hf else ((tokens,), {})
    out = model(*args, **kwargs) if params is None else torch.func.functional_call(model, params, args, kwargs)
    return out.logits if hf else out


def train_sharded(comm, model, batches, *, groups=None, module=True, lr=1e-2, weight_decay=0.1, broadcast_from=None,
                  **step_kw):
    """AdamW through ``rg.fsdp.make_step`` on this rank's rows of every batch (``model``: this
    rank's own copy). ``module=True`` binds the model (``loss_fn`` calls ``model(...)``), else
    the loss runs it through ``functional_call``. Returns (full params, per-step metrics)."""
    units = fsdp.make_units(model, world_size=comm.world_size, groups=groups)
    opt = rg.optim.adamw(lr, weight_decay=weight_decay)
    state = fsdp.init(units, model, opt, comm, broadcast_from=broadcast_from)
    if module:
        loss = lambda params, batch: cross_entropy(logits_of(model, batch[0]), batch[1])  # noqa: E731
    else:
        loss = lambda params, batch: cross_entropy(logits_of(model, batch[0], params), batch[1])  # noqa: E731
    step = fsdp.make_step(units, loss, opt, comm, module=model if module else None, **step_kw)
    metrics = []
    for batch in batches:
        state, m = step(state, rank_slice(batch, comm.rank, comm.world_size))
        metrics.append(m)
    return {k: v.clone() for k, v in rg.gather(units, state.shards, comm).items()}, metrics


def train_reference(model, batches, *, lr=1e-2, weight_decay=0.1):
    """Single-process torch.optim.AdamW on every whole batch: {name: tensor}."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for tokens, targets in batches:
        opt.zero_grad()
        cross_entropy(logits_of(model, tokens), targets).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}
