"""The attention-backend contract shared by the models, the engine and the kernels.

A forward pass runs over a *packed* batch: the query tokens of B rows laid end to end
(T tokens in all). Row b sees logical positions ``0 .. seq_lens[b]-1`` of its block
table, split in two: the *prefix* ``[0, prefix_lens[b])``, which every query of the row
may see, and the *region* ``[prefix_lens[b], seq_lens[b])`` of R tokens, whose visibility
is masked. The row's q_len queries are the LAST q_len positions of the region (q_len <= R;
usually q_len == R); their K/V are written at ``slot_mapping`` before attending, the
earlier region positions are already cached (a draft tree grown level by level).
Within the region the mask is causal (query at region position r sees region positions
<= r), or, when ``tree_mask`` is given, a query sees region position j iff bit j of its
``tree_mask`` entry is set (its own bit is always set). With q_len == R and causal rows,
this is ordinary chunked prefill / decode.

With a sliding window W every query sits at or after ``prefix_lens[b]``, so no key below
``prefix_lens[b] - W + 1`` is visible; block-table entries wholly below it may be RELEASED (-1,
``specdec.kvcache.sliding_window``) and a backend must not read them.

Physical slot = block_id * block_size + offset. K/V caches are
(num_blocks, block_size, num_kv_heads, head_dim) views whose block stride may be larger
than block_size * num_kv_heads * head_dim (one storage holds every layer of both models).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttnMetadata:
    """Where the new tokens of a packed batch go and what each may attend to.

    Built once per forward by the engine; backends only read it.
    """

    query_start_loc: torch.Tensor  # (B+1,) int32: row b's new tokens are [qsl[b], qsl[b+1])
    prefix_lens: torch.Tensor  # (B,) int32: tokens already cached, fully visible
    seq_lens: torch.Tensor  # (B,) int32: prefix_lens + new tokens
    block_tables: torch.Tensor  # (B, max_blocks) int32: logical block -> physical block
    slot_mapping: torch.Tensor  # (T,) int64: physical slot of each new token
    block_size: int
    tree_mask: torch.Tensor | None = None  # (T,) int64 bitmask over the row's region, or None = causal
    max_query_len: int = 0  # host-side copies, so backends need not sync
    max_seq_len: int = 0
    host_query_start_loc: list[int] | None = None
    host_seq_lens: list[int] | None = None
    host_prefix_lens: list[int] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(ABC):
    """Writes the new tokens' K/V into the paged cache, then attends.

    Callers own the cache tensors; a backend writes only the slots in
    ``meta.slot_mapping`` and reads only slots reachable through ``meta.block_tables``
    below ``meta.seq_lens``.
    """

    name: str = "abstract"
    wants_rope_tables: bool = True  # qkv_attention reads cos/sin gathered once per forward (ctx.rope_cs)
    uses_triton: bool = False  # the ops around attention (``specdec.kernels``) run their Triton kernels

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D) already rotated
        k: torch.Tensor,  # (T, Hkv, D) already rotated
        v: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        meta: AttnMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # (T, Hq, D)
        """Store k/v at ``meta.slot_mapping`` and return attention output for q."""

    def qkv_attention(
        self,
        qkv: torch.Tensor,  # (T, (Hq + 2 Hkv) * D): q | k | v projections side by side
        positions: torch.Tensor,  # (T,) RoPE positions
        rope,  # the model's RotaryEmbedding (full cos/sin tables)
        rope_cs: tuple[torch.Tensor, torch.Tensor] | None,  # (T, 1, D/2) cos, sin at positions
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        scale: float,
        heads: tuple[int, int, int],  # (Hq, Hkv, D)
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # (T, Hq, D)
        """Split q/k/v, rotate q and k, store k/v, attend: ``forward`` after RoPE. Backends may fuse it."""
        from specdec.models.rope import rotate

        nh, nkv, hd = heads
        q, k, v = qkv.view(qkv.shape[0], nh + 2 * nkv, hd).split([nh, nkv, nkv], dim=1)  # (T, H*, D)
        cos, sin = rope_cs if rope_cs is not None else rope.gather(positions)
        return self.forward(rotate(q, cos, sin), rotate(k, cos, sin), v, k_cache, v_cache, meta, scale,
                            sliding_window)
