"""Scatter the new tokens' K/V into the paged cache at their physical slots (one launch for K and V)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor, next_pow2

from specdec.attention.torch_backend import write_kv


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # (HEADS_P, HEAD_DIM_P)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


# the kernel's torch reference is the torch backend's store (same signature: k, v, k_cache, v_cache, slot_mapping;
# tokens with a negative slot are skipped)
store_kv_reference = write_kv


def store_kv_triton(
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), any block stride
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64
) -> None:
    """Same effect as ``store_kv_reference``, in one Triton launch (one program per token)."""
    check_tensor("k", k, shape=(None, None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    dev = k.device
    check_launchable(_store_kv_kernel, dev)
    t, hkv, d = k.shape
    check_tensor("v", v, shape=(t, hkv, d), dtypes=FLOAT_DTYPES, device=dev, last_dim_contiguous=True)
    check_tensor("k_cache", k_cache, shape=(None, None, hkv, d), dtypes=FLOAT_DTYPES, device=dev,
                 last_dim_contiguous=True)
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=FLOAT_DTYPES, device=dev,
                 last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, shape=(t,), dtypes=(torch.int64,), device=dev)
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=hkv, HEADS_P=next_pow2(hkv), HEAD_DIM=d, HEAD_DIM_P=next_pow2(d),
        PAGE_SIZE=k_cache.shape[1], num_warps=1 if hkv * d <= 512 else 4,
    )
