"""Fused RoPE + KV-cache write: split the QKV projection, rotate q and k, store k and v at their slots.

Rotation follows Hugging Face Llama's ``rotate_half`` (non-interleaved halves):
x1 = x[..., :D/2], x2 = x[..., D/2:], out = [x1*cos - x2*sin, x2*cos + x1*sin],
computed in fp32 and rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels.arg_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_launchable,
    check_tensor,
    next_pow2,
)

from specdec.attention.torch_backend import write_kv


@triton.jit
def _rotate_store(src, dst, cos, sin, heads_ok, offs_h, offs_d, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rotate the (HEADS_P, HALF_P) halves at ``src`` and store them at ``dst``; return both halves."""
    mask = heads_ok[:, None] & (offs_d < HALF)[None, :]
    base = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x1 = tl.load(src + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst + base, o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + base + HALF, o2.to(dst.dtype.element_ty), mask=mask)
    return o1, o2


# positions and slots are views into an eager step's packed inputs, at offsets that change with the step's row and
# token counts: read one value per program, they gain nothing from an alignment specialisation (a compile per class)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_cache_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
    stride_qkv, stride_cos, stride_sin,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_P)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    offs_q = tl.arange(0, HQ_P)
    _rotate_store(row, q_ptr + t * NUM_HEADS * HEAD_DIM, cos, sin, offs_q < NUM_HEADS, offs_q, offs_d,
                  HALF, HEAD_DIM)
    offs_k = tl.arange(0, HKV_P)
    k_ok = offs_k < NUM_KV_HEADS
    k1, k2 = _rotate_store(row + NUM_HEADS * HEAD_DIM, k_ptr + t * NUM_KV_HEADS * HEAD_DIM, cos, sin,
                           k_ok, offs_k, offs_d, HALF, HEAD_DIM)
    mask = k_ok[:, None] & (offs_d < HALF)[None, :]  # (HKV_P, HALF_P)
    v_src = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + offs_k[:, None] * HEAD_DIM + offs_d[None, :]
    v1 = tl.load(v_src, mask=mask)
    v2 = tl.load(v_src + HALF, mask=mask)
    v_dst = v_ptr + t * NUM_KV_HEADS * HEAD_DIM + offs_k[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(v_dst, v1, mask=mask)
    tl.store(v_dst + HALF, v2, mask=mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slot = padding token: rotate, but store nothing in the cache
        blk = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        kc = kc_ptr + blk * stride_kcb + off * stride_kcs + offs_k[:, None] * stride_kch + offs_d[None, :]
        vc = vc_ptr + blk * stride_vcb + off * stride_vcs + offs_k[:, None] * stride_vch + offs_d[None, :]
        tl.store(kc, k1.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(kc + HALF, k2.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v1.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + HALF, v2.to(vc_ptr.dtype.element_ty), mask=mask)


def fused_rope_cache_write_reference(
    qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, *, out=None,
):
    """Torch version of ``fused_rope_cache_write`` with the same promises."""
    t, half = qkv.shape[0], head_dim // 2
    q, k, v = qkv.view(t, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)  # (T, H*, D) each
    c = cos[positions].float()[:, None, :]  # (T, 1, D/2)
    s = sin[positions].float()[:, None, :]

    def rotate(x):  # (T, H, D) -> (T, H, D), fp32 math, one rounding
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(qkv.dtype)

    q, k, v = rotate(q), rotate(k), v.clone()
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    if out is None:
        return q, k, v
    return tuple(o.copy_(x) for o, x in zip(out, (q, k, v), strict=True))


def fused_rope_cache_write(
    qkv: torch.Tensor,  # (T, (Hq + 2*Hkv) * D): the q | k | v projections side by side
    positions: torch.Tensor,  # (T,) int64 RoPE positions
    cos: torch.Tensor,  # (max_pos, D//2)
    sin: torch.Tensor,  # (max_pos, D//2)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), any block stride
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64, negative = padding (not stored)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q (T,Hq,D), k (T,Hkv,D), v (T,Hkv,D)
    """Return rotated q, rotated k and v, contiguous, in qkv's dtype (written into ``out`` when
    given), and store k/v in the cache at ``slot_mapping``, all in one launch.
    Positions must lie in [0, max_pos)."""
    _check_args(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                head_dim)
    t = qkv.shape[0]
    if out is None:
        out = tuple(torch.empty((t, h, head_dim), dtype=qkv.dtype, device=qkv.device)
                    for h in (num_heads, num_kv_heads, num_kv_heads))
    if len(out) != 3:
        raise ValueError(f"out must be a (q, k, v) tuple of 3 tensors, got {len(out)}")
    heads = (num_heads, num_kv_heads, num_kv_heads)
    for name, o, h in zip(("out[0]", "out[1]", "out[2]"), out, heads, strict=True):
        check_tensor(name, o, shape=(t, h, head_dim), dtypes=(qkv.dtype,), device=qkv.device)
        if not o.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {o.stride()}")
    q, k, v = out
    if t == 0:
        return q, k, v
    half = head_dim // 2
    _rope_cache_kernel[(t,)](
        qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q, k, v,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HQ_P=next_pow2(num_heads),
        HKV_P=next_pow2(num_kv_heads), HEAD_DIM=head_dim, HALF=half, HALF_P=next_pow2(half),
        PAGE_SIZE=k_cache.shape[1], num_warps=1 if num_heads * head_dim <= 512 else 4,
    )
    return q, k, v


def _check_args(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                head_dim) -> None:
    for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate_half, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    check_tensor("qkv", qkv, shape=(None, width), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    dev = qkv.device
    check_launchable(_rope_cache_kernel, dev)
    t = qkv.shape[0]
    check_tensor("positions", positions, shape=(t,), dtypes=INDEX_DTYPES, device=dev, last_dim_contiguous=True)
    check_tensor("cos", cos, shape=(None, head_dim // 2), dtypes=FLOAT_DTYPES, device=dev,
                 last_dim_contiguous=True)
    check_tensor("sin", sin, shape=tuple(cos.shape), dtypes=FLOAT_DTYPES, device=dev,
                 last_dim_contiguous=True)
    check_tensor("k_cache", k_cache, shape=(None, None, num_kv_heads, head_dim), dtypes=FLOAT_DTYPES,
                 device=dev, last_dim_contiguous=True)
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=FLOAT_DTYPES, device=dev,
                 last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, shape=(t,), dtypes=(torch.int64,), device=dev,
                 last_dim_contiguous=True)  # the kernel reads both densely (an expanded view would overrun)
