"""Training-time forward of our Llama modules: dense causal attention over padded (B, S) batches.

The engine's backends read and write a paged KV pool under ``inference_mode``; distillation needs
autograd instead, so this backend ignores the caches and attends with
``scaled_dot_product_attention`` over right-padded rows (padding after a row's tokens never
changes that row's outputs, because the mask is causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.attention.base import AttentionBackend
from specdec.models.llama import ForwardContext, LlamaForCausalLM


@dataclass(frozen=True)
class DenseBatch:
    """Stands in for ``AttnMetadata``: the packed tokens are ``batch`` rows of ``seq_len`` each."""

    batch: int
    seq_len: int


class DenseCausalBackend(AttentionBackend):
    """Causal (optionally sliding-window) attention over full rows; never touches a KV cache."""

    name = "dense-causal"

    def forward(self, q, k, v, k_cache, v_cache, meta: DenseBatch, scale: float, sliding_window=None):
        b, s = meta.batch, meta.seq_len
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        q4 = q.view(b, s, hq, d).transpose(1, 2)  # (B, Hq, S, D)
        k4 = k.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)  # (B, Hq, S, D)
        v4 = v.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)  # (B, Hq, S, D)
        if sliding_window is None:
            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)  # (B, Hq, S, D)
        else:
            i = torch.arange(s, device=q.device)
            allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)  # (S, S)
            o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=allowed, scale=scale)
        return o.transpose(1, 2).reshape(b * s, hq, d)  # (T, Hq, D)


def dense_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states (B, S, hidden) of right-padded rows ``ids`` (B, S), with autograd."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).repeat(b)  # (B*S,)
    ctx = ForwardContext(DenseCausalBackend(), DenseBatch(b, s), [(None, None)] * model.config.num_layers)
    return model(ids.reshape(-1), positions, ctx).view(b, s, -1)  # (B, S, hidden)
