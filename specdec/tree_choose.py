"""A dynamic tree's best nodes by score, in torch: the reference of the device programs' ``tree_choose``.

Kept apart from ``drafters.eagle_dynamic`` (which grows the trees) so the attention backends, which
dispatch it (``AttentionBackend.tree_choose``), import it without importing the drafters.
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
