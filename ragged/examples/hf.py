"""Hugging Face ``transformers`` models under ``rg.fsdp``, the whole path, from a config only
(random init, nothing downloaded).

``python -m ragged train --hf llama`` (or ``--hf mixtral``; sizes from ``--layers``, ``--dim``,
``--heads``, ``--ffn``, ``--vocab``, ``--seq``, ``--experts``, ``--top-k``) runs on every rank:

1. build on ``meta`` (no memory): ``with torch.device("meta"): model = LlamaForCausalLM(cfg)``;
2. ``units = fsdp.make_units(model, world_size=W)``: every decoder layer is a unit, the
   embeddings, final norm and head form ``"rest"``;
3. ``state = fsdp.init(units, model, opt, comm)``: each unit is materialised alone, initialised
   by HF's own ``_init_weights`` (seeded per module: equal on every rank and world size) and
   sharded; the rotary ``inv_freq`` buffers are computed; the module keeps placeholders. With
   ``--from-pretrained DIR`` the config comes from ``DIR/config.json`` and ``fsdp.init(units,
   rg.checkpoint.pretrained(DIR), opt, comm, module=model)`` reads each rank's own byte ranges;
4. ``fsdp.make_step(units, loss_fn(model), opt, comm)``, a few steps on the synthetic task of
   ``ragged.examples.data``;
5. ``fsdp.save_pretrained(units, state.shards, comm, path, module=model)`` (``--save-pretrained
   DIR``, default a temporary directory): one unit gathered at a time, one file per unit;
6. the check: rank 0 reloads it with ``from_pretrained(path)`` and compares it with
   ``fsdp.export(units, state.shards, comm, module=model, device="cpu")`` (the whole state dict).

``transformers`` is imported only when these functions run (through ``ragged._optional``: safe
from the threads of ``simulate``).

Examples:
    >>> import torch
    >>> from ragged.examples import hf
    >>> cfg = hf.config("llama", vocab_size=64, dim=32, layers=2, heads=4, ffn=48, seq=16)
    >>> model = hf.build(cfg)                      # on meta
    >>> model.lm_head.weight.is_meta, type(model).__name__
    (True, 'LlamaForCausalLM')
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ragged as rg
from ragged import fsdp
from ragged._console import console as make_console
from ragged._errors import RaggedValueError
from ragged._optional import optional
from ragged.examples._recipe import no_decay_types, optimizer, policy_for, specs_for
from ragged.examples._train_loop import announce, finish, job_checkpoints, resumed, run_steps, summarize
from ragged.examples.data import SyntheticLM

__all__ = ["KINDS", "config", "build", "loss_fn", "blocks", "train"]

KINDS = ("llama", "mixtral")


def config(kind: str, *, vocab_size: int, dim: int, layers: int, heads: int, ffn: int, seq: int,
           kv_heads: int | None = None, experts: int = 8, top_k: int = 2, tie: bool = False, **overrides):
    """A ``LlamaConfig`` or ``MixtralConfig`` of the given sizes (``**overrides`` go to the
    config, e.g. ``experts_implementation="eager"``, which float64 needs for Mixtral)."""
    common = dict(vocab_size=vocab_size, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads or heads, max_position_embeddings=seq,
                  tie_word_embeddings=tie)
    if kind == "llama":
        return optional("transformers", "LlamaConfig")(**common, **overrides)
    if kind == "mixtral":
        return optional("transformers", "MixtralConfig")(**common, num_local_experts=experts, num_experts_per_tok=top_k,
                                                         **overrides)
    raise RaggedValueError(f"unknown HF model kind {kind!r}; choose one of {KINDS}.")


def build(cfg, *, device="meta", dtype: torch.dtype | None = None):
    """``AutoModelForCausalLM.from_config(cfg)`` on ``device`` (default ``meta``: no memory, no
    init), in ``dtype`` (default: the config's)."""
    with torch.device(device):
        model = optional("transformers", "AutoModelForCausalLM").from_config(cfg)
    return model if dtype is None else model.to(dtype)


def blocks(model) -> torch.nn.ModuleList:
    """The decoder layers (what FSDP2 wraps one by one)."""
    return model.model.layers


def loss_fn(model):
    """``loss(params, batch)``: mean next-token cross entropy of ``model`` run with ``params``
    (``torch.func.functional_call``), ``batch = (input_ids, targets)``. The loss is computed
    here, in the logits' dtype (bf16/fp16 logits upcast to fp32): HF's ``labels=`` loss
    always upcasts to fp32, even in a float64 model."""

    def loss(params, batch):
        inputs, targets = batch
        logits = torch.func.functional_call(model, params, (inputs,), {"use_cache": False}).logits
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return loss


def train(args) -> dict:
    """The ``--hf`` path of ``python -m ragged train`` in an initialised process group (every
    rank): the GPT path's loop, summary and verdict (``_train_loop.py``), then the save and its
    reload check; returns the summary."""
    rank, world = dist.get_rank(), dist.get_world_size()  # the options were checked by check_args, before any process
    comm = rg.collectives.from_torch()
    if args.from_pretrained:
        weights = rg.checkpoint.pretrained(args.from_pretrained)  # headers and config.json only
        auto_config = optional("transformers", "AutoConfig")
        cfg = auto_config.from_pretrained(args.from_pretrained, local_files_only=True)  # JSON only
        if cfg.model_type not in KINDS:
            raise SystemExit(f"--from-pretrained {args.from_pretrained}: model_type {cfg.model_type!r}, not one of {KINDS}.")
    else:
        cfg = config(args.hf, vocab_size=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn,
                     seq=args.seq, experts=args.experts, top_k=args.top_k)
    model = build(cfg)  # meta: nothing allocated, nothing initialised yet
    units = fsdp.make_units(model, world_size=world, specs=specs_for(args))
    opt = optimizer(args, comm, units, no_decay_types(model))
    if args.from_pretrained:  # each rank reads its own byte ranges; buffers computed, model keeps placeholders
        state = fsdp.init(units, weights, opt, comm, module=model, seed=args.seed)
    else:
        state = fsdp.init(units, model, opt, comm, seed=args.seed)  # one unit real at a time; model keeps placeholders
    step = fsdp.make_step(units, loss_fn(model), opt, comm, micro_batches=args.micro_batches, chunks=args.chunks,
                          policy=policy_for(args),
                          prefetch=not args.no_prefetch, reshard_after_forward=not args.no_reshard)  # donates as opt does
    task = SyntheticLM(cfg.vocab_size, args.seq, seed=args.seed + 1)
    console = make_console() if rank == 0 else None
    if console is not None:
        announce(console, args, f"HF {type(model).__name__} built on meta,", units, task)
    checkpoints = job_checkpoints(args, comm, units, model)
    state, history, seconds = run_steps(args, step, state, task, comm.device, console, checkpoints)
    summary = summarize(args, history, seconds, task, units, model=type(model).__name__, **resumed(checkpoints, args.chunks))
    with _one_temporary_directory() as tmp:  # the default: one directory every rank writes into
        where = args.save_pretrained or tmp
        fsdp.save_pretrained(units, state.shards, comm, where, module=model)  # by rank: one unit gathered at a time
        full = fsdp.export(units, state.shards, comm, module=model, device="cpu")  # rank 0 only: the check
        if rank == 0:
            summary.update(_reload(where, full), saved_to=args.save_pretrained)
    if console is not None:
        finish(console, args, summary, history)
        print(f"save_pretrained -> {args.save_pretrained or 'a temporary directory, removed (pass --save-pretrained DIR)'}"
              f": {summary['exported']} tensors; from_pretrained reloads them with max |diff| "
              f"{summary['reload_max_diff']:.1e}", flush=True)  # always, --quiet too: where the model went
    return summary


@contextlib.contextmanager
def _one_temporary_directory():
    """A temporary directory rank 0 makes and every rank is told (a rank's own would be another
    path, and ``save_pretrained`` refuses ranks that disagree on it); removed once all are done."""
    path = [tempfile.mkdtemp(prefix="ragged-hf-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def _reload(where: str, full: dict) -> dict:
    """from_pretrained of the saved directory against the exported state dict: the largest difference."""
    reloaded = optional("transformers", "AutoModelForCausalLM").from_pretrained(where, local_files_only=True,
                                                                 dtype=next(iter(full.values())).dtype)
    got = reloaded.state_dict()
    diff = max((got[k].double() - v.double()).abs().max().item() for k, v in full.items())
    return {"exported": len(full), "saved_files": sorted(os.listdir(where)), "reload_max_diff": diff}
