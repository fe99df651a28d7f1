"""One physical KV pool shared by the target and the draft model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """KV shape of one model: every layer stores K and V of (num_kv_heads, head_dim) per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def token_elems(self) -> int:
        return self.num_kv_heads * self.head_dim


class KVPool:
    """One storage tensor ``(num_blocks, block_elems)``; each model gets per-layer K/V views.

    Block layout (see docs/design.md): for model m, for layer l, K then V, each
    ``block_size * Hkv_m * D_m`` elements. Views share storage, so one block id covers
    every layer of every model.
    """

    def __init__(
        self,
        specs: list[KVSpec],
        block_size: int,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks or memory_bytes")
        self.specs = list(specs)
        self.block_size = block_size
        self.dtype = dtype
        self.seg_offsets, self.seg_token_elems = self._segments()
        self.block_elems = sum(block_size * s.token_elems * 2 * s.num_layers for s in self.specs)
        if num_blocks is None:
            num_blocks = int(memory_bytes) // (self.block_elems * torch.tensor([], dtype=dtype).element_size())
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (memory budget too small), got {num_blocks}")
        self.num_blocks = num_blocks
        self.storage = torch.zeros(num_blocks, self.block_elems, dtype=dtype, device=device)
        self._views = [self._model_views(m) for m in range(len(self.specs))]
        self._segments_dev: tuple[torch.Tensor, torch.Tensor] | None = None  # for the adoption kernel

    def _segments(self) -> tuple[list[int], list[int]]:
        offsets, widths, off = [], [], 0
        for s in self.specs:
            for _ in range(2 * s.num_layers):
                offsets.append(off)
                widths.append(s.token_elems)
                off += self.block_size * s.token_elems
        return offsets, widths

    def _model_views(self, model: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = self.specs[model]
        first = sum(2 * s.num_layers for s in self.specs[:model])
        shape = (self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        stride = (self.block_elems, spec.token_elems, spec.head_dim, 1)
        views = []
        for layer in range(spec.num_layers):
            k_off, v_off = self.seg_offsets[first + 2 * layer], self.seg_offsets[first + 2 * layer + 1]
            views.append((self.storage.as_strided(shape, stride, k_off),
                          self.storage.as_strided(shape, stride, v_off)))
        return views

    def layer_kv(self, model: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V cache views ``(num_blocks, block_size, Hkv, D)`` of one layer of one model."""
        return self._views[model][layer]

    def model_kv(self, model: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._views[model]

    @property
    def bytes_per_block(self) -> int:
        return self.block_elems * self.storage.element_size()

    def move_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every model's every layer K/V from ``src_slots`` to ``dst_slots`` (adoption).

        Precondition: dst_slots[i] <= src_slots[i], sorted by dst; sources are read before writes. Pairs with a
        negative slot are skipped.
        """
        if src_slots.numel() == 0:
            return
        if self.storage.is_cuda:  # one Triton launch for every layer of every model
            from specdec.kernels.kv_adopt import adopt_kv

            if self._segments_dev is None:
                dev = self.storage.device
                self._segments_dev = (torch.tensor(self.seg_offsets, dtype=torch.int64, device=dev),
                                      torch.tensor(self.seg_token_elems, dtype=torch.int64, device=dev))
            adopt_kv(self.storage, *self._segments_dev, self.block_size, src_slots, dst_slots,
                     max_token_elems=max(self.seg_token_elems))
            return
        keep = (src_slots >= 0) & (dst_slots >= 0)  # negative pairs are padding (as in the kernel)
        src_slots, dst_slots = src_slots[keep], dst_slots[keep]
        bs = self.block_size
        sb, so = src_slots // bs, src_slots % bs
        db, do = dst_slots // bs, dst_slots % bs
        for model in self._views:
            for k, v in model:
                k[db, do] = k[sb, so]
                v[db, do] = v[sb, so]
