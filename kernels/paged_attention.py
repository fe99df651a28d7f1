"""Paged attention over the shared KV pool: decode, tree verify and chunked prefill in one kernel.

Semantics are those of ``specdec.attention.torch_backend.paged_attention`` (the contract in
``specdec.attention.base``): a row's queries are the last q_len positions of its region,
causal or tree-masked (tree rows: region <= 64 positions, one int64 bitmask per query).
Under a sliding window a tree key's depth is the number of the query's mask bits below it,
which equals the reference's popcount(key mask) - 1 for ancestor-closed masks and, unlike
the reference, is also defined when earlier region levels are cached (q_len < region).

One program handles a tile of BLOCK_Q queries of one row times all GROUP query heads that
share one KV head (so each K/V tile is loaded once for the whole GQA group), and one of
num_splits contiguous chunks of that tile's visible key range (split-K / flash-decoding).
With num_splits > 1 the programs write fp32 partial outputs plus log-sum-exp, and a second
small kernel combines them. Decode (max_query_len == 1) uses the same kernel with a 16-row
tile and more splits. Keys are read position by position through the block table, so the
cache block size and the kernel's key tile BLOCK_N are independent.

Grids depend only on ``max_query_len`` (must be >= the true value) and the chosen split
count; every length is read on the device, so a launch stays valid for CUDA-graph replay
with any lengths within those bounds.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from specdec.kernels.arg_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_launchable,
    check_tensor,
    next_pow2,
    sm_count,
)

from specdec.attention.torch_backend import paged_attention as _torch_paged_attention

LOG2E = 1.4426950408889634
MAX_TREE_TOKENS = 64  # one int64 ancestor bitmask per new token
MAX_SPLITS = 32


@triton.jit
def _popcount(x):
    """Set bits of each int64 (two's complement, so bit 63 counts too)."""
    y = x & 0x7FFFFFFFFFFFFFFF  # non-negative: arithmetic shifts below act as logical ones
    y = y - ((y >> 1) & 0x5555555555555555)
    y = (y & 0x3333333333333333) + ((y >> 2) & 0x3333333333333333)
    y = (y + (y >> 4)) & 0x0F0F0F0F0F0F0F0F
    y = y + (y >> 8)
    y = y + (y >> 16)
    y = y + (y >> 32)
    return (y & 0x7F) + (x < 0).to(tl.int64)


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, tm_q, t_idx, q_pos, k_from, k_to, prefix, window, scale_log2, k_base, v_base,
    bt_row, stride_bt1, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, REGION: tl.constexpr, IS_TREE: tl.constexpr,
    SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with keys [k_from, k_to); REGION keys get the
    causal / tree mask, prefix keys only the length and window checks."""
    for start in range(k_from, k_to, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical key positions
        n_ok = offs_n < k_to
        blk = tl.load(bt_row + (offs_n // PAGE_SIZE) * stride_bt1, mask=n_ok, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + (blk * stride_kb + in_page * stride_ks)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # (BLOCK_N, HEAD_DIM_P)
        v = tl.load(v_base + (blk * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # (BLOCK_N, HEAD_DIM_P)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)

        vis = n_ok[None, :]
        k_pos = offs_n[None, :]
        if REGION:
            j = offs_n - prefix  # region index of each key
            if IS_TREE:
                jj = tl.minimum(j, 63).to(tl.int64)  # tree regions hold <= 64 positions
                vis = vis & (((tm_q[:, None] >> jj[None, :]) & 1) != 0)
                if SLIDING:  # a visible region key is an ancestor: its depth = the query's bits below it
                    below = (tl.full((), 1, tl.int64) << jj) - 1  # (BLOCK_N,)
                    k_pos = prefix + _popcount(tm_q[:, None] & below[None, :])  # (BLOCK_M, BLOCK_N)
            else:
                vis = vis & (j[None, :] <= t_idx[:, None])
        if SLIDING:
            vis = vis & (k_pos > q_pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Eager forwards (a draft's prefill chunks and catch-ups) launch these with split counts, token counts and tree-mask
# offsets that change from step to step; specialising on them (== 1, divisible by 16, 16-byte aligned) gains
# nothing here and made every new class a compile during requests, after the engine's warm-up.
@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["tm_ptr"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, pre_ptr, sl_ptr, tm_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, window, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt0, stride_bt1,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,  # partial o (splits, T, Hq, D); lse uses (splits, T, Hq) / D
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_TREE: tl.constexpr, SLIDING: tl.constexpr, USE_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P
    tile = tl.program_id(0)
    b = tl.program_id(1) // NUM_KV_HEADS
    kvh = tl.program_id(1) % NUM_KV_HEADS
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    n_q = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start  # the row's queries: last n_q region positions
    tile_start = tile * BLOCK_Q
    if tile_start >= n_q:
        return
    seq_len = tl.load(sl_ptr + b).to(tl.int32)
    if IS_TREE:
        prefix = tl.load(pre_ptr + b).to(tl.int32)  # tree bits index region positions from here
    else:
        prefix = seq_len - n_q  # causal: region positions before the queries are seen by all of them

    offs_m = tl.arange(0, BLOCK_M)
    t_idx = tile_start + offs_m // GROUP_P  # (BLOCK_M,) query index within the row
    head = kvh * GROUP + offs_m % GROUP_P  # (BLOCK_M,) query head
    row_ok = (t_idx < n_q) & (offs_m % GROUP_P < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + t_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM_P)

    # Visible key range [lo, hi) of this tile, split into num_splits chunks of whole key tiles.
    tm_q = 0  # (BLOCK_M,) int64 masks of tree queries
    q_pos = 0  # (BLOCK_M,) logical positions of the queries, under a sliding window
    if IS_TREE:
        tm_q = tl.load(tm_ptr + q_start + t_idx, mask=t_idx < n_q, other=0)  # (BLOCK_M,) int64
        hi = seq_len
    else:
        hi = tl.minimum(seq_len, prefix + tile_start + BLOCK_Q)
    lo = 0
    if SLIDING:  # query position = prefix + depth; depth = visible region positions - 1 (causal: index)
        if IS_TREE:
            region = (seq_len - prefix).to(tl.int64)
            region_bits = tl.where(region >= 64, -1, (tl.full((), 1, tl.int64) << region) - 1)
            q_pos = prefix + _popcount(tm_q & region_bits) - 1  # (BLOCK_M,)
            lo = tl.maximum(prefix - window + 1, 0)
        else:
            q_pos = prefix + t_idx
            lo = tl.maximum(prefix + tile_start - window + 1, 0)
    per_split = (hi - lo + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    k_lo = lo + split * chunk
    k_hi = tl.minimum(k_lo + chunk, hi)

    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)  # finite: fully masked tiles give p = 0, no NaN
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_P), tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + b * stride_bt0
    mid = tl.minimum(tl.maximum(prefix, k_lo), k_hi)  # prefix keys need no mask, region keys do
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, tm_q, t_idx, q_pos, k_lo, mid, prefix, window, scale_log2, k_base, v_base,
        bt_row, stride_bt1, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok,
        BLOCK_N, PAGE_SIZE, False, IS_TREE, SLIDING, DOT_PRECISION)
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, tm_q, t_idx, q_pos, mid, k_hi, prefix, window, scale_log2, k_base, v_base,
        bt_row, stride_bt1, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok,
        BLOCK_N, PAGE_SIZE, True, IS_TREE, SLIDING, DOT_PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if not USE_PARTIALS:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = split * stride_ps + tok * stride_pt + head * stride_ph  # (BLOCK_M,)
        tl.store(part_o_ptr + part[:, None] + offs_d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part // HEAD_DIM_P, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "num_splits"])  # (see _paged_attn_kernel): one kernel per SPLITS_P
def _combine_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_rows, num_splits, stride_ps, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    # rows r = token * NUM_HEADS + head; part_o is (splits, T*Hq, HEAD_DIM_P), part_lse (splits, T*Hq)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    r_ok = offs_r < num_rows
    ok = r_ok[:, None] & (offs_s < num_splits)[None, :]  # (BLOCK_R, SPLITS_P)
    part = offs_s[None, :].to(tl.int64) * stride_ps + offs_r[:, None].to(tl.int64) * HEAD_DIM_P
    lse = tl.load(part_lse_ptr + part // HEAD_DIM_P, mask=ok, other=float("-inf"))  # (BLOCK_R, SPLITS_P)
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # rows past the end: every lse is -inf
    w = tl.exp2(lse - m[:, None])  # empty splits: lse = -inf -> weight 0
    o = tl.load(part_o_ptr + part[:, :, None] + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
    w_sum = tl.sum(w, axis=1)
    o = tl.sum(w[:, :, None] * o, axis=1) / tl.where(w_sum > 0, w_sum, 1.0)[:, None]  # (BLOCK_R, D_P)
    tok = (offs_r // NUM_HEADS).to(tl.int64)
    head = offs_r % NUM_HEADS
    dst = out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


def paged_attention_reference(
    q, k_cache, v_cache, block_tables, query_start_loc, prefix_lens, seq_lens, tree_mask, scale,
    sliding_window=None, *, max_query_len=None, max_seq_len=None, num_splits=None, out=None,
    tile_config=None,
):
    """The torch reference (specdec.attention.torch_backend.paged_attention); launch hints are ignored."""
    res = _torch_paged_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, prefix_lens, seq_lens, tree_mask, scale,
        sliding_window,
    )
    return res if out is None else out.copy_(res)


def paged_attention_triton(
    q: torch.Tensor,  # (T, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), any block stride
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_tables: torch.Tensor,  # (>=B, max_blocks) int32
    query_start_loc: torch.Tensor,  # (B+1,) int32
    prefix_lens: torch.Tensor,  # (B,) int32
    seq_lens: torch.Tensor,  # (B,) int32
    tree_mask: torch.Tensor | None,  # (T,) int64 or None (causal)
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tile_config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # (T, Hq, D)
    """Same result as ``specdec.attention.torch_backend.paged_attention``, computed by Triton kernels.

    ``max_query_len`` must be >= every row's query count (None: read from the device, a sync);
    ``max_seq_len`` only steers the split count (None: read from the device). ``num_splits``
    forces the split-K factor. ``out`` (T, Hq, D), q's dtype, receives the result when given.
    ``tile_config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the tuned tiles.
    Tokens outside every row's [qsl[b], qsl[b+1]) are left unwritten.
    Sliding windows are supported for every row kind (no torch fallback needed).
    """
    _check_args(q, k_cache, v_cache, block_tables, query_start_loc, prefix_lens, seq_lens, tree_mask,
                scale, sliding_window, num_splits, out)
    T, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    nrows = seq_lens.shape[0]
    if out is None:
        out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)  # (T, Hq, D)
    if T == 0 or nrows == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_query_len < 1:
        return out
    if tree_mask is not None and max_query_len > MAX_TREE_TOKENS:
        raise ValueError(f"tree rows hold at most {MAX_TREE_TOKENS} queries, got {max_query_len}")
    if max_seq_len > block_tables.shape[1] * page:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds block_tables capacity "
                         f"{block_tables.shape[1]} blocks x {page}")

    group = hq // hkv
    group_p = next_pow2(group)
    block_m, block_n, num_warps, num_stages = tile_config or _tile_config(q, d, group_p, max_query_len)
    if block_m < max(16, group_p) or block_m & (block_m - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"tile_config {tile_config}: BLOCK_M must be a power of two >= max(16, {group_p}) "
                         "and BLOCK_N a power of two >= 16")
    n_tiles = triton.cdiv(max_query_len, block_m // group_p)
    kv_span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + max_query_len)
    splits = num_splits or _auto_splits(q.device, n_tiles * nrows * hkv, kv_span, block_n)
    if splits > 1:
        part_o = torch.empty((splits, T, hq, next_pow2(d)), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, T, hq), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # never touched
    _paged_attn_kernel[(n_tiles, nrows * hkv, splits)](
        q, k_cache, v_cache, block_tables, query_start_loc, prefix_lens, seq_lens,
        q if tree_mask is None else tree_mask, out, part_o, part_lse,
        float(scale) * LOG2E, int(sliding_window or 0), splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1),
        *(part_o.stride()[:3] if splits > 1 else (0, 0, 0)),
        NUM_KV_HEADS=hkv, GROUP=group, GROUP_P=group_p, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=d, HEAD_DIM_P=next_pow2(d), PAGE_SIZE=page, IS_TREE=tree_mask is not None,
        SLIDING=sliding_window is not None, USE_PARTIALS=splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        block_r = _combine_rows(q.device, splits, d)
        _combine_splits_kernel[(triton.cdiv(T * hq, block_r),)](
            part_o, part_lse, out, T * hq, splits, part_o.stride(0), out.stride(0), out.stride(1),
            NUM_HEADS=hq, SPLITS_P=next_pow2(splits), BLOCK_R=block_r,
            HEAD_DIM=d, HEAD_DIM_P=next_pow2(d),
        )
    return out


def _tile_config(q: torch.Tensor, d: int, group_p: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the fastest of a tile sweep on an H200 for each case below.

    Multi-query tiles grow to hold all of a row's queries x the GQA group, so K/V is read once.
    """
    if q.device.type != "cuda":  # interpreter: few, large programs keep the tests fast
        return max(16, min(64, group_p * next_pow2(max_query_len))), 16, 1, 1
    if d > 128 or q.dtype == torch.float32:  # big tiles would spill
        return max(16 if max_query_len == 1 else 64, group_p), 32, 4, 2
    if max_query_len == 1:
        return max(16, group_p), 128 if d <= 64 else 64, 4, 3
    rows = next_pow2(max_query_len) * group_p
    if rows <= 64:
        return 64, 64, 4, 3
    if rows <= 128 or d > 64:
        return max(128, group_p), 32, 4, 3
    return max(256, group_p), 64, 8, 3


def _combine_rows(device: torch.device, splits: int, d: int) -> int:
    """(token, head) rows per combine program: ~4K fp32 partials on a GPU, 64 rows interpreted."""
    if device.type != "cuda":
        return 64
    return max(1, min(64, 4096 // (next_pow2(splits) * next_pow2(d))))


def _auto_splits(device: torch.device, programs: int, kv_span: int, block_n: int) -> int:
    """Split the keys until the grid fills the GPU twice, keeping >= 4 key tiles per split."""
    if device.type != "cuda":
        return 1
    target = 2 * sm_count(device)
    if programs >= target:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(target, programs), kv_span // (4 * block_n)))


def _check_args(q, k_cache, v_cache, block_tables, query_start_loc, prefix_lens, seq_lens, tree_mask,
                scale, sliding_window, num_splits, out) -> None:
    check_tensor("q", q, shape=(None, None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    dev = q.device
    check_launchable(_paged_attn_kernel, dev)
    t, hq, d = q.shape
    check_tensor("k_cache", k_cache, shape=(None, None, None, d), dtypes=(q.dtype,), device=dev,
                 last_dim_contiguous=True)
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(q.dtype,), device=dev,
                 last_dim_contiguous=True)
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_cache heads ({hkv})")
    check_tensor("seq_lens", seq_lens, shape=(None,), dtypes=INDEX_DTYPES, device=dev)
    b = seq_lens.shape[0]
    check_tensor("prefix_lens", prefix_lens, shape=(b,), dtypes=INDEX_DTYPES, device=dev)
    check_tensor("query_start_loc", query_start_loc, shape=(b + 1,), dtypes=INDEX_DTYPES, device=dev)
    check_tensor("block_tables", block_tables, shape=(None, None), dtypes=INDEX_DTYPES, device=dev)
    if block_tables.shape[0] < b:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, need >= {b} (one per row)")
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, shape=(t,), dtypes=(torch.int64,), device=dev)
    if isinstance(scale, torch.Tensor) or not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite Python float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= 64):
        raise ValueError(f"num_splits must be None or an int in [1, 64], got {num_splits!r}")
    if out is not None:
        check_tensor("out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=dev,
                     last_dim_contiguous=True)
