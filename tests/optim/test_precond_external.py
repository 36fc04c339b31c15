"""SOAP and Shampoo against code nobody here wrote: pytorch-optimizer's ``SOAP`` and blocked
``ScalableShampoo``, each ``b x b`` block given to them as its own parameter (their grafting and
normalisation are per parameter, ours per block) and each leaf that falls back as a 1-D parameter
(which both run without a preconditioner). Every difference of definition between them and ragged
is listed in docs/optimizers.md; the settings below are those where the definitions coincide."""

import pytest
import torch

import ragged as rg
from tests.optim import _precond_cases as cases
from tests.optim._precond_reference import as_matrix, tiles

pytest.importorskip("pytorch_optimizer")
from pytorch_optimizer import SOAP, ScalableShampoo  # noqa: E402

STEPS = 12  # SOAP: five refreshes; Shampoo: a root every step


def _theirs(params, gs, make_opt, blocks):
    ps = []  # (leaf, rows, cols, parameter); rows None: the whole leaf, 1-D
    for k, v in params.items():
        if blocks.get(k):
            m = as_matrix(v)
            ps += [(k, rs, cs, torch.nn.Parameter(m[rs, cs].clone())) for rs, cs in tiles(*m.shape, *blocks[k])]
        else:
            ps.append((k, None, None, torch.nn.Parameter(v.clone().reshape(-1))))
    opt = make_opt([p for *_, p in ps])
    for g in gs:
        for k, rs, cs, p in ps:
            p.grad = g[k].reshape(-1).clone() if rs is None else as_matrix(g[k])[rs, cs].clone()
        opt.step()
    out = {k: as_matrix(v).clone() for k, v in params.items()}
    for k, rs, cs, p in ps:
        if rs is None:
            out[k] = p.detach().reshape(params[k].shape)
        else:
            out[k][rs, cs] = p.detach()
    return {k: out[k].reshape(params[k].shape) for k in params}


def _compare(ours, theirs, params, blocks, block_tol, other_tol):
    for k in params:
        tol = block_tol if blocks.get(k) else other_tol
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=tol, msg=lambda m: f"{k}: {m}")
        assert (theirs[k] - params[k]).abs().max() > 0.05, f"{k} must move"


def test_soap_agrees_with_pytorch_optimizer():
    """Their QR runs in float32 whatever the dtype ('We cast to float32 because ... the
    correctness / numerical stability of the Q orthogonality is important', soap.py), so the
    blocks agree to float32 after the first refresh (5e-8 measured here); everything else to
    float64 rounding."""
    params = cases.exact_params()
    gs = cases.grads(params, STEPS)
    h = cases.SOAP_HP
    ours = cases.run_world(params, cases.EXACT_SPECS, gs, cases.make_soap, 2)["params"]
    theirs = _theirs(params, gs, lambda ps: SOAP(ps, lr=h["lr"], betas=(h["b1"], h["b2"]), shampoo_beta=h["shampoo_beta"],
                                                 eps=h["eps"], weight_decay=h["weight_decay"],
                                                 precondition_frequency=h["precondition_frequency"]), cases.EXACT_BLOCKS)
    _compare(ours, theirs, params, cases.EXACT_BLOCKS, block_tol=1e-6, other_tol=1e-12)


def test_blocked_shampoo_agrees_with_scalable_shampoo():
    """Where the definitions coincide: statistics not bias-corrected (theirs never are), roots by
    SVD (``use_svd=True``; their default is a Schur-Newton iteration), SGD grafting, no momentum,
    a root every step from step 1, decoupled weight decay, 1-D parameters not reshaped
    (``shape_interpretation=False``)."""
    params = cases.exact_params()
    gs = cases.grads(params, STEPS)
    lr, b2, wd, eps = 0.02, 0.95, 0.1, 1e-30

    def ours_opt():
        return rg.optim.shampoo(lr, b1=0.0, b2=b2, matrix_eps=eps, weight_decay=wd, precondition_frequency=1,
                                start_preconditioning_step=1, grafting="sgd", use_bias_correction=False,
                                matrix_dtype=torch.float64)

    ours = cases.run_world(params, cases.EXACT_SPECS, gs, ours_opt, 2)["params"]
    theirs = _theirs(params, gs, lambda ps: ScalableShampoo(
        ps, lr=lr, betas=(0.0, b2), weight_decay=wd, decoupled_weight_decay=True, block_size=4,
        start_preconditioning_step=1, preconditioning_compute_steps=1, statistics_compute_steps=1, graft_type=1,
        nesterov=False, matrix_eps=eps, use_svd=True, shape_interpretation=False), cases.EXACT_BLOCKS)
    _compare(ours, theirs, params, cases.EXACT_BLOCKS, block_tol=1e-10, other_tol=1e-12)
