"""Single-process float64 references for block-diagonal SOAP and Shampoo, written from the papers
and the reference implementations' descriptions, not from ragged's code: whole tensors, one
Python object per block, loops, no batching, no DBuffers.

SOAP: Vyas et al. 2024, Algorithms 3 and 4 (Adam's first moment kept in the original space, as
in the paper), with the reference code's conventions (github.com/nikhilvyas/SOAP): the first step
only initialises the statistics and takes ``eigh``, the eigenvectors by decreasing eigenvalue,
weight decay on the updated parameters, the bias correction ``sqrt(1 - b2^t) / (1 - b1^t)``.

Shampoo: Distributed Shampoo (Shi et al. 2023), per block: statistics, bias-corrected inverse
roots by eigendecomposition with the epsilon floor, the EMA-filtered gradient, per-block
grafting of Adam or SGD, decoupled weight decay.
"""

from __future__ import annotations

import math

import torch


def tiles(rows: int, cols: int, r: int, c: int):
    """``(row slice, col slice)`` of every ``r x c`` tile of a ``rows x cols`` matrix, band-major."""
    for i in range(0, rows, r):
        for j in range(0, cols, c):
            yield slice(i, min(i + r, rows)), slice(j, min(j + c, cols))


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """A leaf as the matrix the blocks tile: its rows (the last dim), leading dims flattened; a
    1-D leaf as one row."""
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)


class SoapBlock:
    """One block's SOAP state (Algorithm 3; ``m`` in the original space)."""

    def __init__(self, shape):
        r, c = shape
        self.L, self.R = torch.zeros(r, r, dtype=torch.float64), torch.zeros(c, c, dtype=torch.float64)
        self.QL = self.QR = None
        self.m = torch.zeros(shape, dtype=torch.float64)
        self.v = torch.zeros(shape, dtype=torch.float64)

    @staticmethod
    def _eigvecs_desc(a):
        vals, vecs = torch.linalg.eigh(a + 1e-30 * torch.eye(a.shape[0], dtype=a.dtype))
        return vecs[:, torch.argsort(vals, descending=True)]

    def _accumulate(self, g, sb):
        self.L = sb * self.L + (1 - sb) * (g @ g.T)
        self.R = sb * self.R + (1 - sb) * (g.T @ g)

    def first(self, g, hp):
        self._accumulate(g, hp["shampoo_beta"])
        self.QL, self.QR = self._eigvecs_desc(self.L), self._eigvecs_desc(self.R)

    def direction(self, g, hp):
        """``N`` of Algorithm 3 for this step's gradient (before the step size)."""
        b1, b2 = hp["b1"], hp["b2"]
        self.m = b1 * self.m + (1 - b1) * g
        rotated_g = self.QL.T @ g @ self.QR
        self.v = b2 * self.v + (1 - b2) * rotated_g**2
        rotated_m = self.QL.T @ self.m @ self.QR
        n = self.QL @ (rotated_m / (self.v.sqrt() + hp["eps"])) @ self.QR.T
        if hp["normalize_grads"]:
            n = n / (1e-30 + n.pow(2).mean().sqrt())
        return n

    def after(self, g, hp, refresh: bool):
        self._accumulate(g, hp["shampoo_beta"])
        if refresh:  # Algorithm 4: sort by the estimated eigenvalues, one power iteration, QR
            est_l = torch.diagonal(self.QL.T @ self.L @ self.QL)
            order_l = torch.argsort(est_l, descending=True)
            est_r = torch.diagonal(self.QR.T @ self.R @ self.QR)
            order_r = torch.argsort(est_r, descending=True)
            self.v = self.v[order_l][:, order_r]
            self.QL = torch.linalg.qr(self.L @ self.QL[:, order_l]).Q
            self.QR = torch.linalg.qr(self.R @ self.QR[:, order_r]).Q


