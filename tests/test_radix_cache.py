"""RadixPrefixCache with a real BlockAllocator and real Request objects (no GPU, no model)."""

from __future__ import annotations

import pytest
from specdec.kvcache import radix_cache
from specdec.kvcache.allocator import BlockAllocator
from specdec.kvcache.radix_cache import RadixPrefixCache
from specdec.scheduler.request import Request

from specdec.sampling_params import SamplingParams

BS = 4


def _req(tokens, rid="r") -> Request:
    return Request(rid, list(tokens), SamplingParams())


def _admit(cache: RadixPrefixCache, alloc: BlockAllocator, tokens, rid="r") -> Request:
    """What the scheduler does on admission: attach, then allocate blocks for tokens[:-1]."""
    req = _req(tokens, rid)
    cache.attach(req)
    need = -(-(len(req.tokens) - 1) // BS) - len(req.blocks)
    cache.make_room(need)
    req.blocks += alloc.allocate(need)
    return req


def _prefill(cache: RadixPrefixCache, req: Request, end: int | None = None) -> None:
    """What the engine does after a prefill chunk: advance both models, then insert."""
    end = len(req.tokens) - 1 if end is None else end
    req.num_computed = req.num_computed_draft = end
    cache.insert(req)


@pytest.fixture
def setup():
    alloc = BlockAllocator(32)
    return alloc, RadixPrefixCache(alloc, BS)


def test_attach_matches_full_blocks_only(setup):
    alloc, cache = setup
    a = _admit(cache, alloc, range(11), "a")  # 10 computed tokens: blocks 0, 1 full
    _prefill(cache, a)
    assert len(cache) == 2
    b = _admit(cache, alloc, [*range(10), 99], "b")  # shares 10 tokens = 2 full blocks + 2
    assert b.num_computed == b.num_computed_draft == b.num_cached_tokens == 8
    assert b.blocks[:2] == a.blocks[:2]
    assert all(alloc.refcount(x) == 3 for x in a.blocks[:2])  # a, b, the cache
    c = _admit(cache, alloc, [0, 1, 2, 7, 8, 9], "c")  # differs inside block 0
    assert c.num_computed == 0 and c.num_cached_tokens == 0
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens, s.cached_blocks) == (3, 1, 8, 2)


def test_never_serves_the_last_token(setup):
    alloc, cache = setup
    a = _admit(cache, alloc, range(9), "a")
    _prefill(cache, a)  # blocks 0, 1 (tokens 0..7) cached
    b = _admit(cache, alloc, range(8), "b")  # same 8 tokens: only block 0 may be served
    assert b.num_computed == 4 and len(b.blocks) == 2 and b.blocks[0] == a.blocks[0]
    assert b.blocks[1] != a.blocks[1]
    one = _admit(cache, alloc, [0], "one")
    assert one.num_computed == 0 and one.blocks == []


def test_hash_collision_is_not_a_hit(setup, monkeypatch):
    alloc, cache = setup
    monkeypatch.setattr(radix_cache, "_block_hash", lambda prev, tokens: b"same")
    a = _admit(cache, alloc, range(9), "a")
    _prefill(cache, a)
    assert len(cache) == 2
    b = _admit(cache, alloc, range(100, 109), "b")
    assert b.num_computed == 0 and not set(b.blocks) & set(a.blocks)
    _prefill(cache, b)  # b's colliding blocks cannot be placed: nothing new is cached
    assert len(cache) == 2
    c = _admit(cache, alloc, range(9), "c")  # the genuine content still hits
    assert c.num_computed == 8
    for r in (a, b, c):
        cache.release(r)
    cache.evict_all()
    assert alloc.all_free()


def test_refcounts_balance_after_release_and_evict_all(setup):
    alloc, cache = setup
    reqs = [_admit(cache, alloc, [*range(8), i, i + 1, i + 2, i + 3, 5], f"r{i}") for i in range(3)]
    for r in reqs:
        _prefill(cache, r, 4)  # chunked: first chunk
        _prefill(cache, r)
    for r in reqs:
        cache.release(r)
        assert r.blocks == []
    assert not alloc.all_free()  # cached blocks survive their requests
    assert cache.num_evictable() == len(cache) == 2 + 3
    cache.evict_all()
    assert alloc.all_free() and len(cache) == 0 and cache.num_evictable() == 0


