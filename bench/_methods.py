"""The three ways the step benchmark trains the same model on the same batches.

* :class:`RaggedMethod`: ``rg.fsdp`` (units = every block + the rest, ``rg.optim.adamw``).
* :class:`FSDP2Method`: ``torch.distributed.fsdp.fully_shard`` on every block and the root,
  ``reshard_after_forward=True``, default prefetching, ``torch.optim.AdamW``.
* :class:`LocalMethod`: the same model unsharded on every rank, no communication
  (the compute floor: what a step costs with nothing sharded).

All three start from the same weights (``torch.manual_seed(seed)`` before building the model).
The model is ``ragged.examples.gpt``'s GPT for a ``GPTConfig``, or a Hugging Face causal LM
(``ragged.examples.hf``) for a ``transformers`` config. ragged trains the module itself after
``fsdp.init`` released its weights (placeholders, see ``ragged/fsdp/_placeholder.py``), as a
user would; ``keep_module=True`` keeps them (``release_module=False``) to show what that costs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["RaggedMethod", "FSDP2Method", "LocalMethod", "dtypes", "compile_model", "build_model", "ragged_loss"]


def dtypes(policy: str):
    """``(param/compute dtype, reduce dtype)`` of a dtype policy name: ``fp32`` or ``bf16``
    (bf16 compute, fp32 master weights and gradient reduction)."""
    if policy == "fp32":
        return None, None
    if policy == "bf16":
        return torch.bfloat16, torch.float32
    raise ValueError(f"unknown dtype policy {policy!r}; use 'fp32' or 'bf16'.")


def _is_hf(cfg) -> bool:
    from ragged.examples.gpt import GPTConfig

    return not isinstance(cfg, GPTConfig)


LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
"""The LoRA of ``--lora``: peft's adapters on the attention's q and v projections, the base frozen."""


def build_model(cfg, seed, device, lora=False):
    """The benchmark's model for ``cfg`` (GPT or HF), its weights from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    if _is_hf(cfg):
        from ragged.examples import hf

        model = hf.build(cfg, device="cpu").to(device)
        if lora:
            import peft

            torch.manual_seed(seed + 1)
            model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
        return model
    if lora:
        raise ValueError("--lora is for the Hugging Face models (--model hf-llama)")
    from ragged.examples.gpt import GPT

    return GPT(cfg).to(device)


def _blocks(cfg, model):
    """The modules FSDP2 wraps one by one (ragged's default units are the same)."""
    if _is_hf(cfg):
        from ragged.examples import hf

        return hf.blocks(model.get_base_model() if hasattr(model, "get_base_model") else model)
    return model.blocks


def compile_model(cfg, model, how, backend="inductor"):
    """``torch.compile`` in place: ``"block"`` every block (``torch.compile(block)`` put back in
    its list, as torchtitan does), ``"whole"`` the model (``model.compile()``); ``None``: nothing.
    ``backend``: dynamo's backend (``"aot_eager"``: no code generation, for quick checks)."""
    if how == "block":
        blocks = _blocks(cfg, model)
        for k, block in enumerate(blocks):
            blocks[k] = torch.compile(block, backend=backend)
    elif how == "whole":
        model.compile(backend=backend)
    elif how is not None:
        raise ValueError(f"unknown compile mode {how!r}; use 'block' or 'whole'.")
    return model


def _logits(model, inputs):
    out = model(inputs, use_cache=False) if hasattr(model, "config") else model(inputs)
    return getattr(out, "logits", out)


def ragged_loss(cfg, model, checkpoint):
    """``loss(params, batch)`` of the model (HF: without activation checkpointing)."""
    if _is_hf(cfg):
        from ragged.examples import hf

        if checkpoint:
            raise ValueError("--activation-checkpointing is not wired for the HF models")
        return hf.loss_fn(model)
    from ragged.examples.gpt import loss_fn

    return loss_fn(model, checkpoint=checkpoint)


