"""Prefix reuse: a radix tree of full KV blocks keyed by chained blake3 hashes.

Ownership rules:

* Only this cache changes its tree (nodes, children, LRU stamps, in-progress marks).
* Only the allocator changes reference counts. The cache holds exactly one reference
  (taken with ``allocator.incref``) on the physical block of every node in its tree and
  drops it (``allocator.free``) when the node is evicted. A request holds one reference on
  each block in ``req.blocks``; ``attach``/``adopt`` incref cached blocks on its behalf and
  ``release`` drops them. A sliding-window request may drop a block early (its entry in
  ``req.blocks`` becomes ``RELEASED``); a cached block it dropped stays with the cache.
* The cache writes a request's ``blocks``/``num_computed``/``num_computed_draft``/
  ``num_cached_tokens`` only in ``attach`` and ``adopt``; it never reads or writes KV data.

A node stands for one full block (``block_size`` tokens). The hash of block i is
``blake3(hash(block i-1) || tokens of block i as little-endian int64)``, with an empty
hash before block 0, so a hash names the whole prefix. A hash alone is never trusted: a
hit also requires the node's tokens to equal the block's tokens and the node to hang
under the node matched for the previous block.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass, field

from blake3 import blake3
from specdec.kvcache.allocator import BlockAllocator
from specdec.kvcache.sliding_window import RELEASED, live_blocks

_ROOT_HASH = b""


def _block_hash(prev: bytes, tokens: tuple[int, ...]) -> bytes:
    """Chained hash of one block: blake3(prev || tokens as little-endian int64)."""
    return blake3(prev + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


@dataclass(eq=False)
class _Node:
    """One cached full block; ``children`` are keyed by the child's chained hash."""

    hash: bytes
    tokens: tuple[int, ...]
    block: int
    parent: _Node | None
    last_use: int = 0
    seq: int = 0  # creation order: breaks LRU ties deterministically
    children: dict[bytes, _Node] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheStats:
    """Counters of the prefix cache.

    ``lookups`` counts ``attach`` calls and ``hits`` those that matched at least one block;
    ``hit_tokens`` counts tokens served from the cache by ``attach`` and ``adopt``.
    """

    hits: int
    lookups: int
    hit_tokens: int
    cached_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


EVICT_SLACK = 32  # an eviction that walks the cache frees 1/32 of it beyond what was asked (``make_room``)


