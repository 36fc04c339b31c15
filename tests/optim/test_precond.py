"""SOAP and Shampoo over DBuffers: float64 against the references written from the papers, the
same bits at every world size, and every fallback and refusal of the blocks."""

import pytest
import torch

import ragged as rg
from ragged import spec
from tests.optim import _precond_cases as cases

MAKE = {"soap": cases.make_soap, "shampoo": cases.make_shampoo}


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_float64_equals_reference_at_every_world_size(name):
    params = cases.exact_params()
    gs = cases.grads(params)
    want = cases.reference(name, params, gs)
    runs = {w: cases.run_world(params, cases.EXACT_SPECS, gs, MAKE[name], w) for w in (1, 2, 3, 4)}
    for w, got in runs.items():
        for k, v in want.items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-10, atol=1e-10, msg=lambda m: f"W={w} {k}: {m}")
        moved = (got["params"]["w"] - params["w"]).abs().max()
        assert moved > 1e-3, "the test must move the parameters"
        cases.assert_bit_identical(got, runs[1], f"{name} W={w} vs W=1")


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_fp32_state_bit_identical_at_every_world_size_with_edge_tiles(name):
    """Edge tiles of every part, a 3-D leaf and (SOAP) 1-D blocks: params, moments, statistics and
    eigenbases / roots, after 5 steps with two refreshes, at W = 1, 2, 3, 4."""
    params = cases.edge_params()
    gs = cases.grads(params)
    kw = {"precondition_1d": True} if name == "soap" else {}
    make = lambda: MAKE[name](torch.float32, **kw)  # noqa: E731
    one = cases.run_world(params, cases.EDGE_SPECS, gs, make, 1)
    assert {k[2] for k in one["factors"]} == {"interior", "right", "bottom", "corner"}
    for w in (2, 3, 4):
        cases.assert_bit_identical(cases.run_world(params, cases.EDGE_SPECS, gs, make, w), one, f"{name} W={w}")
