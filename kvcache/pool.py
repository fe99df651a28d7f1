"""One physical KV pool shared by the target and the draft model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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

    ``feature_width`` > 0 (an EAGLE draft): ``features`` (num_blocks * block_size + 2, feature_width) holds, per
    slot, the target features an EAGLE draft reads (the outputs of the target layers it fuses) of the token
    whose KV is in that slot, written by every target forward that computes them (``store_features``) and moved
    with the KV (``move_slots``), so they live and die with the slot. Row ``feature_zero`` stays zero (the
    input of position 0, and of a position whose slot was released); the row after it takes the writes of
    padding queries (slot -1).
    """

    def __init__(
        self,
        specs: list[KVSpec],
        block_size: int,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        feature_width: int = 0,
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
        if num_blocks is None:  # (a block's features count against the budget too)
            per_block = (self.block_elems + block_size * feature_width) * torch.tensor([], dtype=dtype).element_size()
            num_blocks = int(memory_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (memory budget too small), got {num_blocks}")
        self.num_blocks = num_blocks
        self.storage = torch.zeros(num_blocks, self.block_elems, dtype=dtype, device=device)
        self._views = [self._model_views(m) for m in range(len(self.specs))]
        self._segments_dev: tuple[torch.Tensor, torch.Tensor] | None = None  # for the adoption kernel
        self.feature_zero = num_blocks * block_size
        self.features = (torch.zeros(self.feature_zero + 2, feature_width, dtype=dtype, device=device)
                         if feature_width else None)
        # the adoption kernel's one segment for the features (made here: never first inside a graph capture)
        self._feature_seg = None if self.features is None else (
            torch.zeros(1, dtype=torch.int64, device=device), torch.full((1,), feature_width, dtype=torch.int64,
                                                                         device=device))

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
        width = 0 if self.features is None else self.features.shape[1]
        return (self.block_elems + self.block_size * width) * self.storage.element_size()

    def store_features(self, slots: torch.Tensor, feats: torch.Tensor) -> None:
        """Target features ``feats`` (T, feature_width) of the tokens whose KV goes to ``slots`` (T,) (-1: a
        padding query, whose row is not kept); no host sync, so a captured forward writes them too."""
        if self.features is None:
            return
        rows = torch.where(slots < 0, self.feature_zero + 1, slots)
        self.features.index_copy_(0, rows, feats.to(self.features.dtype))

    def feature_rows(self, block_table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rows of ``features`` holding the features of ``positions`` (any shape, int64) of rows whose block-table
        rows are ``block_table`` (one per leading index of ``positions``: (R, W) for (R, ...)); the zero row
        where a position is negative or its block was released (a negative block id)."""
        bs = self.block_size
        p = np.maximum(positions, 0)
        blocks = np.take_along_axis(block_table, (p // bs).reshape(len(block_table), -1), 1).reshape(p.shape)
        ok = (positions >= 0) & (blocks >= 0)
        return np.where(ok, blocks.astype(np.int64) * bs + p % bs, self.feature_zero)

    def feature_rows_on_device(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``feature_rows`` of device tensors, without a host read (a captured forward computes them): ``positions``
        (R, n) int64 of rows whose block tables are ``block_table`` (R, W) int64."""
        bs = self.block_size
        p = positions.clamp(min=0)
        blocks = block_table.gather(1, p // bs)
        return torch.where((positions >= 0) & (blocks >= 0), blocks * bs + p % bs, self.feature_zero)

    def move_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every model's every layer K/V (and the slots' features) from ``src_slots`` to ``dst_slots``
        (adoption).

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
            if self.features is not None:  # the same kernel over the features, one segment of one row a slot
                width = self.features.shape[1]
                adopt_kv(self.features[:self.feature_zero].view(self.num_blocks, -1), *self._feature_seg,
                         self.block_size, src_slots, dst_slots, max_token_elems=width)
            return
        keep = (src_slots >= 0) & (dst_slots >= 0)  # negative pairs are padding (as in the kernel)
        src_slots, dst_slots = src_slots[keep], dst_slots[keep]
        if self.features is not None:
            self.features[dst_slots] = self.features[src_slots]
        bs = self.block_size
        sb, so = src_slots // bs, src_slots % bs
        db, do = dst_slots // bs, dst_slots % bs
        for model in self._views:
            for k, v in model:
                k[db, do] = k[sb, so]
                v[db, do] = v[sb, so]
