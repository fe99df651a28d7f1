"""Llama-family decoder (Llama, Qwen2, Mistral) in plain torch, attending through a backend.

Parameter names follow Hugging Face so checkpoints load without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.attention.base import AttentionBackend, AttnMetadata
from specdec.config import ModelConfig
from specdec.models.rope import RotaryEmbedding


@dataclass
class ForwardContext:
    """What one forward needs besides tokens: the backend, the batch metadata, this model's KV views."""

    backend: AttentionBackend
    meta: AttnMetadata
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.scale = self.hd**-0.5
        self.sliding_window = cfg.sliding_window

    def forward(self, x, positions, rope: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.nh, self.hd)  # (T, Hq, D)
        k = self.k_proj(x).view(t, self.nkv, self.hd)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.nkv, self.hd)  # (T, Hkv, D)
        q, k = rope(positions, q, k)
        k_cache, v_cache = ctx.kv[self.layer]
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, self.nh * self.hd))  # (T, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, ctx):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder over a packed batch of variable-length rows; positions are explicit."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final hidden states (T, hidden) of the packed tokens ``input_ids`` (T,)."""
        return self.forward_features(input_ids, positions, ctx)[0]

    def forward_features(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                         aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states (T, hidden) and the outputs of decoder layers ``aux_layers``
        concatenated in that order (T, len(aux_layers) * hidden), or None when none are asked."""
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        aux = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rope, ctx)
            if i in aux_layers:
                aux[i] = x
        return self.model.norm(x), torch.cat([aux[i] for i in aux_layers], -1) if aux_layers else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (T, V)