def test_insert_only_blocks_computed_by_both_models(setup):
    alloc, cache = setup
    a = _admit(cache, alloc, range(13), "a")
    a.num_computed, a.num_computed_draft = 12, 5  # draft lags: only block 0 done by both
    assert cache.insert(a) == 1
    a.num_computed_draft = 12
    assert cache.insert(a) == 2
    assert cache.insert(a) == 0  # idempotent
    assert all(alloc.refcount(x) == 2 for x in a.blocks[:3])


def test_duplicate_block_keeps_one_copy(setup):
    alloc, cache = setup
    a = _admit(cache, alloc, range(13), "a")
    b = _admit(cache, alloc, [*range(8), 50, 51, 52, 53, 54], "b")  # admitted before a inserted
    assert b.num_computed == 0
    _prefill(cache, a)
    _prefill(cache, b)  # b's blocks 0, 1 duplicate a's; only b's block 2 is new
    assert len(cache) == 4
    assert alloc.refcount(b.blocks[0]) == 1 and alloc.refcount(b.blocks[2]) == 2
    c = _admit(cache, alloc, [*range(8), 50, 51, 52, 53, 54], "c")
    assert c.blocks == [a.blocks[0], a.blocks[1], b.blocks[2]]  # chained under the cached copy
    for r in (a, b, c):
        cache.release(r)
    cache.evict_all()
    assert alloc.all_free()


def test_lru_eviction_order(setup):
    alloc, cache = setup
    reqs = {}
    for name, base in (("x", 100), ("y", 200), ("z", 300)):
        reqs[name] = _admit(cache, alloc, range(base, base + 5), name)
        _prefill(cache, reqs[name])
    for name in ("x", "y", "z"):
        cache.release(reqs[name])
    hit = _admit(cache, alloc, range(100, 105), "x2")  # x becomes most recently used
    cache.release(hit)
    free0 = alloc.num_free
    cache.make_room(free0 + 1)  # evicts the LRU one: y
    assert _admit(cache, alloc, range(200, 205), "y2").num_computed == 0
    assert _admit(cache, alloc, range(300, 305), "z2").num_computed == 4
    assert _admit(cache, alloc, range(100, 105), "x3").num_computed == 4


def test_make_room_frees_exactly_enough():
    alloc = BlockAllocator(8)
    cache = RadixPrefixCache(alloc, BS)
    a = _admit(cache, alloc, range(25), "a")  # 6 blocks
    _prefill(cache, a)
    cache.release(a)
    assert alloc.num_free == 2 and cache.num_evictable() == 6
    cache.make_room(1)
    assert alloc.num_free == 2 and len(cache) == 6  # already enough: nothing evicted
    cache.make_room(5)
    assert alloc.num_free == 5 and len(cache) == 3
    b = _admit(cache, alloc, range(25), "b")  # the surviving prefix (leaves went first)
    assert b.num_computed == 12


def test_num_evictable_with_shared_prefixes(setup):
    alloc, cache = setup
    a = _admit(cache, alloc, [*range(8), 1, 1, 1, 1, 9], "a")
    b = _admit(cache, alloc, [*range(8), 2, 2, 2, 2, 9], "b")
    _prefill(cache, a)
    _prefill(cache, b)  # tree: P0 - P1 - {A2, B2}; b's P0, P1 are duplicates
    assert len(cache) == 4 and cache.num_evictable() == 0  # a holds P0, P1, A2; b holds B2
    a_blocks = list(a.blocks)
    cache.release(a)
    # P0, P1, A2 are cache-only now, but P1 has the child B2 that b holds: only A2 can go
    assert cache.num_evictable() == 1
    c = _admit(cache, alloc, [*range(8), 2, 2, 2, 2, 9], "c")  # holds P0, P1, B2
    assert c.num_computed == 12 and c.blocks[:2] == a_blocks[:2] and c.blocks[2] == b.blocks[2]
    assert cache.num_evictable() == 1
    cache.make_room(alloc.num_blocks)
    assert len(cache) == 3 and cache.num_evictable() == 0
    for r in (b, c):
        cache.release(r)
    assert cache.num_evictable() == 3
    cache.evict_all()
    assert alloc.all_free()


