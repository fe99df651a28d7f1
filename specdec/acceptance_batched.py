"""Greedy verification of a whole batch of trees on the device: one tensor program, no host reads.

Rows are laid out padded: verify token i of row b sits at [b, i] of (B, Q) tensors; token 0 is the
root (the pending token), tokens 1..n-1 are tree nodes in topological order, the rest padding.
The result is what ``specdec.acceptance.verify_greedy`` returns for each row, packed in one
(B, Q + 2) tensor so that the host reads a step's outcome with a single copy.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accept_greedy_padded(
    tokens: Tensor,  # (B, Q) int64 verify tokens
    parents: Tensor,  # (B, Q) int64 verify index of each token's parent; -1 for the root and padding
    tree_mask: Tensor,  # (B, Q) int64 bit j set iff verify token j is the token itself or an ancestor
    target_argmax: Tensor,  # (B, Q) int64 target argmax at each verify token
    num_tokens: Tensor,  # (B,) int64 real verify tokens per row (root included; 0 for padded rows)
) -> Tensor:  # (B, Q + 2) int64: [accepted count m, bonus token, accepted verify indices (first m valid)]
    """Per row: the longest path whose every token equals the target argmax at its parent (the lowest
    index wins among equal siblings), and the bonus token, the target argmax at the path's end."""
    b, q = tokens.shape
    idx = torch.arange(q, device=tokens.device)  # (Q,)
    is_node = (idx.view(1, -1) < num_tokens.view(-1, 1)) & (parents >= 0)  # (B, Q)
    want = target_argmax.gather(1, parents.clamp(min=0))  # (B, Q) target's choice after the parent
    correct = is_node & (tokens == want)
    earlier_sibling = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (idx.view(1, 1, -1) < idx.view(1, -1, 1))
    correct &= ~(earlier_sibling & correct.unsqueeze(1)).any(-1)  # (B, Q): only the first correct sibling
    ok = correct | (idx == 0).view(1, -1)  # the root is always on the path
    ok_bits = (ok.long() << idx.view(1, -1)).sum(1, keepdim=True)  # (B, 1) distinct bits: sum == or
    on_path = is_node & ((tree_mask & ~ok_bits) == 0)  # every ancestor (and the token) correct
    count = on_path.sum(1, keepdim=True)  # (B, 1)
    order = torch.where(on_path, idx, idx + q).argsort(dim=1)  # (B, Q) path indices first, in order
    last = torch.where(count > 0, order.gather(1, (count - 1).clamp(min=0)), 0)  # (B, 1) deepest node
    bonus = target_argmax.gather(1, last)  # (B, 1)
    return torch.cat([count, bonus, order], dim=1)


def unpack_greedy(row: list[int]) -> tuple[list[int], int]:
    """(accepted tree node indices, bonus token) of one host row of ``accept_greedy_padded``."""
    m = row[0]
    return [i - 1 for i in row[2:2 + m]], row[1]


def greedy_step_outcome(
    tokens: Tensor,  # (B, Q) int64 verify tokens
    parents: Tensor,  # (B, Q) int64 (-1: the root and padding)
    tree_mask: Tensor,  # (B, Q) int64 ancestor bitmasks
    target_argmax: Tensor,  # (B, Q) int64
    finite: Tensor,  # (B, Q) bool: the token's logits are all finite
    num_tokens: Tensor,  # (B,) int64 real verify tokens per row
) -> Tensor:  # (B, Q + 3) int64
    """What a graphed target step hands the host: ``accept_greedy_padded``'s (B, Q + 2), then 1 when every real
    token of the row has finite logits (0: the row is failed). A decode step (Q = 1) accepts nothing: its
    bonus token is the argmax."""
    b, q = tokens.shape
    real = torch.arange(q, device=tokens.device).view(1, -1) < num_tokens.view(-1, 1)  # (B, Q)
    ok = (finite | ~real).all(1, keepdim=True).long()  # (B, 1)
    if q == 1:
        zeros = torch.zeros_like(target_argmax)
        return torch.cat([zeros, target_argmax, zeros, ok], 1)
    return torch.cat([accept_greedy_padded(tokens, parents, tree_mask, target_argmax, num_tokens), ok], 1)
