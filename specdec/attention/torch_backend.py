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
    """Store each token's K/V at its physical slot (block * block_size + offset)."""
    block_size = k_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_table_row: torch.Tensor,  # (max_blocks,) int32
    seq_len: int,
) -> torch.Tensor:  # (seq_len, Hkv, D)
    """Read the first ``seq_len`` logical positions of one row through its block table."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def new_token_mask(
    n_new: int, tree_mask_row: torch.Tensor | None, device: torch.device
) -> torch.Tensor:  # (n_new, n_new) bool: [i, j] = new token i may see new token j
    """Causal mask among a row's new tokens, or the ancestor bitmask expanded to a matrix."""
    if tree_mask_row is None:
        return torch.ones(n_new, n_new, dtype=torch.bool, device=device).tril()
    bits = torch.arange(n_new, device=device)
    return ((tree_mask_row.view(-1, 1) >> bits.view(1, -1)) & 1).bool()


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
    """Attention of each row's new tokens over its cached prefix plus its new tokens.

    The new tokens' K/V must already be in the cache. Query i of a row sees every prefix
    position and the new tokens allowed by the causal or tree mask; with a sliding window W,
    a query at logical position p sees only positions > p - W (tree queries count depth).
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    qsl, pre, sl = query_start_loc.tolist(), prefix_lens.tolist(), seq_lens.tolist()
    for b in range(len(sl)):
        s, e = qsl[b], qsl[b + 1]
        n_new = e - s
        if n_new == 0:
            continue
        keys = gather_kv(k_cache, block_tables[b], sl[b]).float()  # (S, Hkv, D)
        vals = gather_kv(v_cache, block_tables[b], sl[b]).float()
        tm = None if tree_mask is None else tree_mask[s:e]
        mask = torch.ones(n_new, sl[b], dtype=torch.bool, device=q.device)
        mask[:, pre[b]:] = new_token_mask(n_new, tm, q.device)
        if sliding_window is not None:
            q_pos = pre[b] + _depths(mask[:, pre[b]:])  # (n_new,)
            k_pos = _key_positions(pre[b], mask[:, pre[b]:])  # (S,)
            mask &= k_pos.view(1, -1) > q_pos.view(-1, 1) - sliding_window
        qf = q[s:e].float().transpose(0, 1)  # (Hq, n_new, D)
        kf = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # (Hq, S, D)
        vf = vals.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        scores = (qf @ kf.transpose(1, 2)) * scale  # (Hq, n_new, S)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)
    return out


def _depths(new_mask: torch.Tensor) -> torch.Tensor:
    """Depth of each new token = number of new tokens it sees, minus one (chain: its index)."""
    return new_mask.sum(-1) - 1


def _key_positions(prefix_len: int, new_mask: torch.Tensor) -> torch.Tensor:
    pre = torch.arange(prefix_len, device=new_mask.device)
    return torch.cat([pre, prefix_len + _depths(new_mask)])


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: scatter-write, then gather through the block table and run dense attention."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale, sliding_window=None):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.prefix_lens,
            meta.seq_lens, meta.tree_mask, scale, sliding_window,
        )
