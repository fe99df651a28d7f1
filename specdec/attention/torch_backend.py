"""Plain-torch attention over the paged KV cache: the CPU path and the reference for the kernels."""

from __future__ import annotations

import torch

from specdec.attention.base import AttentionBackend, AttnMetadata


def write_kv(
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64
) -> None:
    """Store each token's K/V at its physical slot (block * block_size + offset).

    Tokens with a negative slot (padding) are skipped.
    """
    keep = slot_mapping >= 0  # (T,)
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = torch.div(slots, block_size, rounding_mode="floor"), slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_table_row: torch.Tensor,  # (max_blocks,) int32
    seq_len: int,
    start: int = 0,
) -> torch.Tensor:  # (seq_len - start, Hkv, D)
    """Read logical positions ``[start, seq_len)`` of one row through its block table.

    Raises RuntimeError if one of them lies in a released block (a negative table entry).
    """
    block_size = cache.shape[1]
    pos = torch.arange(start, seq_len, device=cache.device)
    blocks = block_table_row.long()[pos // block_size]
    if bool((blocks < 0).any()):
        bad = int(pos[blocks < 0][0])
        raise RuntimeError(f"position {bad} lies in a released KV block; only positions >= {start} are read")
    return cache[blocks, pos % block_size]


def region_mask(
    n_query: int, region_len: int, tree_mask_rows: torch.Tensor | None, device: torch.device
) -> torch.Tensor:  # (n_query, region_len) bool: [i, j] = query i may see region position j
    """Causal mask of the last ``n_query`` region positions, or the bitmasks expanded to a matrix."""
    j = torch.arange(region_len, device=device)
    if tree_mask_rows is None:
        r = torch.arange(region_len - n_query, region_len, device=device)
        return j.view(1, -1) <= r.view(-1, 1)
    return ((tree_mask_rows.view(-1, 1) >> j.view(1, -1)) & 1).bool()


def paged_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    query_start_loc: torch.Tensor,  # (B+1,) int32
    prefix_lens: torch.Tensor,  # (B,) int32
    seq_lens: torch.Tensor,  # (B,) int32
    tree_mask: torch.Tensor | None,  # (T,) int64 or None (causal)
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # (T, Hq, D)
    """Attention of each row's queries over its prefix and the visible part of its region.

    The queries' K/V must already be in the cache (see ``specdec.attention.base``). With a
    sliding window W, a query at logical position p sees only keys at positions > p - W,
    where a region position's logical position is prefix_len + its depth in the mask
    (depth = number of visible region positions - 1; for causal rows, its index). Every
    query sits at or after prefix_len, so keys below prefix_len - W + 1 are never read (their
    blocks may have been released).
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    qsl, pre, sl = query_start_loc.tolist(), prefix_lens.tolist(), seq_lens.tolist()
    for b in range(len(sl)):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        lo = 0 if sliding_window is None else max(0, pre[b] - sliding_window + 1)
        keys = gather_kv(k_cache, block_tables[b], sl[b], lo).float()  # (S - lo, Hkv, D)
        vals = gather_kv(v_cache, block_tables[b], sl[b], lo).float()
        tm = None if tree_mask is None else tree_mask[s:e]
        mask = torch.ones(e - s, sl[b], dtype=torch.bool, device=q.device)
        mask[:, pre[b]:] = region_mask(e - s, sl[b] - pre[b], tm, q.device)
        if sliding_window is not None:
            mask &= _window_mask(pre[b], mask[:, pre[b]:], tm, sliding_window)
        mask = mask[:, lo:]  # (n_q, S - lo)
        qf = q[s:e].float().transpose(0, 1)  # (Hq, n_q, D)
        kf = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # (Hq, S, D)
        vf = vals.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        scores = (qf @ kf.transpose(1, 2)) * scale  # (Hq, n_q, S)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)
    return out


def _window_mask(prefix_len: int, qmask: torch.Tensor, tm, window: int) -> torch.Tensor:
    """Keys inside each query's sliding window: (n_q, prefix_len + R) bool.

    Logical positions: prefix key p is at p; a region key is at prefix_len + its depth, where
    for a tree row the depth of region key j seen from query i is the number of positions the
    query sees below j (its ancestors, for an ancestor-closed mask; also defined when earlier
    levels of the tree are cached), and for a causal row it is j.
    """
    n_q, region_len = qmask.shape
    dev = qmask.device
    if tm is None:
        key_depth = torch.arange(region_len, device=dev).expand(n_q, -1)
        q_pos = prefix_len + torch.arange(region_len - n_q, region_len, device=dev)
    else:
        seen = qmask.long()
        key_depth = seen.cumsum(-1) - seen  # (n_q, R): visible positions strictly below j
        q_pos = prefix_len + seen.sum(-1) - 1
    k_pos = torch.cat([torch.arange(prefix_len, device=dev).expand(n_q, -1), prefix_len + key_depth], dim=1)
    return k_pos > q_pos.view(-1, 1) - window


def paged_attention_padded(
    q, k_cache, v_cache, block_tables, query_start_loc, prefix_lens, seq_lens, tree_mask, scale,
    sliding_window=None,
):
    """Same result as ``paged_attention``, computed for all rows at once on padded tensors.

    The fast CPU path (few large ops instead of a Python loop per row). Under a sliding window
    each row gathers only keys from ``prefix_len - W + 1`` on, so released blocks are never read.
    """
    dev, bs = q.device, k_cache.shape[1]
    hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    qsl = query_start_loc.long()
    n_q = qsl[1:] - qsl[:-1]  # (B,)
    nb, max_q = n_q.shape[0], int(n_q.max())
    qi = torch.arange(max_q, device=dev)
    valid_q = qi.view(1, -1) < n_q.view(-1, 1)  # (B, max_q)
    tok = (qsl[:-1].view(-1, 1) + qi.view(1, -1)).clamp(max=q.shape[0] - 1)  # (B, max_q)
    pre, sl = prefix_lens.long(), seq_lens.long()  # (B,)
    lo = torch.zeros_like(pre) if sliding_window is None else (pre - sliding_window + 1).clamp(min=0)
    span = int((sl - lo).max())
    pos = lo.view(-1, 1) + torch.arange(span, device=dev).view(1, -1)  # (B, S) logical key positions
    in_seq = pos < sl.view(-1, 1)  # (B, S)
    blocks = block_tables.long().gather(1, (pos // bs).clamp(max=block_tables.shape[1] - 1))  # (B, S)
    if bool((in_seq & (blocks < 0)).any()):
        raise RuntimeError("a key inside a row's window lies in a released KV block")
    blocks = torch.where(in_seq, blocks, 0)
    keys = k_cache[blocks, pos % bs].float()  # (B, S, Hkv, D)
    vals = v_cache[blocks, pos % bs].float()
    kpos = pos.unsqueeze(1)  # (B, 1, S)
    if tree_mask is None:  # query i of a row sits at position seq_len - n_q + i
        qpos = (sl - n_q).view(-1, 1, 1) + qi.view(1, -1, 1)  # (B, max_q, 1)
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
    else:
        bits = tree_mask[tok]  # (B, max_q)
        rel = kpos - pre.view(-1, 1, 1)  # (B, 1, S) region index of each key (< 0: prefix)
        rel_c = rel.clamp(0, 63).expand(nb, max_q, span)
        mask = (rel < 0) | (((bits.unsqueeze(-1) >> rel_c) & 1) == 1)
        if sliding_window is not None:
            mask &= _tree_window_mask(bits, rel, rel_c, pre, sl, sliding_window)
    mask = mask & in_seq.unsqueeze(1) & valid_q.unsqueeze(-1)  # (B, max_q, S)
    qf = q[tok].float().view(nb, max_q, hkv, hq // hkv, d)
    scores = torch.einsum("bqhgd,bshd->bhgqs", qf, keys) * scale  # (B, Hkv, G, max_q, S)
    scores = scores.masked_fill(~mask.view(nb, 1, 1, max_q, span), float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))
    o = torch.einsum("bhgqs,bshd->bqhgd", probs, vals).reshape(nb, max_q, hq, d)
    out = torch.zeros_like(q)  # (T, Hq, D): tokens of no row (padding) stay zero
    out[tok[valid_q]] = o[valid_q].to(q.dtype)
    return out


def _tree_window_mask(bits, rel, rel_c, pre, sl, window: int) -> torch.Tensor:  # (B, max_q, S) bool
    """Keys inside each tree query's window: a query sits at prefix_len + its depth, a region key
    at prefix_len + the number of the query's mask bits below it (``_window_mask``, batched)."""
    j = torch.arange(64, device=bits.device)
    in_region = j.view(1, 1, -1) < (sl - pre).view(-1, 1, 1)  # (B, 1, 64)
    seen = ((bits.unsqueeze(-1) >> j) & 1) * in_region  # (B, max_q, 64)
    below = seen.cumsum(-1) - seen  # visible region positions strictly below j
    q_pos = pre.view(-1, 1) + seen.sum(-1) - 1  # (B, max_q)
    k_pos = torch.where(rel < 0, rel, below.gather(-1, rel_c)) + pre.view(-1, 1, 1)  # (B, max_q, S)
    return k_pos > q_pos.unsqueeze(-1) - window


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: scatter-write, then gather through the block table and run dense attention."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale, sliding_window=None):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_padded(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.prefix_lens,
            meta.seq_lens, meta.tree_mask, scale, sliding_window,
        )
