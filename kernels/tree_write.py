"""The kept trees of a dynamic draft program written into a verify bucket's inputs, one program per row (reference:
the torch ops of ``specdec.tree_writer.TreeWriter._build`` without ``use_triton``: ``best_nodes_on_device`` +
``write_trees`` + ``tree_top``; they stay there, since a reference here importing them would close an import
circle).

Each row of the program's output (R, 3, N: node tokens, parents, score ranks) keeps its nodes of rank < n in level
order, parents re-indexed among the kept (-1: the root, also for a node whose parent was not kept); node k of the
kept tree becomes verify query 1 + k: its token, its position (the root's + 1 + depth), its mask (the root's bit and
its ancestors' bits, itself included, shifted by one) and its parent (+ 1). In torch that is some thirty small
launches (gathers, a sort, a cumulative sum, one gather, add and select per level, a masked write per input);
replayed from a graph each still costs the GPU a few microseconds. Here the N <= 64 nodes of a row sit in one
block: index arithmetic between nodes (a kept node's new index, a parent's, a gather along parents) is a
comparison over the block's (N, N) pairs, reduced.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import check_launchable, check_tensor, next_pow2
from specdec.kernels.triton_import import tl, triton


@triton.jit
def _tree_write_kernel(src_ptr, ids_ptr, pos_ptr, mask_ptr, par_ptr, live_ptr, tok_out_ptr, par_out_ptr, top_ptr,
                       m, n, levels, q, BLOCK: tl.constexpr, LIVE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    valid = c < m
    base = src_ptr + row * 3 * m
    tokens = tl.load(base + c, mask=valid, other=0)
    parents = tl.load(base + m + c, mask=valid, other=-1).to(tl.int32)
    ranks = tl.load(base + 2 * m + c, mask=valid, other=0)
    keep = valid & (ranks < n)
    ci = c[:, None]  # (BLOCK, 1): the node (or kept slot) a row of a pair table is about
    cj = c[None, :]  # (1, BLOCK): the other node of the pair
    kj = keep[None, :]
    new = tl.sum((kj & (cj < ci)).to(tl.int32), axis=1)  # (BLOCK,) a kept column's index among the kept
    up = parents[:, None]
    parent_kept = tl.sum((kj & (cj == up)).to(tl.int32), axis=1) > 0
    parent_new = tl.sum((kj & (cj < up)).to(tl.int32), axis=1)
    kept_parent = tl.where((parents >= 0) & parent_kept, parent_new, -1)
    # slot k of the kept tree takes the kept column whose new index is k
    take = kj & (new[None, :] == ci)  # (slot k, column j)
    nk = tl.minimum(n, m)
    slot = c < nk
    ktok = tl.sum(tl.where(take, tokens[None, :], 0), axis=1)
    kpar = tl.where(slot, tl.sum(tl.where(take, kept_parent[None, :], 0), axis=1), -1)
    # depth (0 under the root) and ancestor bits (self included) along kept parents: after r rounds every node
    # less than r + 1 deep is right (parents come before their children)
    own = tl.where(slot, tl.full([BLOCK], 1, tl.int64) << c.to(tl.int64), 0)
    anc = own
    dep = tl.zeros([BLOCK], dtype=tl.int32)
    has = kpar >= 0
    along = kpar[:, None] == cj  # (node k, its parent j)
    for _ in range(levels - 1):
        anc = tl.where(has, tl.sum(tl.where(along, anc[None, :], 0), axis=1) + own, own)
        dep = tl.where(has, tl.sum(tl.where(along, dep[None, :], 0), axis=1) + 1, 0)
    out = row * nk + c
    tl.store(tok_out_ptr + out, ktok, mask=slot)
    tl.store(par_out_ptr + out, kpar.to(tl.int64), mask=slot)
    tl.store(top_ptr + row + c, (tl.max(tl.where(slot, dep, -1), axis=0) + 1).to(tl.int64) + c * 0, mask=c == 0)
    if LIVE:
        write = slot & (tl.load(live_ptr + row + c * 0) != 0)
    else:
        write = slot
    at = row * q + 1 + c  # the kept node's verify query
    root = tl.load(pos_ptr + row * q + c * 0)
    tl.store(ids_ptr + at, ktok, mask=write)
    tl.store(pos_ptr + at, root + 1 + dep.to(tl.int64), mask=write)
    tl.store(mask_ptr + at, (anc << 1) | 1, mask=write)
    tl.store(par_ptr + at, kpar.to(tl.int64) + 1, mask=write)


def tree_write_triton(views, b: int, q: int, src: torch.Tensor, n: int, levels: int,
                      live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``TreeWriter._build`` in one launch: the trees ``src`` (R, 3, N) keeps under budget ``n`` (>= 1) written
    into the first R rows of bucket (b, q)'s ``views`` (a ``StepViews``; rows whose ``live`` (R, 1) flag is False
    keep their inputs), returned as their tokens and parents (R, min(n, N)) and max depths (R, 1)."""
    r, _, m = src.shape
    dev = src.device
    check_tensor("src", src, shape=(r, 3, m), dtypes=(torch.int64,), device=dev)
    if not 1 <= m <= 64 or n < 1 or r > b or min(n, m) + 1 > q or levels < 1:
        raise ValueError(f"tree_write_triton: {r} rows of {m} nodes (1..64), budget {n} (>= 1), bucket {b} x {q}"
                         f" (rows <= {b}, kept nodes + 1 <= {q}), {levels} levels (>= 1)")
    for name in ("ids", "positions", "tree_mask", "parents"):
        check_tensor(name, getattr(views, name), shape=(b * q,), dtypes=(torch.int64,), device=dev)
    if live is not None:
        check_tensor("live", live, shape=(r, 1), dtypes=(torch.bool,), device=dev)
    check_launchable(_tree_write_kernel, dev)
    nk = min(n, m)
    tokens = torch.empty(r, nk, dtype=torch.int64, device=dev)
    parents = torch.empty(r, nk, dtype=torch.int64, device=dev)
    top = torch.empty(r, 1, dtype=torch.int64, device=dev)
    _tree_write_kernel[(r,)](src, views.ids, views.positions, views.tree_mask, views.parents,
                             live if live is not None else src, tokens, parents, top, m, n, levels, q,
                             BLOCK=max(16, next_pow2(m)), LIVE=live is not None, num_warps=4)
    return tokens, parents, top
