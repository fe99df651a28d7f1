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


class PaddedRows(NamedTuple):
    """The rows of a padded step as numpy arrays: packed queries (T,) and per-row values (R,)."""

    where: np.ndarray  # (T,) each query's index in the padded layout (row * Q + its index in the row)
    ids: np.ndarray  # (T,)
    positions: np.ndarray  # (T,)
    slots: np.ndarray  # (T,)
    tree_mask: np.ndarray  # (T,) bitmask over the row's region
    num_tokens: np.ndarray  # (R,)
    prefix_lens: np.ndarray  # (R,)
    seq_lens: np.ndarray  # (R,)
    block_tables: np.ndarray  # (R, W)


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


def _total(b: int, q: int, width: int) -> int:
    return sum(_sizes(b, q, width).values())


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

    def _host_arrays(self, b: int, q: int) -> dict[str, np.ndarray]:
        """numpy views of bucket (b, q)'s sections in the host buffer (cached per bucket)."""
        if (b, q) not in self._arrays:
            offs, _ = _offsets(b, q, self.width)
            self._arrays[(b, q)] = {n: self._np[o:o + size] for n, (o, size) in offs.items()}
        return self._arrays[(b, q)]

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
        nrows = len(rows)
        a = self._padding(b, q, nrows)
        if q == 1:  # decode: one token per row, so each section is written in one assignment
            self._fill_single(a, rows, slots)
        for i, r in enumerate(rows if q > 1 else ()):
            n, s = len(r.token_ids), i * q
            a["ids"][s:s + n] = r.token_ids
            a["positions"][s:s + n] = r.positions
            a["slots"][s:s + n] = slots[i]
            if r.tree_mask is not None:
                a["tree_mask"][s:s + n] = r.tree_mask
            if r.parents is not None:
                a["parents"][s:s + n] = r.parents
            a["num_tokens"][i] = n
        a["prefix_lens"][:nrows] = [r.prefix_len for r in rows]
        a["seq_lens"][:nrows] = [r.seq_len for r in rows]
        self._finish(a, b, q, nrows, bt_rows)

    def fill_padded(self, b: int, q: int, rows: PaddedRows) -> None:
        """``fill`` from arrays (no parents: every query's is -1): one numpy assignment per section."""
        nrows = len(rows.num_tokens)
        a = self._padding(b, q, nrows)
        for name in ("ids", "positions", "slots", "tree_mask"):
            a[name][rows.where] = getattr(rows, name)
        for name in ("num_tokens", "prefix_lens", "seq_lens"):
            a[name][:nrows] = getattr(rows, name)
        self._finish(a, b, q, nrows, rows.block_tables)

    def _padding(self, b: int, q: int, nrows: int) -> dict[str, np.ndarray]:
        """Bucket (b, q)'s host sections, all padding past ``nrows`` rows and in every query: token 0 at
        position 0, no slot (nothing stored), no parent, zero-length rows. (Buckets lay their sections out
        differently in one buffer, so nothing stale may be left in them.)"""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the host buffer
        a = self._host_arrays(b, q)
        for name in ("ids", "positions", "tree_mask"):
            a[name][:] = 0
        a["slots"][:] = -1
        a["parents"][:] = -1
        for name in ("prefix_lens", "seq_lens", "num_tokens"):
            a[name][nrows:] = 0
        a["block_tables"][nrows * self.width:] = 0  # the torch reference gathers every row's table
        return a

    def _finish(self, a: dict[str, np.ndarray], b: int, q: int, nrows: int, bt_rows: np.ndarray) -> None:
        """Write the query offsets and block tables of ``nrows`` rows and copy bucket (b, q) to the device."""
        a["qsl"][:nrows + 1] = np.arange(nrows + 1) * q
        a["qsl"][nrows + 1:] = nrows * q
        a["block_tables"].reshape(b, self.width)[:nrows] = bt_rows
        self._send(b, q)

    @staticmethod
    def _fill_single(a: dict[str, np.ndarray], rows, slots: list[list[int]]) -> None:
        nrows = len(rows)
        a["ids"][:nrows] = [r.token_ids[0] for r in rows]
        a["positions"][:nrows] = [r.positions[0] for r in rows]
        a["slots"][:nrows] = [s[0] for s in slots]
        if any(r.tree_mask is not None for r in rows):
            a["tree_mask"][:nrows] = [0 if r.tree_mask is None else r.tree_mask[0] for r in rows]
        a["parents"][:nrows] = [-1 if r.parents is None else r.parents[0] for r in rows]
        a["num_tokens"][:nrows] = 1

    def _send(self, b: int, q: int) -> None:
        n = _total(b, q, self.width)
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
