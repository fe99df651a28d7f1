"""Dynamic-tree frontier selection on the device, for a whole batch at once.

A dynamic tree grows by levels. At each level every frontier node proposes its most probable
draft tokens; a candidate's score is its probability times its parent's cumulative score, and each
row keeps its best candidates. Everything here is tensor ops over all rows and nodes; the caller
reads the result with one device->host copy.

Tie rule (deterministic, and the host rule's order wherever there is no tie): a node's candidates
rank by probability, equal probabilities the lower token id first; a row's candidates rank by
score, equal scores the lower frontier position first, then the higher rank within the node. The
chosen children come back ordered by (frontier position, rank within the node), which is the host
rule's (parent, -score) order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from specdec.acceptance import shape_probs

Shape = tuple[float, int, float, float] | None  # (temperature, top_k, top_p, min_p) of shape_probs; None: softmax


def shaped_probs(logits: Tensor, groups: list[tuple[Shape, int]]) -> Tensor:
    """(F, V) logits -> (F, V) draft probabilities, float32 or wider.

    ``groups`` splits the rows into consecutive runs ``(shape, count)`` (counts sum to F): shape None
    is the softmax of the float32 logits (greedy rows), otherwise the rows' ``shape_probs`` with
    those parameters. A row's result does not depend on the other rows.
    """
    if sum(n for _, n in groups) != logits.shape[0]:
        raise ValueError(f"groups: counts must sum to the {logits.shape[0]} logit rows, got {groups}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    parts, start = [], 0
    for shape, n in groups:
        x = logits[start:start + n]  # (n, V)
        parts.append((torch.softmax(x.float(), dim=-1) if shape is None else shape_probs(x, *shape)).to(dtype))
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # (F, V)


def top_candidates(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most probable tokens of each row of (F, V) ``probs`` (entries >= 0), most probable first,
    equal probabilities the lower token id first: (tokens (F, k) int64, their probabilities (F, k))."""
    vocab = probs.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}] (the vocabulary), got {k}")
    if probs.dtype == torch.float32:
        # non-negative float32 bits order like the values: one int64 key (bits, then -id) is unique
        ids = torch.arange(vocab, device=probs.device)
        keys = (probs.contiguous().view(torch.int32).long() << 32) | (vocab - 1 - ids)  # (F, V)
        tokens = vocab - 1 - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)  # (F, k)
    else:
        tokens = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]  # (F, k)
    return tokens, probs.gather(-1, tokens)


class FrontierLayout(NamedTuple):
    """Where each frontier node sits in the padded (rows, f_max) grid, and each row's child quota."""

    slots: Tensor  # (F,) int64: row * f_max + the node's frontier position
    takes: Tensor  # (rows,) int64: children the row may add (<= beam)
    rows: int
    f_max: int


def pick_children(cand_tokens: Tensor, cand_probs: Tensor, base: Tensor, layout: FrontierLayout,
                  beam: int) -> Tensor:
    """Each row's best children over all its frontier nodes' candidates.

    cand_tokens, cand_probs: (F, C) per frontier node (``top_candidates``); base: (F,) float64
    cumulative score of each frontier node. A candidate scores base * probability; zero-probability
    candidates are never chosen. Returns (rows, w, 3) float64 with w = min(beam, f_max * C): per row,
    its chosen children as (frontier position, token, score) in (frontier position, rank) order,
    then padding rows (-1, 0, -inf); a row holds at most ``layout.takes[row]`` children.
    """
    c = cand_probs.shape[1]
    width = layout.f_max * c
    score = (base[:, None] * cand_probs.double()).masked_fill(cand_probs <= 0, float("-inf"))  # (F, C)
    grid = score.new_full((layout.rows * layout.f_max, c), float("-inf")).index_copy_(0, layout.slots, score)
    grid = grid.view(layout.rows, width)  # (R, f_max * C), column = position * C + rank
    toks = cand_tokens.new_zeros(layout.rows * layout.f_max, c).index_copy_(0, layout.slots, cand_tokens)
    toks = toks.view(layout.rows, width)  # (R, f_max * C)
    w = min(beam, width)
    best = torch.sort(grid, dim=1, descending=True, stable=True).indices[:, :w]  # (R, w) ties: lower column
    keep = torch.arange(w, device=grid.device) < layout.takes[:, None]  # (R, w)
    keep &= grid.gather(1, best) > float("-inf")
    cols = torch.where(keep, best, width).sort(dim=1).values  # (R, w) chosen columns ascending, padding last
    ok = cols < width
    cols = cols.clamp_max(width - 1)
    pos = torch.where(ok, cols // c, -1)
    tok = torch.where(ok, toks.gather(1, cols), 0)
    val = torch.where(ok, grid.gather(1, cols), float("-inf"))
    return torch.stack([pos.double(), tok.double(), val], dim=-1)  # (R, w, 3)
