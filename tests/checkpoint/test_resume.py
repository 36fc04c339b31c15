"""A run resumed from a checkpoint (on another world size / plan) equals the uninterrupted run.

Simulated backend; the gloo version is in tests/distributed/test_checkpoint_gloo.py.
"""

from __future__ import annotations

import pytest
import torch

import ragged as rg
from tests.checkpoint import _train

simulate = rg.collectives.simulate


def _uninterrupted(m, steps, opt):
    def fn(comm):
        state = _train.train(comm, _train.init_state(comm, opt=opt), steps, opt)
        return _train.full_params(comm, state), state["step"]

    return simulate(m, fn)[0]


@pytest.mark.parametrize(
    "m_before, m_after, granularity, opt",
    [(4, 2, "elements", "adamw"), (2, 4, "blocks", "adamw"), (2, 1, "rows", "adamw"), (4, 2, "blocks", "sgd"), (4, 2, "rows", "muon"), (1, 4, "elements", "muon")],
)
def test_resume_after_reshard_equals_uninterrupted(tmp_path, m_before, m_after, granularity, opt):
    n1, n2 = 3, 3
    path = tmp_path / "ckpt"

    # SGD traces, AdamW moments: DBuffers; Muon: momentum DBuffer + packed AdamW part (bound).
    def first(comm):
        state = _train.train(comm, _train.init_state(comm, opt=opt), n1, opt)
        rg.checkpoint.save(path, _train.bound(state, opt), comm)

    simulate(m_before, first)

    def second(comm):
        like = _train.init_state(comm, granularity, opt=opt, seed=7)  # other values: only the layout counts
        state = _train.unbound(rg.checkpoint.load(path, _train.bound(like, opt), comm))
        assert state["step"] == n1
        state = _train.train(comm, state, n2, opt)
        return _train.full_params(comm, state), state["step"]

    resumed, step = simulate(m_after, second)[0]
    reference, ref_step = _uninterrupted(m_after, n1 + n2, opt)
    assert step == ref_step == n1 + n2
    initial = _train.model_params(0)
    for k in reference:
        assert not torch.allclose(reference[k], initial[k])  # training moved the parameters
        torch.testing.assert_close(resumed[k], reference[k], msg=k)  # fp32 tolerance
