"""Plain-torch elementwise ops of the decoder layer: the CPU path and the references of the fused kernels
in ``specdec.kernels.norm_act``."""

from __future__ import annotations

import torch


def add_rmsnorm_reference(
    x: torch.Tensor,  # (T, H)
    residual: torch.Tensor | None,  # (T, H) or None
    weight: torch.Tensor,  # (H,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed (T, H), h (T, H)
    """h = x + residual (x when residual is None); normed = weight * rmsnorm(h), computed in float32 and
    rounded to h's dtype before the weight multiplies it (Hugging Face Llama's order)."""
    h = x if residual is None else x + residual  # (T, H)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h


def embed_feature_norm_reference(
    ids: torch.Tensor,  # (T,)
    table: torch.Tensor,  # (V, H) the embedding table
    g: torch.Tensor,  # (T, H) features
    w_e: torch.Tensor,  # (H,)
    w_f: torch.Tensor,  # (H,)
    eps_e: float,
    eps_f: float,
) -> torch.Tensor:  # (T, 2H)
    """[w_e * rmsnorm(table[ids]), w_f * rmsnorm(g in the table's dtype)] side by side (each as
    ``add_rmsnorm_reference``): an EAGLE draft's input."""
    e = add_rmsnorm_reference(torch.nn.functional.embedding(ids, table), None, w_e, eps_e)[0]
    f = add_rmsnorm_reference(g.to(e.dtype), None, w_f, eps_f)[0]
    return torch.cat([e, f], -1)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """silu(gate) * up for gate | up side by side in the last dimension."""
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def greedy_head_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (T, V) -> (T,), (T,)
    """Each row's argmax (int64; the first maximum on ties) and whether all of the row is finite (bool).
    A row with NaN or inf has an unspecified argmax: callers fail such rows."""
    return logits.argmax(-1), torch.isfinite(logits).all(-1)
