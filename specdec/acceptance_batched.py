"""Greedy verification of a whole batch of trees on the device: one tensor program, no host reads.

Rows are laid out padded: verify token i of row b sits at [b, i] of (B, Q) tensors; token 0 is the
root (the pending token), tokens 1..n-1 are tree nodes in topological order, the rest padding.
The result is what ``specdec.acceptance.verify_greedy`` returns for each row, packed in one
(B, Q + 2) tensor so that the host reads a step's outcome with a single copy. ``pad_trees`` lays host trees
out that way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specdec.tree import DraftTree


class PaddedTrees(NamedTuple):
    """Draft trees of a batch in the padded verify layout, on one device (``pad_trees`` builds them)."""

    tokens: Tensor  # (B, Q) int64 verify tokens (token 0, the root, is not read)
    parents: Tensor  # (B, Q) int64 parent verify index; -1 for the root and padding
    tree_mask: Tensor  # (B, Q) int64 bit j set iff verify token j is the token itself or an ancestor
    num_tokens: Tensor  # (B,) int64 real verify tokens per row (root included; 0 for a padded row)


def pad_trees(trees: Sequence[DraftTree], q: int, device: torch.device | str) -> PaddedTrees:
    """The trees in the padded layout with Q = q verify tokens per row (q >= every tree's nodes + 1, else
    ValueError naming the tree), from the trees' host views in one host->device copy."""
    rows_host = []  # per row: tokens, parents, masks (Q each), n
    for i, t in enumerate(trees):
        n = t.num_nodes + 1
        if n > q:
            raise ValueError(f"trees[{i}] has {n - 1} nodes; at most q - 1 = {q - 1} fit")
        rows_host.append([*tree_rows(t, q), n])
    dev = torch.tensor(rows_host, dtype=torch.int64).reshape(len(trees), 3 * q + 1).to(device)
    return PaddedTrees(dev[:, :q], dev[:, q:2 * q], dev[:, 2 * q:3 * q], dev[:, 3 * q])


def tree_rows(tree: DraftTree, q: int) -> list[int]:
    """(3 Q,) host ints of one tree's padded row: verify tokens (the root's 0), parents (-1: root, padding),
    tree masks (0: padding). The caller checks that the tree fits (nodes + 1 <= q)."""
    masks, parents = tree.verify_rows()
    pad = [0] * (q - len(parents))
    return [0, *tree.host.tokens, *pad, *parents, *[-1] * len(pad), *masks, *pad]


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
