"""A synthetic language-modelling task whose loss visibly falls (no downloads).

Each sequence is a walk of a fixed sparse random Markov chain over the vocabulary (every token
has ``branching`` possible successors), and its second half repeats its first half. A model first
learns the bigram statistics (loss drops from ``ln(vocab)`` towards ``ln(branching)``), then
learns to copy with attention (the second half becomes predictable and the loss keeps falling
towards ``ln(branching) / 2``).

[Note: when the copy task counts as learnt]
A model that predicts each token from the one before it (and its position), which is all the
chain itself offers, cannot go below :attr:`SyntheticLM.no_copy_floor`: the exact conditional
entropy of the data given the previous token, 1.446 for the defaults, a little above
``ln(branching)`` = 1.39 because the first copied token cannot be guessed from its predecessor.
Anything lower needs the first half of the sequence: the model copies. :meth:`SyntheticLM.verdict` calls
a run learnt when its final loss (mean of the last tenth of the steps) is below that floor,
and failed when the loss did not fall at all.

Batches are a pure function of ``(seed, step)``: every rank builds the same global batch and
takes its own rows (:func:`rank_slice`), so a single-process reference sees exactly the data the
ranks see together.

Examples:
    >>> from ragged.examples.data import SyntheticLM
    >>> task = SyntheticLM(vocab_size=32, seq_len=8, seed=0)
    >>> inputs, targets = task.batch(step=0, batch_size=2)
    >>> inputs.shape, bool((inputs[:, 1:] == targets[:, :-1]).all())
    (torch.Size([2, 8]), True)
    >>> x = task.sequences(step=0, batch_size=2)
    >>> bool((x[:, :4] == x[:, 5:9]).all())
    True
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ragged._errors import RaggedValueError

__all__ = ["SyntheticLM", "Verdict", "rank_slice"]


class Verdict(NamedTuple):
    """What a run's losses say about the task (see [Note: when the copy task counts as learnt]).

    Attributes:
        learnt: the final loss is below the no-copy floor (``None``: too few steps to judge).
        ok: False when the loss did not fall (or is not finite): the job should fail.
        line: one human-readable line, ``"verdict: ..."``.
    """

    learnt: bool | None
    ok: bool
    line: str


class SyntheticLM:
    """Markov-chain-then-copy token sequences.

    Args:
        vocab_size: number of token ids.
        seq_len: model input length (each stored sequence has ``seq_len + 1`` tokens).
        seed: fixes the chain and every batch.
        branching: successors per token in the chain.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int = 0, branching: int = 4):
        if vocab_size < 2 or seq_len < 2 or branching < 1:
            raise RaggedValueError(f"need vocab_size >= 2, seq_len >= 2, branching >= 1; got {vocab_size}, {seq_len}, {branching}.")
        self.vocab_size, self.seq_len, self.seed, self.branching = vocab_size, seq_len, seed, branching
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)

    @property
    def floor(self) -> float:
        """Cross entropy of a perfect model (nats per token, averaged over the sequence)."""
        n = self.seq_len + 1
        half = (n + 1) // 2
        return math.log(self.branching) * (half - 1) / self.seq_len

    @property
    def no_copy_floor(self) -> float:
        """The lowest loss without copying: mean over targets of H(token | previous token),
        exact for this chain (see [Note: when the copy task counts as learnt]).

        Examples:
            >>> task = SyntheticLM(vocab_size=256, seq_len=64, seed=1)
            >>> round(math.log(task.branching), 3), round(task.no_copy_floor, 3), round(task.floor, 3)
            (1.386, 1.446, 0.693)
        """
        v, n = self.vocab_size, self.seq_len + 1
        half = (n + 1) // 2
        step = torch.zeros(v, v, dtype=torch.float64)  # P[x, y] = p(next = y | x)
        step.index_put_((torch.arange(v).repeat_interleave(self.branching), self.successors.flatten()),
                        torch.full((v * self.branching,), 1.0 / self.branching, dtype=torch.float64), accumulate=True)
        row_entropy = -(step * torch.log(step.clamp_min(1e-300))).sum(1)
        # chain steps t = 1 .. half-1 (the second half repeats them, given the repeated predecessor)
        marginal, chain = torch.full((v,), 1.0 / v, dtype=torch.float64), []
        reach = torch.diag(marginal)  # joint of (token 0, token t)
        for _ in range(1, half):
            chain.append(float(marginal @ row_entropy))
            marginal, reach = marginal @ step, reach @ step
        # the first copied token is token 0, predicted from token half-1: H(X0 | X_{half-1})
        joint = reach.clamp_min(1e-300)
        boundary = float(-(reach * torch.log(joint / joint.sum(0, keepdim=True))).sum())
        targets = chain + [boundary] + chain[: n - 1 - half]
        return sum(targets) / self.seq_len

    def verdict(self, losses, *, min_steps: int = 1) -> Verdict:
        """Judges a run by its losses (one per step): learnt, still learning, or failed.

        Args:
            losses: the loss of every step, in order.
            min_steps: fewer steps than this are not judged (the main job: warmup + 10).

        Examples:
            >>> task = SyntheticLM(vocab_size=256, seq_len=64, seed=1)
            >>> task.verdict([5.6] + [1.2] * 9).line[:37]
            'verdict: learnt, loss 5.600 -> 1.200 '
            >>> task.verdict([5.6] * 10)[:2], task.verdict([5.6] + [3.0] * 9)[:2]
            ((False, False), (False, True))
            >>> task.verdict([5.6, 5.5], min_steps=20)[:2]
            (None, True)
        """
        losses = [float(x) for x in losses]
        if not losses:
            return Verdict(None, True, "verdict: not judged, no steps ran.")
        tail = losses[-max(1, len(losses) // 10):]
        final, first = sum(tail) / len(tail), losses[0]
        trend = f"loss {first:.3f} -> {final:.3f} ({'mean of the last ' + str(len(tail)) + ' steps' if len(tail) > 1 else 'last step'})"
        floor = self.no_copy_floor
        if not math.isfinite(final):
            return Verdict(False, False, f"verdict: NOT LEARNT, the loss is {final} (training diverged).")
        if len(losses) < min_steps:
            return Verdict(None, True, f"verdict: not judged, {len(losses)} steps are fewer than the {min_steps} it takes; {trend}.")
        if final >= first - 0.05:
            return Verdict(False, False, f"verdict: NOT LEARNT, the loss did not fall: {trend} over {len(losses)} steps.")
        if final >= floor:
            return Verdict(False, True, f"verdict: not learnt yet, {trend} fell but not below {floor:.3f}, the best "
                                        "loss without copying (train longer: more --steps).")
        return Verdict(True, True, f"verdict: learnt, {trend} is below {floor:.3f}, the best loss without copying "
                                   f"(about ln {self.branching} = {math.log(self.branching):.2f}): the model copies "
                                   f"the repeated half (a perfect model reaches {self.floor:.2f}).")

    def sequences(self, step: int, batch_size: int) -> torch.Tensor:
        """``batch_size x (seq_len + 1)`` tokens for ``step`` (int64)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        n = self.seq_len + 1
        half = (n + 1) // 2
        walk = torch.empty(batch_size, half, dtype=torch.long)
        walk[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=g)
        choice = torch.randint(0, self.branching, (batch_size, half), generator=g)
        for t in range(1, half):
            walk[:, t] = self.successors[walk[:, t - 1], choice[:, t]]
        return torch.cat([walk, walk], dim=1)[:, :n]

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``batch_size x seq_len``: targets are inputs shifted by one."""
        seq = self.sequences(step, batch_size)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def rank_slice(batch, rank: int, world_size: int):
    """This rank's rows of a global batch (a tuple of tensors with a leading batch dim).

    Examples:
        >>> import torch
        >>> rank_slice((torch.arange(6), torch.arange(6) * 10), 1, 3)
        (tensor([2, 3]), tensor([20, 30]))
    """
    n = batch[0].shape[0]
    if n % world_size:
        raise RaggedValueError(f"global batch size {n} is not a multiple of world_size={world_size}; "
                         "pick a batch size divisible by the number of ranks.")
    k = n // world_size
    return tuple(x[rank * k : (rank + 1) * k] for x in batch)
