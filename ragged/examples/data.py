"""A synthetic language-modelling task whose loss visibly falls (no downloads).

Each sequence is a walk of a fixed sparse random Markov chain over the vocabulary (every token
has ``branching`` possible successors), and its second half repeats its first half. A model first
learns the bigram statistics (loss drops from ``ln(vocab)`` towards ``ln(branching)``), then
learns to copy with attention (the second half becomes predictable and the loss keeps falling
towards ``ln(branching) / 2``).

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

import torch

from ragged._errors import RaggedValueError

__all__ = ["SyntheticLM", "rank_slice"]


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
