"""Llama-family decoder (Llama, Qwen2, Mistral) in plain torch, attending through a backend.

Parameter names follow Hugging Face so checkpoints load without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.attention.base import AttentionBackend, AttnMetadata
from specdec.config import ModelConfig
from specdec.kernels.norm_act import add_rmsnorm, silu_mul
from specdec.models.layer_ops import add_rmsnorm_reference
from specdec.models.rope import RotaryEmbedding


@dataclass
class ForwardContext:
    """What one forward needs besides tokens: the backend, the batch metadata, this model's KV views."""

    backend: AttentionBackend
    meta: AttnMetadata
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    rope_cs: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin (T, 1, D/2) gathered once per forward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rmsnorm_reference(x, None, self.weight, self.eps)[0]


class Attention(nn.Module):
    """q/k/v projections (fused into one matmul after ``fuse``), RoPE + cache write + attention
    through the backend, output projection."""

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
        self.qkv_weight: torch.Tensor | None = None  # set by fuse(): q | k | v rows, one matmul
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """Concatenate the q/k/v weights into one matrix; the three projections become views of it."""
        if _fused_valid(self.q_proj, self.qkv_weight, for_grad=False):
            return
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _fuse_params(projections)
        if self.q_proj.bias is not None:
            self.qkv_bias = _fuse_params(projections, "bias")

    def forward(self, x, positions, rope: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        if _fused_valid(self.q_proj, self.qkv_weight):
            qkv = nn.functional.linear(x, self.qkv_weight, self.qkv_bias)  # (T, (Hq + 2 Hkv) D)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        k_cache, v_cache = ctx.kv[self.layer]
        o = ctx.backend.qkv_attention(qkv, positions, rope, ctx.rope_cs, k_cache, v_cache, ctx.meta, self.scale,
                                      (self.nh, self.nkv, self.hd), self.sliding_window)  # (T, Hq, D)
        return self.o_proj(o.reshape(t, self.nh * self.hd))  # (T, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse(): gate | up rows

    def fuse(self) -> None:
        """Concatenate gate and up weights into one matrix; both projections become views of it."""
        if not _fused_valid(self.gate_proj, self.gate_up_weight, for_grad=False):
            self.gate_up_weight = _fuse_params((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if not _fused_valid(self.gate_proj, self.gate_up_weight):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = nn.functional.linear(x, self.gate_up_weight)  # (T, 2I)
        return self.down_proj(silu_mul(gate_up, use_triton=ctx.backend.uses_triton))  # (T, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rope, ctx):
        """(x, residual) -> (x, residual): the layer's output is x + residual (summed by the next norm)."""
        norm_in, norm_post, triton = self.input_layernorm, self.post_attention_layernorm, ctx.backend.uses_triton
        h, residual = add_rmsnorm(x, residual, norm_in.weight, norm_in.eps, use_triton=triton)
        x = self.self_attn(h, positions, rope, ctx)
        h, residual = add_rmsnorm(x, residual, norm_post.weight, norm_post.eps, use_triton=triton)
        return self.mlp(h, ctx), residual


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

    def fuse(self) -> LlamaForCausalLM:
        """Fuse q/k/v and gate/up projections for inference (call once the model sits on its device and
        dtype; the separate projections stay as views, so state_dict and training are unchanged)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final hidden states (T, hidden) of the packed tokens ``input_ids`` (T,)."""
        return self.forward_features(input_ids, positions, ctx)[0]

    def forward_features(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                         aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states (T, hidden) and the outputs of decoder layers ``aux_layers``
        concatenated in that order (T, len(aux_layers) * hidden), or None when none are asked."""
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        ctx.rope_cs = self.rope.gather(positions) if ctx.backend.wants_rope_tables else None
        residual, aux = None, {}
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rope, ctx)
            if i in aux_layers:
                aux[i] = x + residual  # the layer's output
        norm = self.model.norm
        hidden = add_rmsnorm(x, residual, norm.weight, norm.eps, use_triton=ctx.backend.uses_triton)[0]
        return hidden, torch.cat([aux[i] for i in aux_layers], -1) if aux_layers else None

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """(T, V) logits of ``hidden`` (T, hidden) in ``dtype`` (None: the model's own, as the LM head computes)."""
        logits = self.lm_head(hidden)
        return logits if dtype is None else logits.to(dtype)


def _fused_valid(first: nn.Linear, fused: torch.Tensor | None, for_grad: bool = True) -> bool:
    """Whether a fused weight may stand in for its projections: it exists, the projections are still
    views of it (``.to()``/``.float()`` or loading replace them), and (``for_grad``) no gradient is
    wanted (the fused tensor is detached, so training uses the separate projections)."""
    w = first.weight
    if fused is None or w.data_ptr() != fused.data_ptr() or w.dtype != fused.dtype:
        return False
    return not (for_grad and torch.is_grad_enabled() and w.requires_grad)


def _fuse_params(linears: tuple[nn.Linear, ...], name: str = "weight") -> torch.Tensor:
    """One tensor holding the linears' ``name`` ("weight" or "bias") rows side by side; each linear's
    parameter becomes a view of it."""
    fused = torch.cat([getattr(lin, name).detach() for lin in linears])  # (sum out, ...)
    start = 0
    for lin in linears:
        n = getattr(lin, name).shape[0]
        setattr(lin, name, nn.Parameter(fused[start:start + n], requires_grad=getattr(lin, name).requires_grad))
        start += n
    return fused
