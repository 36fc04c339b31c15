from build import code, md

NAME = "03_functional_training.ipynb"

CELLS = [
    md("""
# A functional FSDP training step, checked against single-process training

ragged's training step is a pure function of its state: `state, metrics = step(state, batch)`,
where `state = (shards, opt_state)` holds this rank's shard of every FSDP unit and the optimizer
state over those shards. No module hooks, no hidden globals: the model code is untouched and runs
through `torch.func.functional_call`.

Here we train a tiny GPT on 4 simulated ranks (threads of this process, same code as under
`torchrun`), and check that the result equals plain single-process `torch.optim.AdamW` on the same
global batch. Then we use what RaggedShard is for: block-wise 8-bit Adam whose blocks are never cut
by a rank boundary, and distributed Muon, which needs whole matrices.
"""),
    code("""
import copy
import torch
import rich
import ragged as rg
from ragged import fsdp, spec
from ragged.examples.gpt import GPT, GPTConfig, loss_fn
from ragged.examples.data import SyntheticLM, rank_slice

config = GPTConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, ffn_dim=64, max_seq_len=16)
task = SyntheticLM(64, 16, seed=1)
STEPS, BATCH, WORLD = 30, 16, 4

def make_model(dtype=torch.float64):
    model = GPT(config)
    model.reset_parameters(torch.Generator().manual_seed(0))
    return model.to(dtype)

model = make_model()
units = fsdp.make_units(model, world_size=WORLD)
print(f"{sum(p.numel() for p in model.parameters())} parameters in {len(units)} units:")
for u in units:
    print(f"  {u.name:10s} {len(u.paths):2d} tensors, S={u.plan.shard_size}, padding {u.plan.overhead:.2%}")
"""),
    md("""
## The step, on 4 simulated ranks

Each rank gets its rows of the global batch. Inside the step every unit is all-gathered just before
it is used and released right after (gathered again for backward), the next unit's all-gather is
started before the current one computes, and each unit's gradient is reduce-scattered as soon as
backward is done with it.
"""),
    code("""
def train(comm, optimizer, steps=STEPS, dtype=torch.float64, specs=None):
    model = make_model(dtype)
    units = fsdp.make_units(model, world_size=comm.world_size, specs=specs)
    state = fsdp.init(units, model, optimizer, comm)
    step = fsdp.make_step(units, loss_fn(copy.deepcopy(model)), optimizer, comm)
    losses = []
    for s in range(steps):
        state, metrics = step(state, rank_slice(task.batch(s, BATCH), comm.rank, comm.world_size))
        losses.append(float(metrics["loss"]))
    full = rg.gather(units, state.shards, comm)
    return {k: v.clone() for k, v in full.items()}, losses

results = rg.collectives.simulate(WORLD, train, rg.optim.adamw(1e-2, weight_decay=0.1))
params, losses = results[0]
print("loss every 5 steps:", [round(l, 3) for l in losses[::5]])
"""),
    md("""
## The same training, unsharded, with `torch.optim.AdamW`
"""),
    code("""
reference = make_model()
opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
ref_losses = []
for s in range(STEPS):
    opt.zero_grad()
    loss = loss_fn(reference)(dict(reference.named_parameters()), task.batch(s, BATCH))
    loss.backward()
    opt.step()
    ref_losses.append(loss.item())
worst = max((params[k] - v.detach()).abs().max().item() for k, v in reference.named_parameters())
print(f"largest parameter difference after {STEPS} steps (float64): {worst:.2e}")
print(f"largest loss difference: {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}")
assert worst < 1e-8
"""),
    md("""
## Block-wise 8-bit Adam on aligned blocks

`adamw_8bit` stores both Adam moments as 8-bit codes (`torch.uint8` indices into a dynamic
quantization map, signed for the first moment, unsigned for the second) with one fp32 scale per
block. The blocks are the plan's blocks: with `spec.Blocks(32, 32)` every 32x32 tile of a matrix
lives on one rank (6144 codes and 6 scales for the 96x64 `attn` below), so each rank
quantizes its own shard with no communication, and the optimizer state is **the same whatever the
number of ranks** (a per-local-shard quantizer, as in torchao, changes with the mesh).
"""),
    code("""
g = torch.Generator().manual_seed(2)
weights = {"attn": torch.randn(96, 64, generator=g), "mlp": torch.randn(128, 96, generator=g)}
grads_seq = [{k: torch.randn(w.shape, generator=g) for k, w in weights.items()} for _ in range(3)]

def eight_bit_state(comm):
    plan = rg.make_plan(weights, spec.Blocks(32, 32), world_size=comm.world_size)
    local = rg.shard(plan, weights, comm)
    opt = rg.optim.adamw_8bit(1e-2, min_size=1024)
    state = opt.init(local)
    for grads in grads_seq:
        updates, state = opt.update(rg.shard(plan, grads, comm), state, local)
        local = rg.apply_updates(local, updates)
    return rg.optim.adam8bit_leaf_state(state[0].moments, local, min_size=1024)

def whole_state(per_rank):  # concatenate each leaf's codes / scales over ranks, in rank order
    keys = {(path, k) for r in per_rank for path in r for k in r[path]}
    return {(path, k): torch.cat([r[path][k] for r in per_rank if path in r]) for path, k in sorted(keys)}

states = {m: whole_state(rg.collectives.simulate(m, eight_bit_state)) for m in (1, 2, 4)}
for m in (2, 4):
    same = all(torch.equal(states[m][key], states[1][key]) for key in states[1])
    print(f"8-bit Adam state on {m} ranks bit-identical to 1 rank: {same}")
print({key: (tuple(v.shape), str(v.dtype)) for key, v in states[4].items() if key[0] == "['attn']"})
"""),
    md("""
In training, the 8-bit optimizer is a flag away; its loss follows fp32 AdamW closely:
"""),
    code("""
blocks = {name: (spec.Blocks(8, 8) if p.ndim == 2 and p.shape[0] % 8 == 0 else spec.Rows(1))
          for name, p in make_model().named_parameters()}

def train_8bit(comm):
    optimizer = rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=256)
    return train(comm, optimizer, steps=20, dtype=torch.float32, specs=blocks)[1]

losses_8bit = rg.collectives.simulate(WORLD, train_8bit)[0]
print("8-bit AdamW loss every 5 steps:", [round(l, 3) for l in losses_8bit[::5]])
print("fp32 AdamW  loss every 5 steps:", [round(l, 3) for l in losses[:20:5]])
"""),
    md("""
## Distributed Muon on whole matrices

Muon orthogonalises each 2-D update with Newton-Schulz iterations, which needs the whole matrix.
ragged redistributes each matrix's update to one owner rank (a RaggedShard with a single non-zero
unit), balances Newton-Schulz work across ranks, and sends the result back. Everything that is not
a hidden 2-D matrix (embeddings, head, norms) uses AdamW in the same optimizer.
"""),
    code("""
def train_muon(comm, steps=20):
    return train(comm, rg.optim.muon(2e-2, comm=comm), steps)

muon_params, muon_losses = rg.collectives.simulate(2, train_muon)[0]
print("Muon   loss every 5 steps:", [round(l, 3) for l in muon_losses[::5]])
print("AdamW  loss every 5 steps:", [round(l, 3) for l in losses[:20:5]])
"""),
]
