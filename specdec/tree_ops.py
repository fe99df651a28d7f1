"""Torch references of the device draft programs' fused tree steps (each an op of ``specdec.kernels``, one
Triton launch on the Triton backend): where the nodes go (``tree_slots_reference``), each dynamic level's best
candidates (``select_level``) and the dynamic tree's best nodes (``choose``).

Kept apart from the drafters (which grow the trees) so the kernel modules, whose ops dispatch to these, import
them without importing the drafters.
"""

from __future__ import annotations

import torch
from torch import Tensor


def choose(scores: Tensor, tokens: Tensor, parents: Tensor, n: int) -> Tensor:
    """Each row's best ``n`` nodes of (b, M) ``scores`` (nodes in level order, ``parents``: region index of
    the parent, -1 the root; ties: the earlier node) as (b, 3, n): tokens, parent index among the chosen
    (-1: the root; also for a chosen node whose parent was not chosen, which the tie rule rules out
    for finite scores), rank by score; chosen nodes in level order."""
    b, m = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # (b, n) best first
    chosen = order.sort(dim=1).values  # (b, n) level order
    ar = torch.arange(n, device=scores.device).expand(b, n)
    rank = torch.full_like(scores, m, dtype=torch.int64).scatter_(1, order, ar).gather(1, chosen)  # (b, n)
    where = torch.full_like(scores, -1, dtype=torch.int64).scatter_(1, chosen, ar)  # (b, M): index among chosen
    par = parents.gather(1, chosen)  # (b, n) region index
    par = torch.where(par >= 0, where.gather(1, par.clamp(min=0)), -1)
    return torch.stack([tokens.gather(1, chosen), par, rank], 1)  # (b, 3, n)


def select_level(score: Tensor, top_val: Tensor, top_idx: Tensor, masks: Tensor,
                 bits: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A dynamic tree's next level from the K nodes per row of this one: their scores ``score`` (b, K), each
    node's K best children's log probabilities ``top_val`` (b, K, K) and draft ids ``top_idx`` (b, K, K),
    the nodes' ancestor bitmasks ``masks`` (b, K) and the next level's own bits ``bits`` (K,). The row's K
    best candidates by parent score + log probability (``torch.topk``), best first: their scores (b, K),
    parent positions (b, K), draft ids (b, K) and bitmasks (b, K: the parent's | the node's bit)."""
    b, k = score.shape
    score, best = torch.topk((score.unsqueeze(-1) + top_val).view(b, k * k), k, dim=-1)  # (b, K)
    ppos = best // k
    return score, ppos, top_idx.view(b, k * k).gather(1, best), masks.gather(1, ppos) | bits


def tree_slots_reference(seq_lens: Tensor, num_tokens: Tensor, block_tables: Tensor, rows: Tensor, nodes: Tensor,
                         depths: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """The KV slot and position (T,) of each forwarded tree node: node i of batch row ``rows[i]`` at region
    index ``nodes[i]`` and depth ``depths[i]`` sits at logical position seq_lens[row] + nodes[i] (slot from the
    row's ``block_tables`` (b, W) with ``block_size``; -1 for a padded row, num_tokens[row] == 0), position
    seq_lens[row] + depths[i]."""
    length = seq_lens.index_select(0, rows)  # (T,) len(tokens): the tree region starts there
    logical = length + nodes
    blocks = block_tables.flatten().index_select(0, rows * block_tables.shape[1] + logical // block_size)
    live = num_tokens.index_select(0, rows) > 0
    return torch.where(live, blocks * block_size + logical % block_size, -1), length + depths