def _ce(logits, targets):
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class RaggedMethod:
    name = "ragged"

    def __init__(self, cfg, *, seed, device, lr, policy, comm, optimizer=None, specs=None, donate=True, checkpoint=False,
                 keep_module=False, groups=None, max_buffers=1, compile=None, compiler="inductor", bind_module=False,
                 lora=False, gather_format=None, reduce_format=None):
        import ragged as rg
        from ragged import fsdp
        from torch.profiler import record_function

        compute, reduce = dtypes(policy)
        model = compile_model(cfg, build_model(cfg, seed, device, lora), compile, compiler)
        self.units = fsdp.make_units(model, world_size=comm.world_size, specs=specs, groups=groups,
                                     max_buffers=max_buffers)
        opt = optimizer if optimizer is not None else rg.optim.adamw(  # in place, as torch.optim.AdamW
            lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, donate=donate)

        def update(grads, state, params=None):
            with record_function("ragged::optimizer"):
                return opt.update(grads, state, params)

        self.optimizer = opt._replace(update=update)  # keeps opt.donates
        # the module's weights are released (placeholders) unless keep_module: functional_call supplies them
        self.state = fsdp.init(self.units, model, self.optimizer, comm, release_module=not keep_module)
        self.model = model
        self.step_fn = fsdp.make_step(self.units, ragged_loss(cfg, model, checkpoint), self.optimizer, comm,
                                      policy=fsdp.MixedPrecision(compute_dtype=compute, reduce_dtype=reduce,
                                                                 gather_format=gather_format, reduce_format=reduce_format),
                                      donate=donate,
                                      module=model if compile or bind_module else None)  # shards updated in place (the bench owns them)
        self.comm = comm
        self.metrics = {}

    def step(self, batch):
        self.state, self.metrics = self.step_fn(self.state, batch)
        return self.metrics["loss"]

    def state_tensors(self):
        from ragged._pytree import pytree

        module = [*self.model.parameters(), *self.model.buffers()]  # placeholders hold no storage
        return [t for t in pytree.leaves(self.state) if isinstance(t, torch.Tensor)] + module

    def optimizer_state_bytes(self):
        from bench._measure import storage_bytes
        from ragged._pytree import pytree

        return storage_bytes([t for t in pytree.leaves(self.state.opt_state) if isinstance(t, torch.Tensor)])


class _TorchOptimizerState:
    """State accounting shared by the methods that hold a module and a torch.optim optimizer."""

    def state_tensors(self):
        out = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters()]
        for st in self.opt.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return out

    def optimizer_state_bytes(self):
        from bench._measure import storage_bytes

        return storage_bytes([v for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])


class FSDP2Method(_TorchOptimizerState):
    name = "fsdp2"

    def __init__(self, cfg, *, seed, device, lr, policy, foreach=True, optimizer=None, checkpoint=False, groups=(),
                 compile=None, compiler="inductor", lora=False):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        compute, reduce = dtypes(policy)
        model = compile_model(cfg, build_model(cfg, seed, device, lora), "block" if compile == "block" else None, compiler)
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
        for block in _blocks(cfg, model):
            if checkpoint:  # the composable activation checkpointing FSDP2 documents (applied before fully_shard)
                from torch.distributed._composable import checkpoint as ac

                ac(block)
            fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        for names in groups:  # more fully_shard groups (module names), as ragged's units with groups=
            fully_shard([model.get_submodule(n) for n in names], mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        compile_model(cfg, model, "whole" if compile == "whole" else None, compiler)  # after fully_shard: its hooks break the graph
        self.model = model
        self.opt = optimizer(model.parameters()) if optimizer else torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=foreach)

    def step(self, batch):
        inputs, targets = batch
        loss = _ce(_logits(self.model, inputs), targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = loss.detach().reshape(1).float()
        torch.distributed.all_reduce(loss)  # same reporting as ragged: the mean loss over ranks
        return float(loss) / torch.distributed.get_world_size()



class LocalMethod(_TorchOptimizerState):
    """The unsharded model on every rank (its own batch; no gradient averaging)."""

    name = "local"

    def __init__(self, cfg, *, seed, device, lr, policy, foreach=True, optimizer=None, compile=None,
                 compiler="inductor", lora=False):
        compute, _ = dtypes(policy)
        self.model = compile_model(cfg, build_model(cfg, seed, device, lora), compile, compiler)
        self.compute = compute
        self.opt = optimizer(self.model.parameters()) if optimizer else torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=foreach)

    def step(self, batch):
        inputs, targets = batch
        if self.compute is not None:
            with torch.autocast(inputs.device.type, dtype=self.compute):
                loss = _ce(_logits(self.model, inputs), targets)
        else:
            loss = _ce(_logits(self.model, inputs), targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

