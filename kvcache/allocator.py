"""Reference-counted allocator of physical KV blocks, plain Python and testable without a GPU."""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than requested; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} KV blocks but only {free} are free")
        self.requested = requested
        self.free = free


class BlockAllocator:
    """Hands out physical block ids; a block is free exactly when its reference count is zero.

    Only the allocator changes reference counts. ``allocate`` is all-or-nothing.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.frees = 0  # ``free`` calls so far: a caller that counted what is freeable knows when to count again

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def allocate(self, n: int) -> list[int]:
        """Return ``n`` fresh blocks with refcount 1, or raise OutOfBlocks leaving state unchanged."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Share already-allocated blocks (prefix reuse)."""
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} is free; only allocated blocks can be shared")
            self._refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        self.frees += 1
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not any(self._refcount)
