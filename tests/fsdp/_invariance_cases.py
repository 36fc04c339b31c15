"""The chunked step (``fsdp.make_step(..., chunks=C)``) at several data-parallel world sizes of one
set of ranks, each compared with W=1 bit for bit (simulated: tests/fsdp/test_invariance.py; gloo in
both transports: tests/distributed/test_invariance_gloo.py).

:func:`train` runs one training on any comm and returns every step's loss and the final full
parameters (and the optimizer state, gathered where it is laid out like the shards). A comm of a
sub-group trains a world size smaller than the processes': four gloo ranks hold W=1 (each alone),
W=2 (two pairs), W=4 and HSDP 2 x 2 at once, so one set of workers tests them all.
"""

from __future__ import annotations

import copy
import functools

import torch

import ragged as rg
from ragged import fsdp, spec
from ragged._dbuffer import DBuffer
from ragged._pytree import pytree
from ragged.examples.gpt import GPT, GPTConfig, loss_fn

CHUNKS = 4
ROWS = 2  # rows per chunk
SEQ = 8
MODELS = {
    "dense": GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, ffn_dim=24, max_seq_len=SEQ),
    "moe": GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, ffn_dim=24, max_seq_len=SEQ, num_experts=4,
                     moe_every=2, top_k=2),
}
OPTIMIZERS = {
    # a max_norm the first steps exceed: the clipping factor, and so the global norm, matters
    "adamw+clip": lambda comm: rg.optim.chain(rg.optim.clip_by_global_norm(0.05, comm=comm),
                                              rg.optim.adamw(1e-2, weight_decay=0.1)),
    "adamw_8bit": lambda comm: rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=64),
    "soap": lambda comm: rg.optim.soap(1e-2, precondition_frequency=1),
    "sgd": lambda comm: rg.optim.sgd(0.1, momentum=0.9),
    "shampoo": lambda comm: rg.optim.shampoo(1e-2, precondition_frequency=1),
    "muon": lambda comm: rg.optim.muon(1e-2, comm=comm),
    "schedule+finite": lambda comm: rg.optim.apply_if_finite(
        rg.optim.adamw(rg.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 4)), 3, comm=comm),
}


def specs(path, t):
    """8 x 8 blocks for every matrix (and expert tensor) they tile: SOAP's and 8-bit AdamW's blocks."""
    return spec.Blocks(8, 8) if t.dim() >= 2 and t.shape[-2] % 8 == 0 and t.shape[-1] % 8 == 0 else None


@functools.lru_cache(maxsize=None)
def model(kind: str, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(MODELS[kind]).to(dtype)


def global_batch(step: int, chunks: int = CHUNKS):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 32, (chunks * ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(comm, kind="dense", opt="adamw+clip", *, chunks=CHUNKS, steps=2, policy=None, checkpoint=False,
          compile=False, frozen=(), specs=specs, state=None, start=0, return_state=False):
    """``(losses, full params, gathered optimizer state)`` after ``steps`` steps of the chunked step
    (``chunks=None``: the default step with ``CHUNKS / W`` micro-batches of contiguous rows, the
    control); ``frozen``: parameter names that do not train; ``specs``: make_units'; ``state``/``start``: continue a loaded
    state from step ``start``; ``return_state``: also the ``TrainState`` and the units."""
    module = copy.deepcopy(model(kind))
    for name, p in module.named_parameters():
        p.requires_grad_(name not in frozen)
    units = fsdp.make_units(module, world_size=comm.world_size, specs=specs)
    optimizer = OPTIMIZERS[opt](comm)
    if state is None:
        state = fsdp.init(units, module.state_dict(), optimizer, comm)
    if compile:
        for block in module.blocks:
            block.compile(backend="eager")
    loss = loss_fn(module, checkpoint=checkpoint)
    if chunks is None:
        step = fsdp.make_step(units, loss, optimizer, comm, module=module, policy=policy,
                              micro_batches=CHUNKS // (comm.world_size * comm.num_replicas))
    else:
        step = fsdp.make_step(units, loss, optimizer, comm, module=module, policy=policy, chunks=chunks)
    losses = []
    for s in range(start, start + steps):
        batch = global_batch(s)
        if chunks is None:
            d = comm.replica_rank * comm.world_size + comm.rank
            n = batch[0].shape[0] // (comm.world_size * comm.num_replicas)
            batch = tuple(t[d * n : (d + 1) * n] for t in batch)
        else:
            batch = fsdp.local_chunks(batch, chunks, comm)
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    full = {k: v.clone() for k, v in rg.gather(units, state.shards, comm).items()}
    out = (losses, full, gathered_state(units, state, comm))
    return out + (state, units) if return_state else out


def gathered_state(units, state, comm) -> list:
    """Every optimizer-state leaf laid out like the trainable shards, gathered (whole on every rank),
    and every 0-d one (counts), in tree order; what is laid out per rank otherwise (8-bit codes)
    is compared through the parameters it moves and a checkpoint's resharding."""
    shards = fsdp.trainable_shards(units, state.shards)

    def like(x):
        return isinstance(x, dict) and x.keys() == shards.keys() and all(
            isinstance(v, DBuffer) and v.plan == shards[k].plan and v.data.shape == shards[k].data.shape
            for k, v in x.items())

    out = []
    for x in pytree.leaves(state.opt_state, is_leaf=like, none_is_leaf=True):
        if like(x):
            out.append({k: pytree.map(torch.clone, rg.gather(v, comm)) for k, v in x.items()})
        elif isinstance(x, torch.Tensor) and x.dim() == 0:
            out.append(x.clone())
    return out


def same(a, b) -> bool:
    """Bit for bit: losses as floats, tensors with ``torch.equal`` (and equal dtypes)."""
    la, pa, sa = a[:3]
    lb, pb, sb = b[:3]
    if la != lb or pa.keys() != pb.keys():
        return False
    if not all(pa[k].dtype == pb[k].dtype and torch.equal(pa[k], pb[k]) for k in pa):
        return False
    flat_a, flat_b = pytree.leaves(sa), pytree.leaves(sb)
    return len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def difference(a, b) -> str:
    """What differs between two :func:`train` results (for assertion messages)."""
    la, pa = a[:2]
    lb, pb = b[:2]
    worst = max(((pa[k].double() - pb[k].double()).abs().max().item(), k) for k in pb)
    return f"losses {la} vs {lb}; largest parameter difference {worst[0]:.3g} in {worst[1]}"
