"""Per-request block tables kept in one host tensor, staged to the device once per step."""

from __future__ import annotations

import torch


class BlockTables:
    """Rows of logical -> physical block ids, one row per live request.

    ``stage`` gathers the active rows on the host and copies them to a new device tensor. The gathered rows are
    pageable memory: a non-blocking copy from pageable memory has read its source when it returns, so the next
    ``stage`` may gather again at once (a pinned staging buffer would be overwritten while an earlier copy from it
    still waits behind queued GPU work, and that copy would carry the later rows).
    """

    def __init__(self, max_rows: int, max_blocks_per_row: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.host = torch.zeros(max_rows, max_blocks_per_row, dtype=torch.int32)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.max_blocks_per_row = max_blocks_per_row
        self._np = self.host.numpy()
        self._written: list[list[int]] = [[] for _ in range(max_rows)]  # what each host row holds now

    def acquire_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free block-table rows: too many live requests")
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self._np[row] = 0
        self._written[row] = []
        self._free_rows.append(row)

    def set_row(self, row: int, blocks: list[int]) -> None:
        """Make host row ``row`` start with ``blocks``; writes only what changed since the last call."""
        if len(blocks) > self.max_blocks_per_row:
            raise ValueError(
                f"sequence needs {len(blocks)} blocks, more than max_blocks_per_row={self.max_blocks_per_row}"
            )
        old = self._written[row]
        if old == blocks:
            return
        k, n = len(old), len(blocks)
        if n > k and blocks[:k] == old:  # grew: write the new tail
            self._np[row, k:n] = blocks[k:]
            old += blocks[k:]
        elif n < k and old[:n] == blocks:  # shrank: the row already starts with blocks
            del old[n:]
        else:
            self._np[row, :n] = blocks
            self._written[row] = list(blocks)

    def set_rows(self, reqs) -> None:
        """``set_row(req.bt_row, req.blocks)`` for each request; rows already holding their blocks cost one
        comparison each."""
        written = self._written
        for req in reqs:
            if written[req.bt_row] != req.blocks:
                self.set_row(req.bt_row, req.blocks)

    def host_rows(self, rows: list[int]):
        """numpy copy (len(rows), max_blocks_per_row) int32 of the given host rows, in order."""
        return self._np[rows]

    def stage(self, rows: list[int]) -> torch.Tensor:
        """Device tensor ``(len(rows), max_blocks_per_row)`` holding the given rows, in order."""
        rows = torch.from_numpy(self._np[rows])  # (a copy: numpy fancy indexing)
        return rows if self.device.type == "cpu" else rows.to(self.device, non_blocking=True)
