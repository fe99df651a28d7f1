"""The Triton attention backend and the backend chooser used by the model runner."""

from __future__ import annotations

import os

import torch

from specdec.attention.base import AttentionBackend, AttnMetadata
from specdec.attention.torch_backend import TorchAttentionBackend

PREFER_CHOICES = ("auto", "torch", "triton")


class TritonAttentionBackend(AttentionBackend):
    """Stores K/V with one Triton launch, then runs ``paged_attention_triton`` (sliding window included).

    The attention kernels' modules are imported when the backend is built, not when this module is: whether
    Triton compiles or interprets a kernel is fixed when its module is imported (TRITON_INTERPRET), so merely
    calling ``select_backend`` never decides it. The other kernels' modules hold the ops the models, drafters
    and graphs call (``kernels/norm_act.py``, ...; ``uses_triton`` picks their kernels), so they are imported
    with ``specdec``.
    """

    name = "triton"
    uses_triton = True
    wants_rope_tables = False  # the fused RoPE kernel reads the full cos/sin tables by position

    def __init__(self) -> None:
        from specdec.kernels.kv_store import store_kv_triton
        from specdec.kernels.paged_attention import paged_attention_triton
        from specdec.kernels.rope_cache import fused_rope_cache_write

        self._store = store_kv_triton
        self._attend = paged_attention_triton
        self._rope_store = fused_rope_cache_write

    def qkv_attention(self, qkv, positions, rope, rope_cs, k_cache, v_cache, meta: AttnMetadata, scale, heads,
                      sliding_window=None):
        """RoPE + K/V store in one launch (``fused_rope_cache_write``), then the attention kernel."""
        nh, nkv, hd = heads
        q, _, _ = self._rope_store(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping,
                                   nh, nkv, hd)
        return self.attend(q, k_cache, v_cache, meta, scale, sliding_window)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale, sliding_window=None):
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale, sliding_window)

    def attend(
        self,
        q: torch.Tensor,  # (T, Hq, D) already rotated
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), new tokens already stored
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # (T, Hq, D)
        """Attention only, for callers that stored K/V themselves (``fused_rope_cache_write``).

        Uses ``meta.max_query_len``/``max_seq_len`` when set (> 0), so no host sync happens.
        """
        return self._attend(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.prefix_lens,
            meta.seq_lens, meta.tree_mask, scale, sliding_window,
            max_query_len=meta.max_query_len or None, max_seq_len=meta.max_seq_len or None,
        )


def select_backend(device: torch.device | str, prefer: str = "auto") -> AttentionBackend:
    """Triton on CUDA and torch on CPU for "auto"; "torch" anywhere; "triton" on CUDA, or on CPU
    only under TRITON_INTERPRET=1 (the interpreter, for tests). Anything else is a ValueError."""
    if prefer not in PREFER_CHOICES:
        raise ValueError(f"prefer must be one of {PREFER_CHOICES}, got {prefer!r}")
    device = torch.device(device)
    if prefer == "torch" or (prefer == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if device.type == "cuda":
        return TritonAttentionBackend()
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return TritonAttentionBackend()
    interp = os.environ.get("TRITON_INTERPRET")
    raise ValueError(
        f"prefer='triton' needs a CUDA device, or device 'cpu' with TRITON_INTERPRET=1 in the environment "
        f"(Triton's interpreter); got device {device} and TRITON_INTERPRET={interp!r}"
    )
