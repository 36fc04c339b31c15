"""The global norm does not depend on how the elements are split among ranks (see [Note: a norm
that does not depend on the split] in ragged/_dbuffer.py): the same values at every world size
and granularity give the same bits, within 1e-15 of the float64 reference, and clipping by it
scales every update by the same factor."""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from ragged import spec

simulate = rg.collectives.simulate


def _params():
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-6, 3, 300)[torch.randperm(300, generator=g)]
    return {
        "w": torch.randn(300, 37, generator=g) * scale[:, None],  # rows of very different sizes
        "e": torch.randn(3, 20, 16, generator=g),
        "b": torch.randn(1001, generator=g),
        "r": torch.randn(5, 7, generator=g),  # replicated
    }


SPECS = {
    "rows": {"w": spec.Rows(1), "e": spec.Rows(1), "b": spec.Elements(1), "r": spec.Replicate()},
    "coarse": {"w": spec.Rows(7), "e": spec.Blocks(4, 8), "b": spec.Elements(13), "r": spec.Replicate()},  # short last granules
}


def _ones_and_two_huge():
    """Squares of 1 next to squares of 2**27 (2**54: its float64 ulp is 4): where the ones are summed
    before meeting a huge one decides the last bits, so a sum per rank then across ranks differs
    between world sizes (3 different norms at W = 1, 2, 3, 4, 7 before the exact sum)."""
    w = torch.ones(64, 16)
    w[0, 0] = w[40, 3] = 2.0 ** 27
    return {"w": w, "e": torch.ones(3, 20, 16), "b": torch.ones(1001), "r": torch.ones(5, 7)}


@pytest.mark.parametrize("values", [_params, _ones_and_two_huge], ids=["mixed", "ones and two huge"])
@pytest.mark.parametrize("granularity", list(SPECS))
def test_the_norm_is_the_same_bits_at_every_world_size(granularity, values):
    params = values()
    want = torch.sqrt(sum((v.double() ** 2).sum() for v in params.values()))
    norms = {}
    for world in (1, 2, 3, 4, 7):
        plan = rg.make_plan(params, SPECS[granularity], world_size=world)
        got = simulate(world, lambda c: rg.shard(plan, params, c).global_norm(c))
        assert all(torch.equal(n, got[0]) for n in got)
        norms[world] = got[0]
    assert all(torch.equal(n, norms[1]) for n in norms.values()), {w: n.item() for w, n in norms.items()}
    torch.testing.assert_close(norms[1], want, rtol=1e-15, atol=0)


def test_nonfinite_norms_and_clipping():
    plan = rg.make_plan({"w": torch.empty(8, 4)}, world_size=2)

    def fn(comm, value):
        w = torch.ones(8, 4)
        w[5, 1] = value
        d = rg.shard(plan, {"w": w}, comm)
        return float(d.global_norm(comm))

    for value, check in ((float("nan"), lambda n: n != n), (float("inf"), lambda n: n == float("inf")),
                         (0.0, lambda n: n == 31 ** 0.5)):
        assert all(check(n) for n in simulate(2, fn, value))
    assert float(rg.optim.tree_norm({"z": torch.zeros(3)})) == 0.0
