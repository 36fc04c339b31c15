"""Host syncs of the optimizer update alone, counted with tests/_host_syncs.py (on the CPU: what
would be a sync on a device): none for ``adamw`` and ``adamw_8bit``, with weight decay, a
schedule, donation, clipping, and 8-bit AdamW's CUDA forms (a product then a sum, the float32
root). The first update builds what is cached per layout and device (the 8-bit codec's tables,
the layout's index): it is not counted."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import spec
from ragged.collectives._agree import on_device
from ragged.optim import _quant8_fused
from tests._host_syncs import HostSyncs


def test_the_counter_sees_each_kind_of_sync():
    t = torch.arange(6.0)
    with HostSyncs() as syncs:
        t.sum().item()
        bool(t[0] > 1)
        t.tolist()
        torch.tensor([1.0, 2.0])
        torch.as_tensor(0.5, dtype=torch.float64)
        t[t > 2]
        t.nonzero()
        torch.full((), 0.5), t * 2.0, torch.arange(3)  # fills and kernels: none
        on_device([1, 2], "cpu")  # made from pinned memory without blocking on a device: none
    assert [w for w, _ in syncs.events] == ["scalar read", "scalar read", "tolist", "tensor from host data",
                                             "tensor from host data", "value-sized output", "value-sized output"]
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and torch.Tensor.tolist.__name__ == "tolist"


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 96, generator=g), "e": torch.randn(4, 32, 64, generator=g), "b": torch.randn(96, generator=g),
            "n": torch.randn(96, generator=g)}


SPECS = {"w": spec.Blocks(32, 32), "e": spec.Blocks(32, 32), "b": spec.Elements(1), "n": spec.Replicate()}
SCHEDULE = rg.optim.linear_schedule(1e-2, 1e-3, 10)
OPTIMIZERS = {
    "adamw": lambda: rg.optim.adamw(1e-2),
    "adamw-decay": lambda: rg.optim.adamw(1e-2, weight_decay=0.1),
    "adamw-schedule-decay-donate": lambda: rg.optim.adamw(SCHEDULE, weight_decay=0.1, donate=True),
    "adamw-clipped": lambda: rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=None), rg.optim.adamw(1e-2)),
    "adamw_8bit": lambda: rg.optim.adamw_8bit(1e-2, min_size=1000),
    "adamw_8bit-decay": lambda: rg.optim.adamw_8bit(1e-2, weight_decay=0.1, min_size=1000),
    "adamw_8bit-schedule-decay-donate": lambda: rg.optim.adamw_8bit(SCHEDULE, weight_decay=0.1, min_size=1000,
                                                                    donate=True),
    "adamw_8bit-clipped": lambda: rg.optim.chain(rg.optim.clip_by_global_norm(1.0, comm=None),
                                                 rg.optim.adamw_8bit(1e-2, min_size=1000)),
}


@pytest.mark.parametrize("forms", ["cpu", "device"], ids=["cpu-forms", "device-forms"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_update_makes_no_host_sync(name, forms, monkeypatch):
    if forms == "device":
        if "8bit" not in name:
            pytest.skip("only adamw_8bit has forms of its own per device")
        monkeypatch.setattr(_quant8_fused, "_cpu_kernels", lambda t: False)
        monkeypatch.setattr(_quant8_fused, "root_form", lambda t: "float32")  # CUDA's
    params = _params()
    plan = rg.make_plan(params, SPECS, world_size=1)
    local = rg.shard(plan, params, rank=0)
    opt = OPTIMIZERS[name]()
    state = opt.init(local)
    for step in range(3):
        grads = rg.shard(plan, rg.pytree.map(lambda p: torch.randn_like(p) * (step + 1), params), rank=0)
        with HostSyncs() as syncs:
            updates, state = opt.update(grads, state, local)
        if step:
            assert syncs.total == 0, syncs
        local = rg.apply_updates(local, updates)