class RadixPrefixCache:
    """Shares the KV of full prompt/output blocks between requests with a common prefix.

    Used by the scheduler (``attach`` on admission, ``make_room`` before allocating,
    ``num_evictable`` in admission checks, ``release`` on finish/preempt, optionally
    ``note_in_progress``/``pending_block``/``adopt`` for prefix-aware skipping) and by the
    engine (``insert`` after each prefill chunk, ``evict_all`` before checking for leaks).
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self._root = _Node(_ROOT_HASH, (), -1, None)
        self._num_nodes = 0
        self._clock = self._seq = 0
        self._hits = self._lookups = self._hit_tokens = 0
        self._hashes: dict[object, list[bytes]] = {}  # per request: chained hashes of its full blocks
        # hash -> {request: block index} for blocks a chunked prefill is producing right now
        self._in_progress: dict[bytes, dict[object, int]] = {}
        self._in_progress_of: dict[object, set[bytes]] = {}

    # ------------------------------------------------------------------ hashing and lookup

    def _block_tokens(self, req, i: int) -> tuple[int, ...]:
        return tuple(req.tokens[i * self.block_size:(i + 1) * self.block_size])

    def _req_hashes(self, req, n: int) -> list[bytes]:
        """Chained hashes of the request's first ``n`` full blocks (memoised per request)."""
        hashes = self._hashes.setdefault(req, [])
        while len(hashes) < n:
            i = len(hashes)
            hashes.append(_block_hash(hashes[-1] if hashes else _ROOT_HASH, self._block_tokens(req, i)))
        return hashes[:n]

    def _child(self, node: _Node, h: bytes, tokens: tuple[int, ...]) -> _Node | None:
        """The child of ``node`` holding exactly ``tokens``, or None (a mere hash match is no hit)."""
        child = node.children.get(h)
        return child if child is not None and child.tokens == tokens else None

    def _match(self, req, max_blocks: int) -> list[_Node]:
        """The longest cached chain of nodes matching the request's first ``max_blocks`` blocks."""
        path, node, prev = [], self._root, _ROOT_HASH
        hashes = self._hashes.get(req, [])
        for i in range(max_blocks):
            tokens = self._block_tokens(req, i)
            h = hashes[i] if i < len(hashes) else _block_hash(prev, tokens)
            if i == len(hashes):
                hashes.append(h)
            child = self._child(node, h, tokens)
            if child is None:
                break
            path.append(child)
            node, prev = child, h
        self._hashes[req] = hashes
        return path

    def _touch(self, nodes: list[_Node]) -> None:
        self._clock += 1
        for n in nodes:
            n.last_use = self._clock

    def _max_reusable_blocks(self, req) -> int:
        """Full blocks of ``tokens[:-1]``: the pending last token is never served from the cache; none for a request
        that asks for its prompt's log-probabilities (``SamplingParams.prompt_logprobs``), which its prefill's logits
        give: it computes the whole prompt (and its blocks are cached for others after)."""
        if req.params.prompt_logprobs is not None:
            return 0
        return max(len(req.tokens) - 1, 0) // self.block_size

    # ------------------------------------------------------------------ request lifecycle

    def attach(self, req) -> None:
        """On admission: give ``req`` the longest cached chain of full blocks of ``tokens[:-1]``.

        ``req.blocks`` must be empty. Sets ``num_computed``, ``num_computed_draft`` and
        ``num_cached_tokens`` to the matched length (a multiple of ``block_size``).
        """
        if req.blocks:
            raise ValueError(f"attach needs a request without blocks; {req.request_id} has {len(req.blocks)}")
        path = self._match(req, self._max_reusable_blocks(req))
        blocks = [n.block for n in path]
        self.allocator.incref(blocks)
        req.blocks = blocks
        req.num_computed = req.num_computed_draft = req.num_cached_tokens = len(blocks) * self.block_size
        self._lookups += 1
        if blocks:
            self._hits += 1
            self._hit_tokens += len(blocks) * self.block_size
            self._touch(path)

    def insert(self, req) -> int:
        """Cache the request's full blocks whose KV both models have computed; return how many were new.

        Blocks fully below ``min(num_computed, num_computed_draft)`` (and inside ``tokens``)
        qualify. A new node takes its own reference on the request's block. If an equal block
        (same hash and tokens) is already cached, the cached one is kept and the request keeps
        its own copy; the request's later blocks are chained under the cached node. A block the
        request released before it was cached cannot be placed, nor anything after it.
        """
        done = min(req.num_computed, req.num_computed_draft, len(req.tokens))
        n_full = min(done // self.block_size, len(req.blocks))
        hashes = self._req_hashes(req, n_full)
        node, path, added = self._root, [], 0
        for i, h in enumerate(hashes):
            tokens = self._block_tokens(req, i)
            child = node.children.get(h)
            if child is None:
                if req.blocks[i] == RELEASED:
                    break
                self.allocator.incref([req.blocks[i]])
                self._seq += 1
                child = _Node(h, tokens, req.blocks[i], node, seq=self._seq)
                node.children[h] = child
                self._num_nodes += 1
                added += 1
            elif child.tokens != tokens:
                break  # a hash collision: this block cannot be placed, nor anything under it
            path.append(child)
            node = child
        self._touch(path)
        self._clear_in_progress(req, upto=n_full)
        return added

    def release(self, req) -> None:
        """The request finished or was preempted: drop its references; cached blocks stay allocated."""
        path = self._match(req, min(len(req.blocks), len(req.tokens) // self.block_size))
        self._touch(path)  # just-released prefixes are the most recently used
        self.allocator.free(live_blocks(req.blocks))
        req.blocks = []
        self._hashes.pop(req, None)
        self._clear_in_progress(req)

    def discard(self, req) -> int:
        """Forget every cached block ``req`` holds, with everything cached under it; return how many
        nodes were dropped. For a request that failed: its KV is not trusted, so no later request
        may reuse it. Call before ``release``; blocks still referenced elsewhere stay allocated."""
        held = set(req.blocks)
        dropped = 0
        for node in self._nodes():  # parents before children
            if node.parent is not None and node.block in held:
                dropped += self._drop_subtree(node)
        return dropped

    def _drop_subtree(self, node: _Node) -> int:
        dropped = sum(self._drop_subtree(c) for c in list(node.children.values()))
        self._evict(node)
        return dropped + 1

    def adopt(self, req) -> int:
        """Swap the request's not-yet-computed blocks for cached equal ones; return how many.

        Optional, for prefix-aware skipping: after waiting for another request's chunk, the
        scheduler calls this before scheduling ``req``'s next chunk. Only when both models
        stopped at the same block boundary ``k * block_size`` and blocks 0..k-1 match the
        tree by content. Each adopted block replaces the request's own block (freed here) or, past
        the blocks the request holds (a windowed engine allocates per chunk), is appended; the
        caller must refresh the request's block-table row when the result is > 0.
        """
        bs = self.block_size
        k, rem = divmod(req.num_computed, bs)
        if rem or req.num_computed_draft != req.num_computed or len(req.blocks) < k:
            return 0
        path = self._match(req, self._max_reusable_blocks(req))
        if len(path) <= k:
            return 0
        new = path[k:]
        self.allocator.incref([n.block for n in new])
        self.allocator.free(req.blocks[k:k + len(new)])
        req.blocks[k:k + len(new)] = [n.block for n in new]
        req.num_computed = req.num_computed_draft = (k + len(new)) * bs
        req.num_cached_tokens += len(new) * bs
        self._hit_tokens += len(new) * bs
        self._touch(path)
        return len(new)

    # ------------------------------------------------------------------ prefix-aware skipping

    def note_in_progress(self, req, start: int, end: int) -> None:
        """Record that ``req``'s prefill chunk ``[start, end)`` is producing KV (scheduler calls this).

        Every cacheable full block (inside ``tokens[:-1]``) that the chunk touches is marked
        until ``insert`` caches it or ``release`` drops the request.
        """
        bs = self.block_size
        last = min(-(-end // bs), self._max_reusable_blocks(req))
        first = start // bs
        if last <= first:
            return
        hashes = self._req_hashes(req, last)
        mine = self._in_progress_of.setdefault(req, set())
        for i in range(first, last):
            self._in_progress.setdefault(hashes[i], {})[req] = i
            mine.add(hashes[i])

    def pending_block(self, req) -> bool:
        """True if another request is producing, right now, the block ``req`` would compute next.

        That block starts at ``req.num_computed`` (which must be block-aligned: a half-done
        block is ``req``'s own), lies inside ``tokens[:-1]`` and is not cached yet; the other
        request's tokens must equal ``req``'s up to the end of it. ``req`` should then wait one
        step and call ``adopt`` instead of duplicating the work.
        """
        k, rem = divmod(req.num_computed, self.block_size)
        if rem or k >= self._max_reusable_blocks(req):
            return False
        h = self._req_hashes(req, k + 1)[k]
        end = (k + 1) * self.block_size
        prefix = req.tokens[:end]
        return any(other is not req and idx == k and other.tokens[:end] == prefix
                   for other, idx in self._in_progress.get(h, {}).items())

    def _clear_in_progress(self, req, upto: int | None = None) -> None:
        mine = self._in_progress_of.get(req)
        if not mine:
            return
        hashes = self._hashes.get(req, [])
        drop = set(hashes[:upto]) & mine if upto is not None else set(mine)
        for h in drop:
            owners = self._in_progress.get(h, {})
            owners.pop(req, None)
            if not owners:
                self._in_progress.pop(h, None)
        mine -= drop
        if not mine:
            self._in_progress_of.pop(req, None)

    # ------------------------------------------------------------------ eviction

    def _nodes(self) -> list[_Node]:
        """All cached nodes, parents before children."""
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _cache_only(self, node: _Node) -> bool:
        return self.allocator.refcount(node.block) == 1

    def num_evictable(self) -> int:
        """Cached blocks that repeated leaf-first eviction would free: cache-only nodes whose
        whole subtree is cache-only."""
        ok: dict[int, bool] = {}
        count = 0
        for n in reversed(self._nodes()):  # children before parents
            good = self._cache_only(n) and all(ok[id(c)] for c in n.children.values())
            ok[id(n)] = good
            count += good
        return count

    def make_room(self, n: int) -> None:
        """Evict least-recently-used cache-only leaves until ``allocator.num_free >= n`` or none is left.

        Finding the leaves walks the whole cache, so when it must evict it frees ``EVICT_SLACK`` of the cache
        beyond ``n`` too: once a full pool is mostly cache, the allocations that follow find free blocks without
        walking it again (one walk per block would make every step cost the size of the cache)."""
        if self.allocator.num_free >= n:
            return
        n += self._num_nodes // EVICT_SLACK
        heap = [(x.last_use, x.seq, x) for x in self._nodes() if not x.children and self._cache_only(x)]
        heapq.heapify(heap)
        while heap and self.allocator.num_free < n:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            self._evict(x)
            if parent is not self._root and not parent.children and self._cache_only(parent):
                heapq.heappush(heap, (parent.last_use, parent.seq, parent))

    def evict_all(self) -> None:
        """Evict every evictable block (what nobody but the cache references)."""
        self.make_room(self.allocator.num_blocks + 1)

    def _evict(self, node: _Node) -> None:
        del node.parent.children[node.hash]
        node.parent = None
        self._num_nodes -= 1
        self.allocator.free([node.block])

    # ------------------------------------------------------------------ introspection

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._hits, self._lookups, self._hit_tokens, self._num_nodes)

    def __len__(self) -> int:
        return self._num_nodes