def soap_reference(params: dict, grads: list[dict], blocks: dict, hp: dict) -> dict:
    """SOAP on float64 ``params`` (a flat dict) for ``len(grads)`` steps; ``blocks[name]``: the
    ``(r, c)`` block of a preconditioned leaf, or None for Adam."""
    p = {k: v.clone().to(torch.float64) for k, v in params.items()}
    state = {}
    for k, v in p.items():
        mat = as_matrix(v)
        if blocks.get(k):
            state[k] = [(rs, cs, SoapBlock(mat[rs, cs].shape)) for rs, cs in tiles(*mat.shape, *blocks[k])]
        else:
            state[k] = SoapBlock((1, 1)), torch.zeros_like(v), torch.zeros_like(v)
    for step, g_all in enumerate(grads):
        t = step  # Adam steps taken so far + 1 on steps after the first
        lr = hp["lr"](step) if callable(hp["lr"]) else hp["lr"]
        for k in p:
            g = g_all[k].to(torch.float64)
            if step == 0:
                if blocks.get(k):
                    for rs, cs, blk in state[k]:
                        blk.first(as_matrix(g)[rs, cs], hp)
                continue
            if blocks.get(k):
                n = torch.zeros_like(as_matrix(g))
                for rs, cs, blk in state[k]:
                    n[rs, cs] = blk.direction(as_matrix(g)[rs, cs], hp)
                n = n.reshape(g.shape)
            else:
                _, m, v = state[k]
                m.mul_(hp["b1"]).add_((1 - hp["b1"]) * g)
                v.mul_(hp["b2"]).add_((1 - hp["b2"]) * g * g)
                n = m / (v.sqrt() + hp["eps"])
            size = lr * math.sqrt(1 - hp["b2"] ** t) / (1 - hp["b1"] ** t) if hp["correct_bias"] else lr
            p[k] = p[k] - size * n
            p[k] = p[k] - lr * hp["weight_decay"] * p[k]
            if blocks.get(k):
                for rs, cs, blk in state[k]:
                    blk.after(as_matrix(g)[rs, cs], hp, refresh=t % hp["precondition_frequency"] == 0)
    return p


def _inverse_root(a, exponent, eps):
    vals, vecs = torch.linalg.eigh(a + eps * torch.eye(a.shape[0], dtype=a.dtype))
    if vals.min() < eps:
        vals = vals - vals.min() + eps
    return vecs @ torch.diag(vals ** -exponent) @ vecs.T


def shampoo_reference(params: dict, grads: list[dict], blocks: dict, hp: dict) -> dict:
    """Shampoo (Distributed Shampoo's step, block-diagonal) on float64 ``params``; ``blocks[name]``
    as for :func:`soap_reference` (None: the grafting direction)."""
    p = {k: v.clone().to(torch.float64) for k, v in params.items()}
    b1, b2, gb2 = hp["b1"], hp["b2"], hp["grafting_b2"]
    freq, start = hp["precondition_frequency"], hp["start_preconditioning_step"]
    filt = {k: torch.zeros_like(v) for k, v in p.items()}
    graft_v = {k: torch.zeros_like(v) for k, v in p.items()}
    factors = {}
    for k, v in p.items():
        if blocks.get(k):
            mat = as_matrix(v)
            factors[k] = [[rs, cs, torch.zeros(mat[rs, cs].shape[0], mat[rs, cs].shape[0], dtype=torch.float64),
                           torch.zeros(mat[rs, cs].shape[1], mat[rs, cs].shape[1], dtype=torch.float64),
                           torch.eye(mat[rs, cs].shape[0], dtype=torch.float64),
                           torch.eye(mat[rs, cs].shape[1], dtype=torch.float64)] for rs, cs in tiles(*mat.shape, *blocks[k])]
    for t, g_all in enumerate(grads, start=1):
        weight = 1.0 if b2 == 1.0 else 1.0 - b2
        bc2 = 1.0 - b2**t if b2 < 1.0 else 1.0
        recompute = (t % freq == 0 and t > start) or t == start
        for k in p:
            g = g_all[k].to(torch.float64)
            if b1 > 0:
                filt[k] = b1 * filt[k] + (1 - b1) * g
                gbar = filt[k] / (1 - b1**t)
            else:
                gbar = g
            if hp["grafting"] == "adam":
                graft_v[k] = gb2 * graft_v[k] + (1 - gb2) * g * g
                graft = gbar / ((graft_v[k] / (1 - gb2**t)).sqrt() + hp["grafting_eps"])
            else:
                graft = gbar
            direction = graft.clone()
            if blocks.get(k):
                gm, gbm, grm = as_matrix(g), as_matrix(gbar), as_matrix(graft)
                dm = as_matrix(direction)
                for blk in factors[k]:
                    rs, cs = blk[0], blk[1]
                    gb = gm[rs, cs]
                    blk[2] = b2 * blk[2] + weight * gb @ gb.T
                    blk[3] = b2 * blk[3] + weight * gb.T @ gb
                    if recompute:
                        blk[4] = _inverse_root(blk[2] / bc2, hp["exponent"], hp["matrix_eps"])
                        blk[5] = _inverse_root(blk[3] / bc2, hp["exponent"], hp["matrix_eps"])
                    if t >= start:
                        pre = blk[4] @ gbm[rs, cs] @ blk[5]
                        if hp["grafting"] is not None:
                            pre = pre * grm[rs, cs].norm() / (pre.norm() + 1e-16)
                        dm[rs, cs] = pre
                direction = dm.reshape(g.shape)
            lr = hp["lr"](t - 1) if callable(hp["lr"]) else hp["lr"]
            p[k] = p[k] - lr * (direction + hp["weight_decay"] * p[k])
    return p
