"""Torch reference of the integer part of a pipelined step's device inputs (``specdec.pipeline_hooks.advance``): what
the op ``kernels.advance.advance_rows`` runs on the torch backend; on the Triton backend it is one launch.

Kept apart from ``specdec.pipeline`` (which drives the drafter) so ``kernels/advance.py``, whose op dispatches to
it, imports it without importing the drafters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specdec.graphs import graph_constant

if TYPE_CHECKING:
    from specdec.step_inputs import StepViews


# the tree mask of query j of a causal run of up to 64 queries (bits 0..j; bit 63 as the int64 sign): the draft
# catch-up's masks, on the host (``eagle_drafter``) and on the device (``causal_masks``)
CAUSAL_BITS = np.array([b - (1 << 64) if b >= 1 << 63 else b for b in ((1 << (j + 1)) - 1 for j in range(64))],
                       dtype=np.int64)


@graph_constant(maxsize=16)
def causal_masks(q: int, device: torch.device) -> Tensor:
    """(q,) ``CAUSAL_BITS[:q]`` on ``device``, made once per (q, device) (read-only)."""
    return torch.from_numpy(CAUSAL_BITS[:q].copy()).to(device)


@torch.inference_mode()
def pad_rows(vv: StepViews, bv: int, qv: int, pv: StepViews, bp: int, qp: int, live: Tensor) -> None:
    """Write the rows of both buckets whose ``live`` flag (R,) is 0 as padding, as a host fill does (token 0 at
    position 0, no slot, no parent, zero lengths, no block), and each bucket's query start locations for its live
    rows (a prefix of the rows): a row that was live in the step before (its request ended) runs nothing."""
    r = live.shape[0]
    dead = live == 0
    for v, b, q in ((vv, bv, qv), (pv, bp, qp)):
        for name, pad in (("ids", 0), ("positions", 0), ("slots", -1), ("tree_mask", 0), ("parents", -1)):
            rows = getattr(v, name).view(b, q)[:r]
            rows.copy_(torch.where(dead[:, None], pad, rows))
        for name in ("prefix_lens", "seq_lens", "num_tokens"):
            rows = getattr(v, name)[:r]
            rows.copy_(torch.where(dead, 0, rows))
        v.block_tables[:r].copy_(torch.where(dead[:, None], 0, v.block_tables[:r]))
        counts = torch.zeros(b, dtype=torch.int64, device=live.device)
        counts[:r] = (live != 0).to(torch.int64) * q
        v.qsl[1:].copy_(counts.cumsum(0))
        v.qsl[0] = 0


def _slots(bt: Tensor, pos: Tensor, block_size: int) -> Tensor:
    """KV slots of logical positions ``pos`` (R, w) through block tables ``bt`` (R, W)."""
    return bt.gather(1, pos // block_size) * block_size + pos % block_size


@torch.inference_mode()
def advance_rows_reference(vv: StepViews, bv: int, qv: int, accept: Tensor, tokens: Tensor, bt: Tensor,
                           pv: StepViews, bp: int, qp: int, block_size: int, n: int,
                           node_offsets: Tensor | None, live: Tensor | None = None,
                           src: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The integer part of ``advance`` (same arguments): the catch-up rows into ``pv``, the next verify's
    skeleton into ``vv``; returns each catch-up input's feature source, the verify query whose features it reads
    (R, qp; -1: none), and the accepted paths' KV moves as (src, dst) slot pairs (R * qv,) each (-1: none):
    accepted node a_j (verify query a_j + 1) moves from position L + a_j to L + j. ``live`` (R,): nonzero for the
    rows to write (a bucket's rows, the padding ones 0: written as padding by ``pad_rows``, no moves, feature
    source -1); None: every row. ``src`` (R,): the row of verify K each row was (it reads its length there:
    rows that go on when others ended; ``accept`` and ``tokens`` come in the new order); None: the same row."""
    r = tokens.shape[0]
    dev = tokens.device
    ok = None if live is None else live != 0
    roots = vv.positions.view(bv, qv)[:, 0]
    L = (roots[:r] if src is None else roots.index_select(0, src)) + 1  # (R,) the length at step K (pending: L - 1)
    m, bonus = accept[:, 0], accept[:, 1]  # (R,)
    path = accept[:, 2:2 + qv]  # (R, qv) the path's verify query indices (node + 1), the first m valid
    top = bt.shape[1] * block_size - 1
    d = torch.arange(qv, device=dev)
    src_pos, dst_pos = L[:, None] + (path - 1).clamp(min=0), L[:, None] + d  # (R, qv)
    move = (d < m[:, None]) & (src_pos != dst_pos)
    if ok is not None:
        move &= ok[:, None]
    src = torch.where(move, _slots(bt, src_pos.clamp(max=top), block_size), -1).flatten()
    dst = torch.where(move, _slots(bt, dst_pos.clamp(max=top), block_size), -1).flatten()
    # the catch-up: positions L .. L + m (the path's tokens, then the bonus token)
    j = torch.arange(qp, device=dev)  # (qp,)
    w = min(qp, qv)
    ahead = torch.zeros(r, qp, dtype=torch.int64, device=dev)
    ahead[:, :w] = path[:, :w]  # (R, qp) verify query of catch-up input j + 1 (j < m)
    node_tok = tokens.gather(1, (ahead - 1).clamp(0, max(n - 1, 0))) if n else ahead  # (R, qp)
    valid = j <= m[:, None]  # (R, qp)
    pos = L[:, None] + j
    ids = torch.where(j < m[:, None], node_tok, torch.where(j == m[:, None], bonus[:, None], 0))
    p = {name: getattr(pv, name).view(bp, qp) for name in ("ids", "positions", "slots", "tree_mask", "parents")}
    p["ids"][:r] = ids
    p["positions"][:r] = torch.where(valid, pos, 0)
    p["slots"][:r] = torch.where(valid, _slots(bt, pos.clamp(max=top), block_size), -1)
    p["tree_mask"][:r] = torch.where(valid, causal_masks(qp, dev), 0)
    p["parents"][:r] = -1
    pv.prefix_lens[:r] = L
    pv.seq_lens[:r] = L + m + 1
    pv.num_tokens[:r] = m + 1
    pv.block_tables[:r] = bt
    # input j reads position L + j - 1: verify query 0 (the pending token), then the path's queries
    read = valid if ok is None else valid & ok[:, None]
    fsrc = torch.where(read, torch.cat([torch.zeros(r, 1, dtype=torch.int64, device=dev), ahead[:, :qp - 1]], 1), -1)
    # the next verify's skeleton: the bonus token is the root, at L + m; queries 0 .. n at L + m + j
    root = L + m  # (R,)
    v = {name: getattr(vv, name).view(bv, qv) for name in ("ids", "positions", "slots", "tree_mask")}
    v["ids"][:r, 0] = bonus
    v["tree_mask"][:r, 0] = 1  # (the root sees itself; the tree writer writes the nodes' masks)
    if node_offsets is None:
        v["positions"][:r, 0] = root
    else:
        v["positions"][:r, :n + 1] = root[:, None] + node_offsets
    qpos = root[:, None] + torch.arange(n + 1, device=dev)  # (R, n + 1)
    v["slots"][:r, :n + 1] = _slots(bt, qpos.clamp(max=top), block_size)
    vv.prefix_lens[:r] = root
    vv.seq_lens[:r] = root + n + 1
    vv.num_tokens[:r] = n + 1  # (a row that joined from a padding row of verify K has none there)
    vv.block_tables[:r] = bt
    if live is not None:  # (the padding rows, written above like the others, are overwritten as padding)
        pad_rows(vv, bv, qv, pv, bp, qp, live)
    return fsrc, src, dst