def test_pending_block_and_adopt(setup):
    alloc, cache = setup
    shared = [*range(12), 77]
    a = _admit(cache, alloc, shared, "a")
    b = _admit(cache, alloc, shared, "b")
    assert not cache.pending_block(b)
    cache.note_in_progress(a, 0, 6)  # a's chunk produces block 0 and half of block 1
    assert cache.pending_block(b) and not cache.pending_block(a)
    other = _admit(cache, alloc, [0, 1, 2, 99, 4, 5, 6, 7, 8], "other")
    assert not cache.pending_block(other)  # different tokens in block 0
    _prefill(cache, a, 6)  # block 0 cached; block 1 still in progress
    assert not cache.pending_block(b)
    assert cache.adopt(b) == 1
    assert b.blocks[0] == a.blocks[0] and b.num_computed == b.num_computed_draft == 4
    assert cache.pending_block(b)  # next block (1) is a's, still in progress
    _prefill(cache, a)
    assert not cache.pending_block(b) and cache.adopt(b) == 2
    assert b.num_computed == 12 and b.num_cached_tokens == 12 and b.blocks[:3] == a.blocks[:3]
    cache.release(a)
    cache.note_in_progress(other, 0, 8)
    cache.release(other)  # releasing drops its in-progress marks
    assert not cache._in_progress
    cache.release(b)
    cache.evict_all()
    assert alloc.all_free()


def test_attach_requires_empty_request(setup):
    alloc, cache = setup
    r = _req(range(9))
    r.blocks = alloc.allocate(1)
    with pytest.raises(ValueError):
        cache.attach(r)


def test_with_the_real_scheduler():
    from specdec.kvcache.block_table import BlockTables
    from specdec.scheduler.scheduler import CapacityPolicy, Scheduler, SchedulerConfig

    alloc = BlockAllocator(16)
    cache = RadixPrefixCache(alloc, BS)
    sched = Scheduler(SchedulerConfig(max_num_tokens=5, policy=CapacityPolicy.MAX_UTILIZATION), alloc,
                      BlockTables(4, 16), BS, lookahead=0, prefix_cache=cache)
    for rid in ("a", "b"):
        sched.add(_req(range(14), rid))
        done_prefill = False
        while not done_prefill:
            batch = sched.schedule()
            for c in batch.prefill:  # the engine's _prefill
                c.req.num_computed = c.req.num_computed_draft = c.end
                cache.insert(c.req)
            done_prefill = bool(batch.decode)
        req = batch.decode[0]
        sched.finish(req, "stop")
    assert req.request_id == "b" and req.num_cached_tokens == 12
    assert cache.stats.hits == 1 and cache.stats.lookups == 2
    assert cache.num_evictable() == 3
    cache.evict_all()
    assert alloc.all_free()


def test_random_workload_keeps_refcounts_consistent():
    import random

    rng = random.Random(0)
    alloc = BlockAllocator(64)
    cache = RadixPrefixCache(alloc, BS)
    live: list[Request] = []
    for step in range(300):
        if live and rng.random() < 0.3:
            cache.release(live.pop(rng.randrange(len(live))))
        elif len(live) < 6:
            prefix = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
            tokens = [7, 7, *prefix, *(rng.randrange(5) for _ in range(rng.randrange(1, 8)))]
            need_total = -(-(len(tokens) - 1) // BS)
            if alloc.num_free + cache.num_evictable() < need_total:
                continue
            live.append(_admit(cache, alloc, tokens, f"r{step}"))
        for r in live:
            if r.num_computed < len(r.tokens) - 1:
                end = min(len(r.tokens) - 1, r.num_computed + rng.randrange(1, 6))
                cache.note_in_progress(r, r.num_computed, end)
                _prefill(cache, r, end)
        nodes = cache._nodes()
        assert len({n.block for n in nodes}) == len(nodes) == len(cache)
        held = [b for r in live for b in r.blocks]
        for n in nodes:
            assert alloc.refcount(n.block) == 1 + held.count(n.block)
    for r in live:
        cache.release(r)
    assert cache.num_evictable() == len(cache)
    cache.evict_all()
    assert alloc.all_free() and not cache._in_progress and not cache._hashes
