"""The integer inputs of a pipelined step (``specdec.pipeline``) in one launch (reference:
``specdec.lookahead_ops.advance_rows_reference``).

From verify K's greedy outcome each row gets the draft program's catch-up rows (its accepted path's tokens and
bonus token at positions L .. L + m, their KV slots, causal masks, lengths, block table), the next verify's
skeleton (the bonus token as the root at L + m, every query's slot, lengths, block table), the verify query
whose target features each catch-up input reads, and the accepted path's KV moves as slot pairs. In torch
that is some fifty small launches, even replayed from a graph each costs the GPU a few microseconds; here one
program per row.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import check_launchable, check_tensor, next_pow2
from specdec.kernels.triton_import import tl, triton

from specdec.lookahead_ops import advance_rows_reference, causal_masks


@triton.jit
def _advance_rows_kernel(
    vpos_ptr, vids_ptr, vslots_ptr, vprefix_ptr, vseq_ptr, vbt_ptr,  # next verify (bucket rows of QV queries)
    vmask_ptr, vparents_ptr, vnum_ptr, vqsl_ptr,  # (padding rows; live rows: the root's mask and query count)
    pids_ptr, ppos_ptr, pslots_ptr, pmask_ptr, pparents_ptr, pprefix_ptr, pseq_ptr, pnum_ptr, pbt_ptr,  # catch-up
    pqsl_ptr,
    acc_ptr, tok_ptr, bt_ptr, causal_ptr, offs_ptr, fsrc_ptr, src_ptr, dst_ptr, live_ptr, len_ptr,
    n, bt_width, block_size, rows,
    QV: tl.constexpr, QP: tl.constexpr, QVP: tl.constexpr, QPP: tl.constexpr, NP: tl.constexpr,
    WP: tl.constexpr, STATIC: tl.constexpr, LIVE: tl.constexpr, RP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if LIVE:  # a padding row (flag 0) writes nothing but "none" into the returned sources and moves
        live = tl.load(live_ptr + row)
    else:
        live = 1
    z = tl.arange(0, 1)  # (the row's scalars are stored as blocks of one, masked like the rest)
    ok1 = (z * 0 + live) != 0
    top = bt_width * block_size - 1
    bt_row = bt_ptr + row * bt_width
    acc = acc_ptr + row * (QV + 3)
    L = tl.load(len_ptr + row) + 1  # the pending token sat at L - 1 (read before any program writes the verify's)
    m = tl.load(acc)
    bonus = tl.load(acc + 1)
    # the accepted path's KV moves: node a_d (query a_d + 1) from L + a_d to L + d
    d = tl.arange(0, QVP)
    d_ok = d < QV
    path_d = tl.load(acc + 2 + d, mask=d_ok, other=0)
    src_pos = L + tl.maximum(path_d - 1, 0)
    dst_pos = L + d
    move = d_ok & (d < m) & (src_pos != dst_pos) & ((d * 0 + live) != 0)
    src_pos = tl.minimum(src_pos, top)
    dst_pos = tl.minimum(dst_pos, top)
    src_blk = tl.load(bt_row + src_pos // block_size, mask=move, other=0)
    dst_blk = tl.load(bt_row + dst_pos // block_size, mask=move, other=0)
    tl.store(src_ptr + row * QV + d, tl.where(move, src_blk * block_size + src_pos % block_size, -1), mask=d_ok)
    tl.store(dst_ptr + row * QV + d, tl.where(move, dst_blk * block_size + dst_pos % block_size, -1), mask=d_ok)
    # the catch-up: input j at position L + j; the path's tokens (j < m), then the bonus token (j == m)
    j = tl.arange(0, QPP)
    j_ok = j < QP
    ahead = tl.load(acc + 2 + j, mask=j_ok & (j < QV), other=0)  # the verify query of path node j
    node = tl.minimum(tl.maximum(ahead - 1, 0), tl.maximum(n - 1, 0))
    tok = tl.load(tok_ptr + row * n + node, mask=j_ok & (j < m), other=0)  # (no nodes: m is 0)
    valid = j <= m
    ids = tl.where(j < m, tok, tl.where(j == m, bonus, 0))
    pos = L + j
    blk = tl.load(bt_row + tl.minimum(pos, top) // block_size, mask=j_ok & valid, other=0)
    causal = tl.load(causal_ptr + j, mask=j_ok, other=0)
    at = row * QP + j
    ok = (j * 0 + live) != 0
    put = j_ok & ok
    tl.store(pids_ptr + at, ids, mask=put)
    tl.store(ppos_ptr + at, tl.where(valid, pos, 0), mask=put)
    tl.store(pslots_ptr + at, tl.where(valid, blk * block_size + tl.minimum(pos, top) % block_size, -1), mask=put)
    tl.store(pmask_ptr + at, tl.where(valid, causal, 0), mask=put)
    tl.store(pparents_ptr + at, tl.full([QPP], -1, tl.int64), mask=put)
    # input j reads the features of position L + j - 1: verify query 0 (the pending token), then the path's
    prev = tl.load(acc + 1 + j, mask=j_ok & (j >= 1) & (j - 1 < QV), other=0)
    tl.store(fsrc_ptr + at, tl.where(valid & ok, tl.where(j == 0, 0, prev), -1), mask=j_ok)
    tl.store(pprefix_ptr + row + z, L + z, mask=ok1)
    tl.store(pseq_ptr + row + z, L + m + 1 + z, mask=ok1)
    tl.store(pnum_ptr + row + z, m + 1 + z, mask=ok1)
    # the next verify's skeleton: the root (the bonus token) at L + m, queries 0 .. n at L + m + k
    root = L + m
    k = tl.arange(0, NP)
    k_ok = (k <= n) & ((k * 0 + live) != 0)
    tl.store(vids_ptr + row * QV + z, bonus + z, mask=ok1)
    if STATIC:
        tl.store(vpos_ptr + row * QV + k, root + tl.load(offs_ptr + k, mask=k_ok, other=0), mask=k_ok)
    else:
        tl.store(vpos_ptr + row * QV + z, root + z, mask=ok1)
    qpos = tl.minimum(root + k, top)
    qblk = tl.load(bt_row + qpos // block_size, mask=k_ok, other=0)
    tl.store(vslots_ptr + row * QV + k, qblk * block_size + qpos % block_size, mask=k_ok)
    tl.store(vprefix_ptr + row + z, root + z, mask=ok1)
    tl.store(vseq_ptr + row + z, root + n + 1 + z, mask=ok1)
    tl.store(vnum_ptr + row + z, n + 1 + z, mask=ok1)  # (a row that joined from a padding row has none there)
    tl.store(vmask_ptr + row * QV + z, 1 + z, mask=ok1)  # the root sees itself (the tree writer: the nodes)
    # both buckets' block-table rows
    for w0 in range(0, bt_width, WP):
        w = w0 + tl.arange(0, WP)
        w_ok = (w < bt_width) & ((w * 0 + live) != 0)
        b = tl.load(bt_row + w, mask=w_ok)
        tl.store(vbt_ptr + row * bt_width + w, b, mask=w_ok)
        tl.store(pbt_ptr + row * bt_width + w, b, mask=w_ok)
    if LIVE:  # a padding row: both buckets' row as a host fill leaves it; and each bucket's query start locations
        _pad_row(row, live, vids_ptr, vpos_ptr, vslots_ptr, vmask_ptr, vparents_ptr, vprefix_ptr, vseq_ptr, vnum_ptr,
                 vbt_ptr, bt_width, QV, QVP, WP)
        _pad_row(row, live, pids_ptr, ppos_ptr, pslots_ptr, pmask_ptr, pparents_ptr, pprefix_ptr, pseq_ptr, pnum_ptr,
                 pbt_ptr, bt_width, QP, QPP, WP)
        r = tl.arange(0, RP)
        live_rows = tl.sum((tl.load(live_ptr + r, mask=r < rows, other=0) != 0).to(tl.int64), axis=0)
        before = tl.minimum(row + 1, live_rows)  # live rows are the first ones: row + 1's queries start here
        tl.store(vqsl_ptr + row + 1 + z, before * QV + z)
        tl.store(pqsl_ptr + row + 1 + z, before * QP + z)
        first = (z + row) == 0
        tl.store(vqsl_ptr + z, z.to(tl.int64), mask=first)
        tl.store(pqsl_ptr + z, z.to(tl.int64), mask=first)


@triton.jit
def _pad_row(row, live, ids_ptr, pos_ptr, slots_ptr, mask_ptr, parents_ptr, prefix_ptr, seq_ptr, num_ptr, bt_ptr,
             bt_width, Q: tl.constexpr, QP2: tl.constexpr, WP: tl.constexpr):
    """Row ``row`` of a bucket of Q queries per row as padding when ``live`` is 0: token 0 at position 0, no slot,
    no parent, zero lengths, no block."""
    k = tl.arange(0, QP2)
    dead = (k < Q) & ((k * 0 + live) == 0)
    zero, none = tl.zeros([QP2], tl.int64), tl.full([QP2], -1, tl.int64)
    at = row * Q + k
    tl.store(ids_ptr + at, zero, mask=dead)
    tl.store(pos_ptr + at, zero, mask=dead)
    tl.store(slots_ptr + at, none, mask=dead)
    tl.store(mask_ptr + at, zero, mask=dead)
    tl.store(parents_ptr + at, none, mask=dead)
    z = tl.arange(0, 1)
    dead1 = (z * 0 + live) == 0
    zero1 = tl.zeros([1], tl.int64)
    tl.store(prefix_ptr + row + z, zero1, mask=dead1)
    tl.store(seq_ptr + row + z, zero1, mask=dead1)
    tl.store(num_ptr + row + z, zero1, mask=dead1)
    for w0 in range(0, bt_width, WP):
        w = w0 + tl.arange(0, WP)
        tl.store(bt_ptr + row * bt_width + w, tl.zeros([WP], tl.int64), mask=(w < bt_width) & ((w * 0 + live) == 0))


def advance_rows_triton(vv, bv: int, qv: int, accept: torch.Tensor, tokens: torch.Tensor, bt: torch.Tensor, pv,
                        bp: int, qp: int, block_size: int, n: int, node_offsets: torch.Tensor | None,
                        live: torch.Tensor | None = None, src: torch.Tensor | None = None):
    """Same promise as ``advance_rows_reference`` (same arguments and return), in one launch."""
    r = tokens.shape[0]
    dev = tokens.device
    check_tensor("accept", accept, shape=(r, qv + 3), dtypes=(torch.int64,), device=dev)
    check_tensor("tokens", tokens, shape=(r, n), dtypes=(torch.int64,), device=dev)
    check_tensor("bt", bt, shape=(r, None), dtypes=(torch.int64,), device=dev)
    if node_offsets is not None:
        check_tensor("node_offsets", node_offsets, shape=(n + 1,), dtypes=(torch.int64,), device=dev)
    if live is not None:
        check_tensor("live", live, shape=(r,), dtypes=(torch.int64,), device=dev)
    if src is not None:
        check_tensor("src", src, shape=(r,), dtypes=(torch.int64,), device=dev)
    if r > min(bv, bp) or n + 1 > qv:
        raise ValueError(f"advance_rows: {r} rows of {n} nodes do not fit buckets ({bv}, {qv}) and ({bp}, {qp})")
    check_launchable(_advance_rows_kernel, dev)
    fsrc = torch.empty(r, qp, dtype=torch.int64, device=dev)
    moved_from = torch.empty(r * qv, dtype=torch.int64, device=dev)
    moved_to = torch.empty(r * qv, dtype=torch.int64, device=dev)
    if r:
        acc, tok, table = accept.contiguous(), tokens.contiguous(), bt.contiguous()
        roots = vv.positions.view(bv, qv)[:, 0]  # each row's root position at step K, read before the launch
        lens = roots[:r].contiguous() if src is None else roots.index_select(0, src)
        offs = node_offsets if node_offsets is not None else acc  # (unused when the tree is dynamic)
        w = table.shape[1]
        _advance_rows_kernel[(r,)](
            vv.positions, vv.ids, vv.slots, vv.prefix_lens, vv.seq_lens, vv.block_tables,
            vv.tree_mask, vv.parents, vv.num_tokens, vv.qsl,
            pv.ids, pv.positions, pv.slots, pv.tree_mask, pv.parents, pv.prefix_lens, pv.seq_lens, pv.num_tokens,
            pv.block_tables, pv.qsl, acc, tok, table, causal_masks(qp, dev), offs, fsrc, moved_from, moved_to,
            live.contiguous() if live is not None else acc, lens, n, w, block_size, r, QV=qv, QP=qp,
            QVP=next_pow2(qv), QPP=next_pow2(qp), NP=next_pow2(n + 1), WP=min(next_pow2(w), 256),
            STATIC=node_offsets is not None, LIVE=live is not None, RP=next_pow2(r), num_warps=1)
    return fsrc, moved_from, moved_to


def advance_rows(vv, bv, qv, accept, tokens, bt, pv, bp, qp, block_size, n, node_offsets, live=None, src=None, *,
                 use_triton: bool):
    """A pipelined step's integer inputs from the previous verify's outcome: ``advance_rows_triton`` (one launch)
    when ``use_triton`` (the Triton backend), ``advance_rows_reference`` otherwise."""
    op = advance_rows_triton if use_triton else advance_rows_reference
    return op(vv, bv, qv, accept, tokens, bt, pv, bp, qp, block_size, n, node_offsets, live, src)
