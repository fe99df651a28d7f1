"""Rotary position embeddings (default, linear, llama3 scaling), Hugging Face rotate-half layout."""

from __future__ import annotations

import math

import torch

from specdec.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:  # (D/2,) float64
    """Per-pair rotation frequencies after applying the config's rope scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        return _llama3(inv, rs)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


def _llama3(inv: torch.Tensor, rs: dict) -> torch.Tensor:
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables ``(max_pos, D/2)``; ``forward`` rotates q and k in place-free style."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        n = max_positions or cfg.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inverse_frequencies(cfg))  # (n, D/2)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, D/2) at ``positions`` (T,): gathered once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate q (T, Hq, D) and k (T, Hkv, D) at ``positions`` (T,)."""
        cos, sin = self.gather(positions)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (T, H, D) with cos/sin (T, 1, D/2), fp32 math, one rounding."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
