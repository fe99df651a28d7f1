"""Persistent, bucket-padded inputs of a graphed forward: one pinned host buffer, one device twin.

A step with B rows of at most Q queries each runs in the (batch bucket, query bucket) that holds
it. Row b's verify/draft tokens sit at [b * Q, b * Q + n_b); the rest of the row and every row
past the batch are padding: slot -1 (nothing is stored), tree mask 0, zero queries for padded
rows. All int64 sections of a bucket are packed at the front of one buffer, so a step's metadata
reaches the device with one non-blocking copy of a few kilobytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

DRAFT_MODEL_INDEX = 1  # the pool model of a draft model (a Llama draft or an EAGLE one); the target is model 0
PREFILL = -1  # graph key model index of the target's prefill: model 0 over causal pieces, no logits
PREFILL_QUERY = 64  # tokens per prefill piece (a piece's region is one bitmask wide)


class StepViews(NamedTuple):
    """Device views of one bucket's inputs (all int64)."""

    ids: torch.Tensor  # (B*Q,)
    positions: torch.Tensor  # (B*Q,)
    slots: torch.Tensor  # (B*Q,) -1 = padding
    tree_mask: torch.Tensor  # (B*Q,) bitmask over the row's region
    parents: torch.Tensor  # (B*Q,) verify index of the parent within the row, -1 = root/padding
    qsl: torch.Tensor  # (B+1,)
    prefix_lens: torch.Tensor  # (B,)
    seq_lens: torch.Tensor  # (B,)
    num_tokens: torch.Tensor  # (B,) real tokens per row
    block_tables: torch.Tensor  # (B, W)


def _sizes(b: int, q: int, width: int) -> dict[str, int]:
    t = b * q
    return {"ids": t, "positions": t, "slots": t, "tree_mask": t, "parents": t, "qsl": b + 1,
            "prefix_lens": b, "seq_lens": b, "num_tokens": b, "block_tables": b * width}


def _offsets(b: int, q: int, width: int) -> tuple[dict[str, tuple[int, int]], int]:
    out, off = {}, 0
    for name, n in _sizes(b, q, width).items():
        out[name] = (off, n)
        off += n
    return out, off


