"""Fused elementwise kernels of the decoder layer: residual add + RMSNorm, and SiLU(gate) * up; and the
EAGLE draft's input (its token embedding and its feature, each RMS-normed, side by side).

Each replaces several torch launches per layer (RMSNorm alone is ~7 in eager torch), which is
what a CUDA-graph replay of a small model spends its time on. Both compute in float32 and
round once to the input dtype, like their torch references in ``specdec.models.layer_ops``.

The models call the ops ``add_rmsnorm``, ``embed_feature_norm`` and ``silu_mul``: the kernel on the Triton
backend, the reference otherwise.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor, next_pow2
from specdec.kernels.triton_import import tl, triton

from specdec.models.layer_ops import (
    add_rmsnorm_reference,
    embed_feature_norm_reference,
    silu_mul_reference,
)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr, HIDDEN_P: tl.constexpr, HAS_RES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HIDDEN_P)
    ok = offs < HIDDEN
    x = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0)
    if HAS_RES:  # h = x + residual, rounded to the dtype like the torch add it replaces
        x = (x + tl.load(res_ptr + t * stride_r + offs, mask=ok, other=0.0)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_ro + offs, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # (HIDDEN_P,)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, n_cols, stride_gu, stride_o,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + n_cols + offs, mask=ok, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # silu rounded to the dtype, as torch's F.silu does
    tl.store(out_ptr + t * stride_o + offs, act * u, mask=ok)


def add_rmsnorm_triton(
    x: torch.Tensor,  # (T, H)
    residual: torch.Tensor | None,  # (T, H) or None
    weight: torch.Tensor,  # (H,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed (T, H), h (T, H)
    """Same promises as ``add_rmsnorm_reference``, in one launch (h is x itself without residual)."""
    check_tensor("x", x, shape=(None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_launchable(_add_rmsnorm_kernel, x.device)
    t, hidden = x.shape
    check_tensor("weight", weight, shape=(hidden,), dtypes=(x.dtype,), device=x.device)
    if residual is not None:
        check_tensor("residual", residual, shape=(t, hidden), dtypes=(x.dtype,), device=x.device,
                     last_dim_contiguous=True)
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    if t == 0:
        return out, h
    res = x if residual is None else residual
    _add_rmsnorm_kernel[(t,)](
        x, res, weight, out, h, float(eps), x.stride(0), res.stride(0), out.stride(0), h.stride(0),
        HIDDEN=hidden, HIDDEN_P=next_pow2(hidden), HAS_RES=residual is not None,
        num_warps=4 if hidden >= 1024 else 2,
    )
    return out, h


@triton.jit
def _embed_feature_norm_kernel(
    ids_ptr, table_ptr, g_ptr, we_ptr, wf_ptr, out_ptr, eps_e, eps_f, stride_t, stride_g, stride_o,
    HIDDEN: tl.constexpr, HIDDEN_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)  # 0: the token's embedding row, 1: its feature
    offs = tl.arange(0, HIDDEN_P)
    ok = offs < HIDDEN
    dt = table_ptr.dtype.element_ty
    if half == 0:
        row = tl.load(ids_ptr + t).to(tl.int64)
        x = tl.load(table_ptr + row * stride_t + offs, mask=ok, other=0.0)
        w = tl.load(we_ptr + offs, mask=ok, other=0.0)
        eps = eps_e
    else:
        x = tl.load(g_ptr + t * stride_g + offs, mask=ok, other=0.0).to(dt)
        w = tl.load(wf_ptr + offs, mask=ok, other=0.0)
        eps = eps_f
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = (xf * tl.rsqrt(var + eps)).to(dt)
    tl.store(out_ptr + t * stride_o + half * HIDDEN + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def embed_feature_norm_triton(ids: torch.Tensor, table: torch.Tensor, g: torch.Tensor, w_e: torch.Tensor,
                       w_f: torch.Tensor, eps_e: float, eps_f: float) -> torch.Tensor:  # (T, 2H)
    """Same promise as ``embed_feature_norm_reference``, in one launch (the embedding row read in place)."""
    check_tensor("table", table, shape=(None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_launchable(_embed_feature_norm_kernel, table.device)
    hidden = table.shape[1]
    check_tensor("ids", ids, shape=(None,), dtypes=(torch.int32, torch.int64), device=table.device)
    t = ids.shape[0]
    check_tensor("g", g, shape=(t, hidden), dtypes=FLOAT_DTYPES, device=table.device, last_dim_contiguous=True)
    check_tensor("w_e", w_e, shape=(hidden,), dtypes=(table.dtype,), device=table.device)
    check_tensor("w_f", w_f, shape=(hidden,), dtypes=(table.dtype,), device=table.device)
    out = torch.empty((t, 2 * hidden), dtype=table.dtype, device=table.device)
    if t:
        _embed_feature_norm_kernel[(t, 2)](
            ids.contiguous(), table, g, w_e, w_f, out, float(eps_e), float(eps_f), table.stride(0), g.stride(0),
            out.stride(0), HIDDEN=hidden, HIDDEN_P=next_pow2(hidden), num_warps=4 if hidden >= 1024 else 2,
        )
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """Same promise as ``silu_mul_reference``, in one launch."""
    check_tensor("gate_up", gate_up, shape=(None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_launchable(_silu_mul_kernel, gate_up.device)
    t, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even last dimension (gate | up), got {width}")
    n = width // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, next_pow2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def add_rmsnorm(x, residual, weight, eps, *, use_triton: bool):
    """(weight * rmsnorm(x + residual), x + residual); residual None means x alone: ``add_rmsnorm_triton`` when
    ``use_triton`` (the Triton backend), ``add_rmsnorm_reference`` otherwise."""
    return (add_rmsnorm_triton if use_triton else add_rmsnorm_reference)(x, residual, weight, eps)


def embed_feature_norm(ids, table, g, w_e, w_f, eps_e, eps_f, *, use_triton: bool):
    """(T,) token ids, (V, H) embedding table, (T, H) features -> (T, 2H): each RMS-normed with its weight, side
    by side: ``embed_feature_norm_triton`` (one launch) when ``use_triton``, the reference otherwise."""
    op = embed_feature_norm_triton if use_triton else embed_feature_norm_reference
    return op(ids, table, g, w_e, w_f, eps_e, eps_f)


def silu_mul(gate_up: torch.Tensor, *, use_triton: bool) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """silu(gate) * up of (T, 2I) gate | up: ``silu_mul_triton`` when ``use_triton``, the reference otherwise."""
    return (silu_mul_triton if use_triton else silu_mul_reference)(gate_up)
