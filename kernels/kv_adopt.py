"""KV adoption after verification: move accepted tree nodes' K/V to their new slots, every layer at once.

The pool storage is ``(num_blocks, block_elems)``; segment s (one per model x layer x {K, V})
of a block starts at element ``seg_offsets[s]`` and holds token ``off``'s vector of
``seg_token_elems[s]`` elements at ``seg_offsets[s] + off * seg_token_elems[s]``. Physical
slot x = block * block_size + off.

Precondition (what the engine guarantees): pairs are sorted by destination, and no pair reads
a slot that an earlier pair writes, i.e. ``dst_slots[i] != src_slots[j]`` for all ``j > i``
(accepted nodes only move to earlier positions: dst_slots[i] <= src_slots[i] logically).
Destinations are distinct. Under it, "copy the pairs one by one in order" and "read every
source, then write every destination" give the same result; both the kernel and the
reference implement the latter (a pair may still write a slot that an earlier pair reads).
Pairs with a negative src or dst are skipped (padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels.arg_checks import check_launchable, check_tensor, next_pow2


# one compile whatever the pair count and wherever the pairs start: a step's moves vary, and a variant compiled
# mid-run stalls the engine for seconds
@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
def _adopt_kv_kernel(
    storage_ptr, seg_off_ptr, seg_elems_ptr, src_ptr, dst_ptr,
    num_pairs, stride_block,
    PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # Program (segment, element chunk) owns one column range of one segment in every slot, so
    # programs never touch the same memory; inside a program all loads of a pair chunk precede
    # its stores (barrier), and the precondition orders the chunks.
    seg = tl.program_id(0)
    e0 = tl.program_id(1) * BLOCK_E
    seg_off = tl.load(seg_off_ptr + seg).to(tl.int64)
    n_elems = tl.load(seg_elems_ptr + seg).to(tl.int64)
    if e0 >= n_elems:
        return
    offs_e = e0 + tl.arange(0, BLOCK_E)
    e_ok = offs_e < n_elems
    for p0 in range(0, num_pairs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_ok = offs_p < num_pairs
        src = tl.load(src_ptr + offs_p, mask=p_ok, other=-1).to(tl.int64)  # (BLOCK_P,)
        dst = tl.load(dst_ptr + offs_p, mask=p_ok, other=-1).to(tl.int64)
        ok = ((src >= 0) & (dst >= 0))[:, None] & e_ok[None, :]  # (BLOCK_P, BLOCK_E)
        src_at = (src // PAGE_SIZE) * stride_block + seg_off + (src % PAGE_SIZE) * n_elems
        dst_at = (dst // PAGE_SIZE) * stride_block + seg_off + (dst % PAGE_SIZE) * n_elems
        vals = tl.load(storage_ptr + src_at[:, None] + offs_e[None, :], mask=ok)
        tl.debug_barrier()
        tl.store(storage_ptr + dst_at[:, None] + offs_e[None, :], vals, mask=ok)


def adopt_kv_reference(
    storage: torch.Tensor,  # (num_blocks, block_elems)
    seg_offsets: torch.Tensor,  # (S,) int64
    seg_token_elems: torch.Tensor,  # (S,) int64
    block_size: int,
    src_slots: torch.Tensor,  # (M,) int64
    dst_slots: torch.Tensor,  # (M,) int64
    *,
    max_token_elems: int | None = None,
) -> None:
    """Copy every segment's token vector from each src slot to its dst slot (read all, then write)."""
    keep = (src_slots >= 0) & (dst_slots >= 0)  # (M,)
    src, dst = src_slots[keep], dst_slots[keep]
    offs, elems = seg_offsets.tolist(), seg_token_elems.tolist()
    moves = []
    for off, n in zip(offs, elems, strict=True):
        cols = torch.arange(n, device=storage.device)  # (E,)
        src_cols = off + (src % block_size)[:, None] * n + cols  # (M', E)
        dst_cols = off + (dst % block_size)[:, None] * n + cols
        src_blk = torch.div(src, block_size, rounding_mode="floor")[:, None]
        dst_blk = torch.div(dst, block_size, rounding_mode="floor")[:, None]
        moves.append((dst_blk, dst_cols, storage[src_blk, src_cols].clone()))
    for dst_blk, dst_cols, vals in moves:
        storage[dst_blk, dst_cols] = vals


def adopt_kv(
    storage: torch.Tensor,  # (num_blocks, block_elems), stride 1 along elements
    seg_offsets: torch.Tensor,  # (S,) int64
    seg_token_elems: torch.Tensor,  # (S,) int64
    block_size: int,
    src_slots: torch.Tensor,  # (M,) int64
    dst_slots: torch.Tensor,  # (M,) int64
    *,
    max_token_elems: int | None = None,
) -> None:
    """Same effect as ``adopt_kv_reference`` under the module's precondition, in one launch.

    ``max_token_elems`` must be >= max(seg_token_elems) (None: read from the device, a sync).
    """
    _check_args(storage, seg_offsets, seg_token_elems, block_size, src_slots, dst_slots)
    m, s = src_slots.shape[0], seg_offsets.shape[0]
    if m == 0 or s == 0:
        return
    if max_token_elems is None:
        max_token_elems = int(seg_token_elems.max())
    block_e = min(128, next_pow2(max_token_elems))
    block_p = 64  # fixed, so that the pair count never picks a new variant to compile mid-run
    _adopt_kv_kernel[(s, triton.cdiv(max_token_elems, block_e))](
        storage, seg_offsets, seg_token_elems, src_slots, dst_slots, m, storage.stride(0),
        PAGE_SIZE=block_size, BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4,
    )


def _check_args(storage, seg_offsets, seg_token_elems, block_size, src_slots, dst_slots) -> None:
    check_tensor("storage", storage, shape=(None, None), last_dim_contiguous=True)
    dev = storage.device
    check_launchable(_adopt_kv_kernel, dev)
    check_tensor("seg_offsets", seg_offsets, shape=(None,), dtypes=(torch.int64,), device=dev)
    check_tensor("seg_token_elems", seg_token_elems, shape=tuple(seg_offsets.shape), dtypes=(torch.int64,),
                 device=dev)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    check_tensor("src_slots", src_slots, shape=(None,), dtypes=(torch.int64,), device=dev)
    check_tensor("dst_slots", dst_slots, shape=tuple(src_slots.shape), dtypes=(torch.int64,), device=dev)
