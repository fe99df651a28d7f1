"""The inputs of a repetition penalty at the verify tokens of a step (``SamplingParams.repetition_penalty``).

The penalty of a token depends on its context: at verify token j of a row (0 the root, the pending token) the
context is the request's tokens (prompt and committed output, the pending token included) plus the draft tokens
on j's path (its ancestors and j itself). So every verify token gets its own set of penalized tokens: the row's
host context (``ContextPenalty``, one (B, V) mask copied to the device) joined on the device with the path tokens
that the tree masks select. Rules apply it to the raw logits (``acceptance.repetition_penalty``) before shaping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specdec.acceptance import repetition_penalty


class ContextPenalty(NamedTuple):
    """Each row's repetition penalty and the tokens of its committed context, on the device."""

    present: Tensor  # (B, V) bool: the token is in the row's prompt or output so far
    penalty: Tensor  # (B,) float32; 1 = off

    @staticmethod
    def of(reqs: Sequence, rows: Sequence[int], b: int, vocab: int, device: torch.device | str) -> ContextPenalty:
        """The penalty of rows ``rows`` of ``reqs`` (each with ``tokens`` and ``params``) in a batch of ``b`` rows;
        other rows are unpenalized. One host->device copy of each tensor."""
        present = np.zeros((b, vocab), dtype=bool)
        penalty = np.ones(b, dtype=np.float32)
        for i in rows:
            present[i, np.asarray(reqs[i].tokens, dtype=np.int64)] = True
            penalty[i] = reqs[i].params.repetition_penalty
        return ContextPenalty(torch.from_numpy(present).to(device), torch.from_numpy(penalty).to(device))

    def at_tokens(self, tokens: Tensor, tree_mask: Tensor) -> Tensor:
        """(B, Q, V) bool: the context of each verify token, the row's ``present`` plus the tokens (B, Q) whose bit
        is set in its tree mask (B, Q) (its path: itself and its ancestors; the root's bit 0 is not read, the
        pending token is in ``present`` already)."""
        b, q = tokens.shape
        vocab = self.present.shape[1]
        bits = torch.arange(q, device=tokens.device)
        on_path = ((tree_mask.unsqueeze(-1) >> bits) & 1).bool() & (bits > 0)  # (B, Q, Q): token i on j's path
        where = torch.where(on_path, tokens.unsqueeze(1), vocab)  # (B, Q, Q); column V collects the others
        out = torch.zeros(b, q, vocab + 1, dtype=torch.bool, device=tokens.device)
        out[..., :vocab] = self.present.unsqueeze(1)
        return out.scatter_(-1, where, True)[..., :vocab]

    def apply(self, logits: Tensor, tokens: Tensor, tree_mask: Tensor) -> Tensor:
        """(B, Q, V) float32-or-wider logits at the verify tokens (B, Q) with each one's penalty applied."""
        return repetition_penalty(logits, self.at_tokens(tokens, tree_mask), self.penalty.view(-1, 1, 1))


def penalized_rows(reqs: Sequence, rows: Sequence[int]) -> list[int]:
    """The rows of ``rows`` whose request has a repetition penalty."""
    return [i for i in rows if reqs[i].params.penalized]
