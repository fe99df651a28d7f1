"""Sliding-window scratch pages: which blocks of a request no future query can read, and how many
blocks a windowed request holds at most.

Used only when every attention layer of every model that keeps KV in the pool (the target and a
draft model) has a sliding window. A query at logical position p of a model with window W reads
keys at positions > p - W (a tree node's p is L + its depth, never its slot). A request's future
queries start at ``num_computed`` for the target and ``num_computed_draft`` for the draft, so
every position below ``min_m(q_m - W_m + 1)`` is dead; a logical block wholly below that edge is
released (the request drops its reference) and its block-table entry becomes ``RELEASED``.
"""

from __future__ import annotations

from dataclasses import dataclass

RELEASED = -1  # block-table entry of a released logical block; no kernel reads it


def blocks_spanning(num_positions: int, block_size: int) -> int:
    """Most blocks that ``num_positions`` consecutive positions can touch, at any alignment."""
    if num_positions <= 0:
        return 0
    return -(-(num_positions - 1) // block_size) + 1


@dataclass(frozen=True)
class WindowReuse:
    """Release and capacity arithmetic for one engine.

    ``windows``: the sliding window of each model with KV in the pool, target first, then the
    draft (if it keeps KV). ``lookahead``: positions past the sequence a speculating row writes
    (the tree's node budget). ``draft_lag``: how far the draft's committed count may trail the
    target's at the start of a step (1 for a draft model: the last accepted node of a tree may
    be a leaf the draft never ran; 0 without draft KV).
    """

    windows: tuple[int, ...]
    block_size: int
    lookahead: int
    draft_lag: int = 0

    def __post_init__(self) -> None:
        if not self.windows or any(not isinstance(w, int) or w < 1 for w in self.windows):
            raise ValueError(f"windows must be a non-empty tuple of ints >= 1, got {self.windows!r}")
        if len(self.windows) > 2:
            raise ValueError(f"windows holds at most 2 models (target, draft), got {len(self.windows)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.draft_lag < 0:
            raise ValueError(f"draft_lag must be >= 0, got {self.draft_lag}")

    @property
    def max_window(self) -> int:
        return max(self.windows)

    def first_needed_position(self, num_computed: int, num_computed_draft: int) -> int:
        """The lowest logical position a future query of any model may read (>= 0)."""
        starts = (num_computed, num_computed_draft)[:len(self.windows)]
        return max(0, min(q - w + 1 for q, w in zip(starts, self.windows)))

    def num_dead_blocks(self, num_computed: int, num_computed_draft: int) -> int:
        """Leading logical blocks that lie wholly below every future query's window."""
        return self.first_needed_position(num_computed, num_computed_draft) // self.block_size

    def decode_peak(self) -> int:
        """Most blocks a decoding request holds: the window, the lagging draft query, the
        pending token and the tree's slots, after release and growth for the step."""
        return blocks_spanning(self.max_window + self.draft_lag + self.lookahead + 1, self.block_size)

    def prefill_peak(self, chunk: int) -> int:
        """Most blocks a request holds while one prefill chunk of ``chunk`` tokens runs."""
        return blocks_spanning(self.max_window - 1 + chunk, self.block_size)

    def peak(self, pending_prefill: int, max_chunk: int) -> int:
        """Most blocks a request holds from now on, with ``pending_prefill`` positions still to
        prefill in chunks of at most ``max_chunk`` tokens."""
        chunk = min(pending_prefill, max_chunk)
        return max(self.decode_peak(), self.prefill_peak(chunk) if chunk > 0 else 0)


def window_reuse_for(target_cfg, draft_cfg, draft_has_kv: bool, block_size: int,
                     lookahead: int) -> WindowReuse | None:
    """The engine's WindowReuse, or None when some model with KV in the pool attends without a
    window in some layer (its KV must then stay: see docs/design.md, mixed models)."""
    windows = [target_cfg.sliding_window]
    if draft_has_kv:
        windows.append(draft_cfg.sliding_window)
    if any(w is None for w in windows):
        return None
    return WindowReuse(tuple(int(w) for w in windows), block_size, lookahead, 1 if draft_has_kv else 0)


def live_blocks(blocks: list[int]) -> list[int]:
    """The physical blocks a request still holds (released entries left out)."""
    return [b for b in blocks if b != RELEASED]
