"""The inputs of the logit penalties at the verify tokens of a step (``SamplingParams.repetition_penalty``,
``presence_penalty`` and ``frequency_penalty``).

The penalty of a token depends on its context: at verify token j of a row (0 the root, the pending token) the
context is the request's tokens (prompt and committed output, the pending token included) plus the draft tokens
on j's path (its ancestors and j itself). So every verify token gets its own penalty inputs: the row's host
context (``ContextPenalty``, (B, V) tensors copied to the device) joined on the device with the path tokens that
the tree masks select. The repetition penalty reads which tokens the prompt and output hold, the presence and
frequency penalties how often each token occurs in the output alone (as in vLLM). Rules apply them to the raw
logits (``acceptance.repetition_penalty``, then ``acceptance.count_penalty``) before shaping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specdec.acceptance import count_penalty, repetition_penalty


class OutputCounts(NamedTuple):
    """Each row's presence and frequency penalties and its committed output's token counts, on the device."""

    counts: Tensor  # (B, V) float32: the token's occurrences in the row's output so far
    presence: Tensor  # (B,) float32; 0 = off
    frequency: Tensor  # (B,) float32; 0 = off


class ContextPenalty(NamedTuple):
    """Each row's penalties and the tokens of its committed context, on the device."""

    present: Tensor  # (B, V) bool: the token is in the row's prompt or output so far
    penalty: Tensor  # (B,) float32 repetition penalty; 1 = off
    output: OutputCounts | None = None  # None: no row has a presence or frequency penalty

    @staticmethod
    def of(reqs: Sequence, rows: Sequence[int], b: int, vocab: int, device: torch.device | str) -> ContextPenalty:
        """The penalties of rows ``rows`` of ``reqs`` (each with ``tokens``, ``output_ids`` and ``params``) in a
        batch of ``b`` rows; other rows are unpenalized. One host->device copy of each tensor."""
        present = np.zeros((b, vocab), dtype=bool)
        penalty = np.ones(b, dtype=np.float32)
        for i in rows:
            present[i, np.asarray(reqs[i].tokens, dtype=np.int64)] = True
            penalty[i] = reqs[i].params.repetition_penalty
        counted = [i for i in rows if reqs[i].params.presence_penalty or reqs[i].params.frequency_penalty]
        output = _output_counts(reqs, counted, b, vocab, device) if counted else None
        return ContextPenalty(torch.from_numpy(present).to(device), torch.from_numpy(penalty).to(device), output)

    def at_tokens(self, tokens: Tensor, tree_mask: Tensor) -> Tensor:
        """(B, Q, V) bool: the context of each verify token, the row's ``present`` plus the tokens (B, Q) whose bit
        is set in its tree mask (B, Q) (its path: itself and its ancestors; the root's bit 0 is not read, the
        pending token is in ``present`` already)."""
        out, where = _on_path(self.present, tokens, tree_mask)
        return out.scatter_(-1, where, True)[..., :-1]

    def at_counts(self, tokens: Tensor, tree_mask: Tensor) -> Tensor:
        """(B, Q, V) float32: each verify token's output counts, the row's ``output.counts`` plus one for each
        occurrence among the tokens on its path (``at_tokens``'s path: the root's bit is not read, the pending
        token is counted already when it is output)."""
        out, where = _on_path(self.output.counts, tokens, tree_mask)
        return out.scatter_add_(-1, where, torch.ones(where.shape, dtype=out.dtype, device=out.device))[..., :-1]

    def apply(self, logits: Tensor, tokens: Tensor, tree_mask: Tensor) -> Tensor:
        """(B, Q, V) float32-or-wider logits at the verify tokens (B, Q) with each one's penalties applied: the
        repetition penalty, then the frequency and presence penalties."""
        x = repetition_penalty(logits, self.at_tokens(tokens, tree_mask), self.penalty.view(-1, 1, 1))
        if self.output is None:
            return x
        return count_penalty(x, self.at_counts(tokens, tree_mask), self.output.presence.view(-1, 1, 1),
                             self.output.frequency.view(-1, 1, 1))


def _output_counts(reqs: Sequence, rows: Sequence[int], b: int, vocab: int, device) -> OutputCounts:
    """The ``OutputCounts`` of rows ``rows`` of ``reqs`` in a batch of ``b`` rows (the others count nothing)."""
    counts = np.zeros((b, vocab), dtype=np.float32)
    presence, frequency = np.zeros(b, dtype=np.float32), np.zeros(b, dtype=np.float32)
    for i in rows:
        counts[i] = np.bincount(np.asarray(reqs[i].output_ids, dtype=np.int64), minlength=vocab)[:vocab]
        presence[i], frequency[i] = reqs[i].params.presence_penalty, reqs[i].params.frequency_penalty
    return OutputCounts(*(torch.from_numpy(a).to(device) for a in (counts, presence, frequency)))


def _on_path(context: Tensor, tokens: Tensor, tree_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(out (B, Q, V + 1): ``context`` (B, V) at each verify token, column V zero; where (B, Q, Q) int64: at
    [b, j, i] token i of row b where it is on j's path (bit i > 0 of j's tree mask), else V). Scattering the
    path tokens into ``out`` at ``where`` and dropping column V adds each verify token's path to its context."""
    b, q = tokens.shape
    vocab = context.shape[1]
    bits = torch.arange(q, device=tokens.device)
    on_path = ((tree_mask.unsqueeze(-1) >> bits) & 1).bool() & (bits > 0)  # (B, Q, Q): token i on j's path
    where = torch.where(on_path, tokens.unsqueeze(1), vocab)  # (B, Q, Q)
    out = torch.zeros(b, q, vocab + 1, dtype=context.dtype, device=tokens.device)
    out[..., :vocab] = context.unsqueeze(1)
    return out, where


def penalized_rows(reqs: Sequence, rows: Sequence[int]) -> list[int]:
    """The rows of ``rows`` whose request has a repetition, presence or frequency penalty."""
    return [i for i in rows if reqs[i].params.penalized]
