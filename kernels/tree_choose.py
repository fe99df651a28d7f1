"""A dynamic tree's ranking steps in one launch each (references: ``specdec.tree_ops``).

``tree_level`` takes a level's best K of the K * K candidates (parent score + child log probability)
with their parent positions, draft ids and ancestor bitmasks: one launch where torch takes six (add,
top-k, divide, two gathers, or). Candidates order as in ``topk_small`` (ties: the lower candidate index,
NaN first), which ``torch.topk`` does not promise on ties.

``tree_choose`` takes the tree's best nodes (``choose``).

The dynamic device program calls the ops ``tree_level`` and ``tree_choose``: these kernels on the Triton backend
for the shapes they take, the torch references otherwise.

The torch version sorts twice and scatters and gathers: about fifteen small launches at the end of
every dynamic draft program. Here one program per row holds the row's M <= ``MAX_NODES`` nodes and
compares every pair: a node's rank is how many nodes come before it (a higher score, or an equal
score and an earlier node: the stable descending sort), it is chosen when its rank is below n, and
its place among the chosen (level order) is how many chosen nodes precede it. Scores order as in
``topk`` (``order_key``): -0.0 ties +0.0 and NaN ranks above every number.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor, next_pow2
from specdec.kernels.topk import order_key
from specdec.kernels.triton_import import tl, triton

from specdec.tree_ops import choose, select_level

MAX_NODES = 256  # one program compares M x M pairs in registers
MAX_WIDTH = 16  # tree_level: one program holds a row's K * K candidates
_INT64_MIN: tl.constexpr = tl.constexpr(-(1 << 63))


@triton.jit
def _tree_level_kernel(score_ptr, val_ptr, idx_ptr, mask_ptr, bits_ptr, s_out, p_out, t_out, m_out,
                       K: tl.constexpr, KK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, KK_P)  # candidate c: child c % K of node c // K
    ok = c < K * K
    cand = tl.load(score_ptr + row * K + c // K, mask=ok, other=0.0) + tl.load(val_ptr + row * K * K + c, mask=ok,
                                                                               other=0.0)
    packed = (order_key(cand).to(tl.int64) << 32) | (0x7FFFFFFF - c).to(tl.int64)  # ties: the lower candidate
    packed = tl.where(ok, packed, _INT64_MIN)
    for i in range(K):
        best = tl.max(packed, axis=0)
        packed = tl.where(packed == best, _INT64_MIN, packed)
        col = 0x7FFFFFFF - (best & 0x7FFFFFFF)
        parent = col // K
        out = row * K + i
        tl.store(s_out + out, tl.load(score_ptr + row * K + parent) + tl.load(val_ptr + row * K * K + col))
        tl.store(p_out + out, parent.to(tl.int64))
        tl.store(t_out + out, tl.load(idx_ptr + row * K * K + col))
        tl.store(m_out + out, tl.load(mask_ptr + row * K + parent) | tl.load(bits_ptr + i))


def tree_level_triton(score: torch.Tensor, top_val: torch.Tensor, top_idx: torch.Tensor, masks: torch.Tensor,
                      bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_level`` in one launch: score (b, K) float32, top_val (b, K, K) float32, top_idx (b, K, K)
    int64, masks (b, K) int64, bits (K,) int64 (K <= MAX_WIDTH) -> (scores, parent positions, draft ids,
    bitmasks) (b, K) each; equal candidates: the lower candidate index first (the module docstring)."""
    check_tensor("score", score, shape=(None, None), dtypes=(torch.float32,))
    b, k = score.shape
    if not 1 <= k <= MAX_WIDTH:
        raise ValueError(f"score must have 1 to {MAX_WIDTH} nodes per row (the width), got {k}")
    check_tensor("top_val", top_val, shape=(b, k, k), dtypes=(torch.float32,), device=score.device)
    check_tensor("top_idx", top_idx, shape=(b, k, k), dtypes=(torch.int64,), device=score.device)
    check_tensor("masks", masks, shape=(b, k), dtypes=(torch.int64,), device=score.device)
    check_tensor("bits", bits, shape=(k,), dtypes=(torch.int64,), device=score.device)
    check_launchable(_tree_level_kernel, score.device)
    outs = (torch.empty_like(score), *(torch.empty((b, k), dtype=torch.int64, device=score.device) for _ in range(3)))
    if b:
        _tree_level_kernel[(b,)](score.contiguous(), top_val.contiguous(), top_idx.contiguous(), masks.contiguous(),
                                 bits.contiguous(), *outs, K=k, KK_P=max(16, next_pow2(k * k)), num_warps=4)
    return outs


