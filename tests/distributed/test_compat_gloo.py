"""ragged/_compat.py on real gloo ranks: the torch functions chosen at import, no FutureWarning
from ragged's own calls, the older torch's branch running the engine exactly, and a torch below
the supported range refused at import (see [Note: torch 2.11 to 2.14])."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import ragged as rg
from ragged import _compat, spec
from tests.distributed._harness import comm, workers_fixture

pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
workers2 = workers_fixture(2)

# torch 2.11 as ragged sees it, at the start of every Python process (the gloo workers too)
AS_TORCH_2_11 = os.path.join(ROOT, "scripts", "as_torch_2_11")


def test_the_installed_torch_s_functions_are_bound():
    assert _compat.all_gather_single is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert _compat.reduce_scatter_single is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _round_trip_warning_free(handshake):
    """shard -> gather -> reduce_scatter (sum, mean) on 2 ranks with every FutureWarning an error,
    exact against the unsharded float64 tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        c = comm(handshake=handshake)
        g = torch.Generator().manual_seed(0)
        params = {"emb": torch.randn(11, 8, generator=g, dtype=torch.float64),
                  "w": torch.randn(9, 8, generator=g, dtype=torch.float64), "b": torch.randn(9, generator=g, dtype=torch.float64)}
        plan = rg.make_plan(params, {"emb": spec.Rows(2), "w": spec.Blocks(3, 4), "b": None}, world_size=c.world_size)
        d = rg.shard(plan, params, c)
        for a, b in zip(rg.pytree.leaves(rg.gather(d, c)), rg.pytree.leaves(params), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        grads = [rg.pytree.map(lambda p, r=r: p * (r + 2), params) for r in range(c.world_size)]
        for op in ("sum", "mean"):
            got = rg.reduce_scatter(plan, grads[c.rank], c, op=op)
            ref = rg.pytree.map(lambda *xs: sum(xs) / (c.world_size if op == "mean" else 1), *grads)
            want = rg.shard(plan, ref, c)
            torch.testing.assert_close(got.data, want.data, rtol=0, atol=0)
            torch.testing.assert_close(got.replicated, want.replicated, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("handshake", ["header", "deferred"])
def test_ragged_s_collectives_emit_no_future_warning(workers2, handshake):
    assert workers2.run(_round_trip_warning_free, handshake) == [True, True]


@pytest.mark.slow
def test_the_older_torch_branch_runs_the_engine_tests_exactly():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([AS_TORCH_2_11, ROOT]))
    probe = subprocess.run(
        [sys.executable, "-c", "import torch.distributed as d; from ragged import _compat as c; "
         "assert not hasattr(d, 'all_gather_single') and not c.CAN_SWAP_STORAGE; "
         "assert c.all_gather_single is d.all_gather_into_tensor and c.reduce_scatter_single is d.reduce_scatter_tensor"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::FutureWarning",
         "tests/distributed/test_engine_gloo.py", "-k", "w2 and (deferred or coalesced)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and "failed" not in last, run.stdout[-3000:] + run.stderr[-3000:]
    assert int(last.split(" passed")[0].split()[-1]) >= 5, last


def test_a_torch_below_the_range_is_refused_at_import():
    run = subprocess.run(
        [sys.executable, "-c", "import torch; torch.__version__ = torch.torch_version.TorchVersion('2.10.1'); import ragged"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "ImportError: ragged needs torch >= 2.11 (tested: >=2.11,<2.15); this is torch 2.10.1. Upgrade it: "
        "pip install 'torch>=2.11,<2.15'.")
