"""The draft training loss of a chunk of rows in one launch (``specdec.training.linear_kl``), and its torch reference.

Per row of draft logits z (the draft vocabulary, bf16 under autocast) and teacher log-probabilities t (float32): the
KL at temperature 1 and at T, the draft's top token, and the gradient of the mixed loss with respect to z. In torch
that is some twenty passes over (rows, vocabulary) float32 tensors in the forward and backward of each unrolled step;
here one program per row reads z and t twice (first the log-normalisers, the dot products and the top token with an
online maximum, then the gradient and the overlap) and writes the gradient once, in z's dtype.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor
from specdec.kernels.triton_import import tl, triton

_NO_INDEX = 2**31 - 1


@triton.jit
def _kl_rows_kernel(z_ptr, t_ptr, negent_ptr, lse_tt_ptr, negent_t_ptr, w_ptr, kl_ptr, kl_t_ptr, overlap_ptr,
                    top_ptr, dz_ptr, n_cols, z_stride, t_stride, dz_stride, inv_temp, keep, mix,
                    SAMPLED: tl.constexpr, GRAD: tl.constexpr, MEASURE: tl.constexpr, BLOCK: tl.constexpr,
                    NO_INDEX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    z_row, t_row = z_ptr + row * z_stride, t_ptr + row * t_stride
    ninf = float("-inf")
    m = tl.full([BLOCK], ninf, tl.float32)  # per lane: running maximum of z, sum exp(z - m), of (z - m) / T
    s = tl.zeros([BLOCK], tl.float32)
    s_t = tl.zeros([BLOCK], tl.float32)
    pz = tl.zeros([BLOCK], tl.float32)  # sum p z and sum p_T z
    ptz = tl.zeros([BLOCK], tl.float32)
    best_i = tl.full([BLOCK], NO_INDEX, tl.int32)
    lse_tt = 0.0
    if SAMPLED:
        lse_tt = tl.load(lse_tt_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        ok = cols < n_cols
        z = tl.load(z_row + cols, mask=ok, other=ninf).to(tl.float32)
        t = tl.load(t_row + cols, mask=ok, other=ninf)
        better = (z > m) & ok  # strict: per lane the earlier column keeps a tie
        best_i = tl.where(better, cols, best_i)
        m_new = tl.maximum(m, z)
        live = m_new > ninf
        s = tl.where(live, s * tl.exp(tl.where(live, m - m_new, 0.0)) + tl.exp(tl.where(live, z - m_new, ninf)), 0.0)
        zc = tl.where(ok, z, 0.0)
        pz += tl.exp(t) * zc
        if SAMPLED:
            s_t = tl.where(live, s_t * tl.exp(tl.where(live, (m - m_new) * inv_temp, 0.0))
                           + tl.exp(tl.where(live, (z - m_new) * inv_temp, ninf)), 0.0)
            ptz += tl.exp(t * inv_temp - lse_tt) * zc
        m = m_new
    top = tl.max(m, axis=0)
    scale = tl.exp(tl.where(m > ninf, m - top, ninf))
    lse = top + tl.log(tl.sum(s * scale, axis=0))
    tl.store(kl_ptr + row, tl.load(negent_ptr + row) + lse - tl.sum(pz, axis=0))
    first = tl.min(tl.where((m == top) & (best_i != NO_INDEX), best_i, NO_INDEX), axis=0)
    tl.store(top_ptr + row, tl.where(first == NO_INDEX, 0, first).to(tl.int64))
    lse_t = 0.0
    if SAMPLED:
        scale_t = tl.exp(tl.where(m > ninf, (m - top) * inv_temp, ninf))
        lse_t = top * inv_temp + tl.log(tl.sum(s_t * scale_t, axis=0))
        tl.store(kl_t_ptr + row, tl.load(negent_t_ptr + row) + lse_t - tl.sum(ptz, axis=0) * inv_temp)
    if GRAD or MEASURE:
        w = 0.0
        if GRAD:
            w = tl.load(w_ptr + row)
        overlap = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            ok = cols < n_cols
            z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
            t = tl.load(t_row + cols, mask=ok, other=ninf)
            g = keep * (tl.exp(z - lse) - tl.exp(t))
            if SAMPLED:
                q_t = tl.exp(z * inv_temp - lse_t)
                p_t = tl.exp(t * inv_temp - lse_tt)
                g += mix * (q_t - p_t)
                if MEASURE:
                    overlap += tl.where(ok, tl.minimum(p_t, q_t), 0.0)
            if GRAD:
                tl.store(dz_ptr + row * dz_stride + cols, (g * w).to(dz_ptr.dtype.element_ty), mask=ok)
        if MEASURE:
            tl.store(overlap_ptr + row, tl.sum(overlap, axis=0))


def kl_rows_triton(z: torch.Tensor, t_logp: torch.Tensor, negent: torch.Tensor, lse_t: torch.Tensor | None,
                   negent_t: torch.Tensor | None, row_w: torch.Tensor, temperature: float, sampled_weight: float,
                   grad: bool, measure: bool, block: int = 2048):
    """``kl_rows_reference``'s promise, one launch with one program per row (``t_logp`` float32, contiguous rows)."""
    check_tensor("z", z, shape=(None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    c, n = z.shape
    check_tensor("t_logp", t_logp, shape=(c, n), dtypes=(torch.float32,), device=z.device, last_dim_contiguous=True)
    check_tensor("row_w", row_w, shape=(c,), dtypes=(torch.float32,), device=z.device)
    check_launchable(_kl_rows_kernel, z.device)
    if n == 0 or n >= _NO_INDEX:
        raise ValueError(f"z must have 1 .. {_NO_INDEX - 1} columns, got {n}")
    sampled = lse_t is not None
    if measure and not sampled:
        raise ValueError("measure needs the teacher's figures at the temperature (lse_t and negent_t)")
    f32 = dict(dtype=torch.float32, device=z.device)
    kl = torch.empty(c, **f32)
    kl_t = torch.empty(c, **f32) if sampled else kl
    overlap = torch.empty(c, **f32) if measure else kl
    top = torch.empty(c, dtype=torch.int64, device=z.device)
    dz = torch.empty_like(z) if grad else z
    negent = negent.float().contiguous()
    lse_t = lse_t.float().contiguous() if sampled else negent
    negent_t = negent_t.float().contiguous() if sampled else negent
    if c:
        _kl_rows_kernel[(c,)](z, t_logp, negent, lse_t, negent_t, row_w.contiguous(), kl, kl_t, overlap, top, dz, n,
                              z.stride(0), t_logp.stride(0), dz.stride(0), 1.0 / temperature, 1.0 - sampled_weight,
                              sampled_weight / temperature, SAMPLED=sampled, GRAD=grad, MEASURE=measure, BLOCK=block,
                              NO_INDEX=_NO_INDEX, num_warps=8 if block >= 2048 else 4)
    return kl, top, kl_t if sampled else None, overlap if measure else None, dz if grad else None


def kl_rows_reference(z: torch.Tensor, t_logp: torch.Tensor, negent: torch.Tensor, lse_t: torch.Tensor | None,
                      negent_t: torch.Tensor | None, row_w: torch.Tensor, temperature: float, sampled_weight: float,
                      grad: bool, measure: bool):
    """Per row of logits ``z`` (c, N) (any float dtype; scored in float32) against teacher log-probabilities
    ``t_logp`` (c, N) with sum p log p ``negent`` (c,), and at temperature T the log-normaliser of t_logp / T
    ``lse_t`` and sum p_T log p_T ``negent_t`` (c,) (None: no temperature terms): (the KL at temperature 1, the top
    token (first maximum), the KL at T or None, the overlap sum min(p_T, q_T) with ``measure`` or None) (c,) each,
    and with ``grad`` the gradient of sum(row_w * ((1 - w) KL + w KL_T)) (w = ``sampled_weight``) with respect to z,
    in z's dtype (else None)."""
    dtype, z = z.dtype, z.float()
    p = t_logp.exp()
    lse = torch.logsumexp(z, -1)
    kl = negent + lse - (p * z).sum(-1)
    top = z.argmax(-1)
    dz = (torch.exp(z - lse[:, None]) - p) * (1 - sampled_weight) if grad else None
    if lse_t is None:
        return kl, top, None, None, None if dz is None else (dz * row_w[:, None]).to(dtype)
    zt = z / temperature
    lse_zt = torch.logsumexp(zt, -1)
    p_t = torch.exp(t_logp / temperature - lse_t[:, None])
    q_t = torch.exp(zt - lse_zt[:, None])
    kl_t = negent_t + lse_zt - (p_t * zt).sum(-1)
    if grad:
        dz = ((dz + (q_t - p_t) * (sampled_weight / temperature)) * row_w[:, None]).to(dtype)
    return kl, top, kl_t, torch.minimum(p_t, q_t).sum(-1) if measure else None, dz