class StepInputs:
    """Host (pinned on CUDA) and device int64 buffers sized for (max_batch, max_query) and block-table
    width ``width``. ``fill`` writes one bucket's inputs and starts their copy to the device."""

    def __init__(self, max_batch: int, max_query: int, width: int, device: torch.device) -> None:
        self.device, self.width = torch.device(device), width
        _, total = _offsets(max_batch, max_query, width)
        pin = self.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        self._np = self.host.numpy()
        self.dev = torch.zeros(total, dtype=torch.int64, device=self.device)
        self._copied = torch.cuda.Event() if pin else None
        self._views: dict[tuple[int, int], StepViews] = {}
        self._arrays: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._groups: dict[tuple[int, int], tuple] = {}

    def _host_arrays(self, b: int, q: int) -> dict[str, np.ndarray]:
        """numpy views of bucket (b, q)'s sections in the host buffer (cached per bucket)."""
        if (b, q) not in self._arrays:
            offs, _ = _offsets(b, q, self.width)
            self._arrays[(b, q)] = {n: self._np[o:o + size] for n, (o, size) in offs.items()}
        return self._arrays[(b, q)]

    def _grouped(self, b: int, q: int):
        """Host views of bucket (b, q): the five per-token sections (5, B*Q), qsl (B+1,), the three per-row
        sections (3, B), the block tables (B, W), and the bucket's length in the buffer (cached)."""
        if (b, q) not in self._groups:
            offs, total = _offsets(b, q, self.width)
            (t0, t), (r0, _) = offs["ids"], offs["prefix_lens"]
            q0, bt0 = offs["qsl"][0], offs["block_tables"][0]
            self._groups[(b, q)] = (self._np[t0:t0 + 5 * t].reshape(5, t), self._np[q0:q0 + b + 1],
                                    self._np[r0:r0 + 3 * b].reshape(3, b),
                                    self._np[bt0:bt0 + b * self.width].reshape(b, self.width), total)
        return self._groups[(b, q)]

    def views(self, b: int, q: int) -> StepViews:
        """Device views of bucket (b, q); the same tensors every call (graphs capture them)."""
        if (b, q) not in self._views:
            offs, _ = _offsets(b, q, self.width)
            v = {n: self.dev[o:o + size] for n, (o, size) in offs.items()}
            v["block_tables"] = v["block_tables"].view(b, self.width)
            self._views[(b, q)] = StepViews(**v)
        return self._views[(b, q)]

    def clear(self, b: int, q: int) -> None:
        """Write an all-padding step (used while capturing: no kernel stores or reads anything)."""
        a = self._host_arrays(b, q)
        for arr in a.values():
            arr[:] = 0
        a["slots"][:] = -1
        a["parents"][:] = -1
        self._send(b, q)

    def fill(self, b: int, q: int, rows, slots: list[list[int]], bt_rows: np.ndarray) -> None:
        """Write the rows (``RowInput``-like: token_ids, positions, prefix_len, seq_len, tree_mask, parents)
        into bucket (b, q) and copy it to the device. ``slots[i]`` are row i's query slots and
        ``bt_rows`` its block-table rows (len(rows), W)."""
        self.fill_packed(b, q, pack_rows(rows, slots, q), bt_rows)

    def fill_packed(self, b: int, q: int, p: PackedRows, bt_rows: np.ndarray) -> None:
        """``fill`` for rows already flattened into ``p``: one vectorised write per group of sections (the
        five per-token sections are contiguous, and so are the three per-row ones after ``qsl``)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the host buffer
        tokens, qsl, per_row, bt, total = self._grouped(b, q)
        nrows = p.per_row.shape[1]
        # Padding: token 0 at position 0, no slot (nothing stored), no parent, zero-length rows. (Buckets
        # lay their sections out differently in one buffer, so nothing stale may be left in them.)
        self._np[:total] = 0
        tokens[2::2] = -1  # slots and parents
        tokens[:, p.index] = p.tokens
        qsl[:] = np.minimum(np.arange(b + 1), nrows) * q
        per_row[:, :nrows] = p.per_row
        bt[:nrows] = bt_rows
        self._send(b, q)

    def _send(self, b: int, q: int) -> None:
        n = self._grouped(b, q)[-1]
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class PackedRows(NamedTuple):
    """The queries of R rows of a padded step with Q queries per row, flattened row after row: token t
    sits at ``index[t]`` (= row * Q + its rank in the row) of the padded layout. int64 numpy arrays."""

    index: np.ndarray  # (T,)
    tokens: np.ndarray  # (5, T): ids, RoPE positions, KV slots (-1 = store nothing), tree masks (bitmask over
    #                     the row's region, 0 for a causal single query), parents (verify index, -1 = root)
    per_row: np.ndarray  # (3, R): prefix_lens, seq_lens, num_tokens


def pack_rows(rows, slots: list[list[int]], q: int) -> PackedRows:
    """``PackedRows`` of ``RowInput``-like rows with their query slots (a missing tree mask is 0, a
    missing parent list all -1)."""
    ids, pos, flat_slots, masks, parents, index = [], [], [], [], [], []
    for i, (r, s) in enumerate(zip(rows, slots)):
        n = len(r.token_ids)
        ids += r.token_ids
        pos += r.positions
        flat_slots += s
        masks += r.tree_mask if r.tree_mask is not None else (0,) * n
        parents += r.parents if r.parents is not None else (-1,) * n
        index += range(i * q, i * q + n)
    per_row = [[r.prefix_len for r in rows], [r.seq_len for r in rows], [len(r.token_ids) for r in rows]]
    return PackedRows(np.array(index, dtype=np.int64), np.array([ids, pos, flat_slots, masks, parents], dtype=np.int64),
                      np.array(per_row, dtype=np.int64).reshape(3, len(rows)))