@triton.jit
def _tree_choose_kernel(scores_ptr, tokens_ptr, parents_ptr, out_ptr, m, n, M_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, M_P)
    ok = i < m
    key = order_key(tl.load(scores_ptr + row * m + i, mask=ok, other=0.0).to(tl.float32))  # (M_P,)
    ii, jj = i[:, None], i[None, :]  # (M_P, 1), (1, M_P): node i (a row), node j (a column)
    ahead = ok[None, :] & ((key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (jj < ii)))
    rank = tl.sum(ahead.to(tl.int32), axis=1)  # (M_P,) nodes before i in the stable descending order
    chosen = ok & (rank < n)
    place = tl.sum((chosen[None, :] & (jj < ii)).to(tl.int32), axis=1)  # chosen nodes before i
    parent = tl.load(parents_ptr + row * m + i, mask=ok, other=-1)  # region index, -1: the root
    hit = (jj == parent[:, None]) & chosen[None, :]  # (M_P, M_P): j is i's parent and chosen
    par = tl.sum(tl.where(hit, place[None, :] + 1, 0), axis=1) - 1  # its place; -1: root or not chosen
    out = out_ptr + row * 3 * n + place
    tl.store(out, tl.load(tokens_ptr + row * m + i, mask=ok, other=0), mask=chosen)
    tl.store(out + n, par.to(tl.int64), mask=chosen)
    tl.store(out + 2 * n, rank.to(tl.int64), mask=chosen)


def tree_choose_triton(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int) -> torch.Tensor:
    """``choose`` in one launch: each row's best ``n`` of the (b, M) ``scores`` (float; M <= MAX_NODES) as
    (b, 3, n) int64: ``tokens`` (b, M) int64 of the chosen in level order, their parent's place among the
    chosen (``parents`` (b, M) int64: region index, -1 the root; -1 also when the parent is not chosen),
    their rank by score. Equal to ``choose`` exactly (ties: the earlier node)."""
    check_tensor("scores", scores, shape=(None, None), dtypes=FLOAT_DTYPES)
    b, m = scores.shape
    check_tensor("tokens", tokens, shape=(b, m), dtypes=(torch.int64,), device=scores.device)
    check_tensor("parents", parents, shape=(b, m), dtypes=(torch.int64,), device=scores.device)
    if not 1 <= m <= MAX_NODES:
        raise ValueError(f"scores must have 1 to {MAX_NODES} nodes per row, got {m}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= m:
        raise ValueError(f"n must be an int in [1, {m}] (the nodes per row), got {n!r}")
    check_launchable(_tree_choose_kernel, scores.device)
    out = torch.empty((b, 3, n), dtype=torch.int64, device=scores.device)
    if b:
        _tree_choose_kernel[(b,)](scores.contiguous(), tokens.contiguous(), parents.contiguous(), out, m, n,
                                  M_P=max(16, next_pow2(m)), num_warps=4)
    return out


def tree_level(score, top_val, top_idx, masks, bits, *, use_triton: bool):
    """A dynamic tree's next level (scores, parent positions, draft ids, bitmasks; (b, K) each): ``tree_level_triton``
    (one launch; ties: the lower candidate) when ``use_triton`` (the Triton backend) for float32 scores of width
    <= MAX_WIDTH, the torch ``select_level`` otherwise."""
    fits = score.shape[-1] <= MAX_WIDTH and score.dtype == torch.float32 and top_val.dtype == torch.float32
    return (tree_level_triton if use_triton and fits else select_level)(score, top_val, top_idx, masks, bits)


def tree_choose(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int, *,
                use_triton: bool) -> torch.Tensor:
    """A dynamic tree's best ``n`` nodes per row as (b, 3, n) int64: ``tree_choose_triton`` (one launch) when
    ``use_triton`` for rows of at most MAX_NODES nodes, the torch ``choose`` otherwise."""
    fits = scores.shape[-1] <= MAX_NODES
    return (tree_choose_triton if use_triton and fits else choose)(scores, tokens, parents, n)
