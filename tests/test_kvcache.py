"""KV memory: allocator, shared pool layout, block tables, and scheduler-level block ownership."""

from __future__ import annotations

import pytest
import torch
from specdec.kvcache.allocator import BlockAllocator, OutOfBlocks
from specdec.kvcache.block_table import BlockTables
from specdec.kvcache.pool import KVPool, KVSpec

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

# ---------------------------------------------------------------- BlockAllocator


def _state(a: BlockAllocator):
    return a.num_free, [a.refcount(b) for b in range(a.num_blocks)], a.all_free()


def test_allocator_refcounts():
    a = BlockAllocator(6)
    assert a.all_free() and a.num_free == 6
    blocks = a.allocate(4)
    assert len(set(blocks)) == 4 and all(0 <= b < 6 for b in blocks)
    assert [a.refcount(b) for b in blocks] == [1, 1, 1, 1]
    assert a.num_free == 2 and not a.all_free()
    a.incref(blocks[:2])
    assert a.refcount(blocks[0]) == 2
    a.free(blocks[:2])  # shared blocks survive one free
    assert a.refcount(blocks[0]) == 1 and a.num_free == 2
    a.free(blocks)
    assert a.num_free == 6 and a.all_free()
    again = a.allocate(6)
    assert sorted(again) == list(range(6))
    assert a.allocate(0) == []


def test_allocator_out_of_blocks_at_exact_capacity_leaves_state_unchanged():
    a = BlockAllocator(8)
    first = a.allocate(5)
    a.incref(first[:1])
    before = _state(a)
    with pytest.raises(OutOfBlocks) as info:
        a.allocate(4)  # one more than free
    assert info.value.requested == 4 and info.value.free == 3
    assert "4" in str(info.value) and "3" in str(info.value)
    assert _state(a) == before
    rest = a.allocate(3)  # exactly the capacity left
    assert not set(rest) & set(first)
    assert a.num_free == 0
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    assert a.num_free == 0
    with pytest.raises(ValueError):
        a.allocate(-1)


def test_allocator_double_free_and_bad_incref():
    a = BlockAllocator(4)
    b = a.allocate(2)
    a.free([b[0]])
    with pytest.raises(ValueError, match="twice"):
        a.free([b[0]])
    with pytest.raises(ValueError, match="free"):
        a.incref([b[0]])
    a.incref([b[1]])
    a.free([b[1]])
    a.free([b[1]])
    with pytest.raises(ValueError, match="twice"):
        a.free([b[1]])
    assert a.all_free()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


# ---------------------------------------------------------------- KVPool

SPECS = [KVSpec(num_layers=3, num_kv_heads=2, head_dim=8), KVSpec(num_layers=2, num_kv_heads=1, head_dim=16)]


def _views(pool: KVPool):
    return [(m, layer, kind, kv[kind_i]) for m in range(len(pool.specs))
            for layer, kv in enumerate(pool.model_kv(m)) for kind_i, kind in enumerate("KV")]


def test_pool_view_shapes_and_block_stride():
    pool = KVPool(SPECS, block_size=4, num_blocks=5)
    assert pool.block_elems == 4 * (3 * 2 * 2 * 8 + 2 * 2 * 1 * 16)
    assert pool.storage.shape == (5, pool.block_elems)
    for m, spec in enumerate(SPECS):
        assert len(pool.model_kv(m)) == spec.num_layers
        for layer in range(spec.num_layers):
            k, v = pool.layer_kv(m, layer)
            for t in (k, v):
                assert t.shape == (5, 4, spec.num_kv_heads, spec.head_dim)
                assert t.stride(0) == pool.block_elems
                assert t.untyped_storage().data_ptr() == pool.storage.untyped_storage().data_ptr()
    assert pool.bytes_per_block == pool.block_elems * 4
    sized = KVPool(SPECS, block_size=4, memory_bytes=pool.bytes_per_block * 7 + 5)
    assert sized.num_blocks == 7


def test_pool_views_do_not_overlap_and_tile_the_storage():
    pool = KVPool(SPECS, block_size=4, num_blocks=5)
    views = _views(pool)
    for i, (*_, t) in enumerate(views):
        t.fill_(i + 1)
    for i, (m, layer, kind, t) in enumerate(views):
        assert torch.all(t == i + 1), f"model {m} layer {layer} {kind} was overwritten"
    assert torch.all(pool.storage != 0)  # every element belongs to some view
    # a single write lands in exactly one view, at the block/offset it names
    pool.storage.zero_()
    k = pool.layer_kv(1, 1)[0]
    k[3, 2] = 7.0
    for m, layer, kind, t in views:
        expect = 7.0 * 16 if (m, layer, kind) == (1, 1, "K") else 0.0
        assert t.sum().item() == expect
    assert k[3, 2].eq(7).all() and k[3].sum() == k[3, 2].sum() and k.sum() == k[3, 2].sum()


def test_move_slots_moves_every_layer_of_every_model():
    pool = KVPool(SPECS, block_size=4, num_blocks=5)
    torch.manual_seed(0)
    pool.storage.copy_(torch.randn_like(pool.storage))
    before = [t.clone() for *_, t in _views(pool)]
    src = torch.tensor([9, 14, 18])  # (block 2, off 1), (3, 2), (4, 2)
    dst = torch.tensor([5, 6, 11])  # (1, 1), (1, 2), (2, 3)
    pool.move_slots(src, dst)
    for (m, layer, kind, t), old in zip(_views(pool), before, strict=True):
        expect = old.clone()
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            expect[d // 4, d % 4] = old[s // 4, s % 4]
        assert torch.equal(t, expect), f"model {m} layer {layer} {kind}"
    pool.move_slots(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        KVPool(SPECS, block_size=0, num_blocks=4)
    with pytest.raises(ValueError, match="exactly one"):
        KVPool(SPECS, block_size=4)
    with pytest.raises(ValueError, match="exactly one"):
        KVPool(SPECS, block_size=4, num_blocks=4, memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="num_blocks"):
        KVPool(SPECS, block_size=4, memory_bytes=10)


# ---------------------------------------------------------------- BlockTables


def test_block_tables_stage():
    bt = BlockTables(max_rows=3, max_blocks_per_row=5)
    rows = [bt.acquire_row() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    with pytest.raises(RuntimeError):
        bt.acquire_row()
    bt.set_row(rows[0], [4, 1])
    bt.set_row(rows[2], [7, 8, 9, 3, 2])
    staged = bt.stage([rows[2], rows[0]])
    assert staged.dtype == torch.int32
    assert staged.tolist() == [[7, 8, 9, 3, 2], [4, 1, 0, 0, 0]]
    bt.set_row(rows[0], [5])  # later host edits do not change what was staged
    assert staged.tolist()[1] == [4, 1, 0, 0, 0]
    assert bt.stage([rows[0]]).tolist() == [[5, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="max_blocks_per_row"):
        bt.set_row(rows[1], list(range(6)))
    bt.release_row(rows[2])
    assert bt.host[rows[2]].tolist() == [0] * 5
    assert bt.acquire_row() == rows[2]


# ---------------------------------------------------------------- scheduler-level ownership


def _prompts(n: int, shared: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(3, 256, (shared,), generator=g).tolist()
    return [common[: shared - 3 * (i % 3)] + torch.randint(3, 256, (3 + 2 * i,), generator=g).tolist()
            for i in range(n)]


class OwnershipChecker:
    """Checks, after scheduling and before drafting of every step (and after every step), that no
    block a live request may write is held by anyone else, and that reference counts add up."""

    def __init__(self, engine: SpecEngine) -> None:
        self.engine, self.checks, self.max_shared = engine, 0, 0
        propose = engine.drafter.propose

        def checked_propose(rows):
            self.check()
            return propose(rows)

        engine.drafter.propose = checked_propose

    def check(self) -> None:
        sched, alloc = self.engine.scheduler, self.engine.allocator
        bs = sched.block_size
        running = list(sched.running)
        owner: dict[int, str] = {}
        for r in running:
            assert len(set(r.blocks)) == len(r.blocks), f"{r.request_id} holds a block twice"
            first_writable = min(r.num_computed, r.num_computed_draft) // bs
            for b in r.blocks[first_writable:]:
                assert b not in owner, f"writable block {b} of {r.request_id} also writable by {owner[b]}"
                owner[b] = r.request_id
                assert alloc.refcount(b) == 1, f"writable block {b} of {r.request_id} has refcount " \
                                               f"{alloc.refcount(b)}"
        for r in running:
            for b in r.blocks:
                if b in owner and owner[b] != r.request_id:
                    raise AssertionError(f"{r.request_id} holds block {b}, writable by {owner[b]}")
        cached = len(sched.prefix_cache) if sched.prefix_cache is not None else 0
        total = sum(alloc.refcount(b) for b in range(alloc.num_blocks))
        assert total == sum(len(r.blocks) for r in running) + cached
        assert alloc.num_free == sum(1 for b in range(alloc.num_blocks) if alloc.refcount(b) == 0)
        held = [b for r in running for b in r.blocks]
        self.max_shared = max(self.max_shared, len(held) - len(set(held)))
        self.checks += 1


def test_ownership_checker_catches_a_planted_violation(tiny_target, tiny_draft):
    """The checker used below can fail: plant another request's writable block and it complains."""
    eng = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:2", num_blocks=64, block_size=4))
    checker = OwnershipChecker(eng)
    for p in _prompts(3, 8):
        eng.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True))
    eng.step()
    a, b = eng.scheduler.running[:2]
    checker.check()
    b.blocks.append(a.blocks[-1])  # b now holds a block that a will write
    with pytest.raises(AssertionError):
        checker.check()
    b.blocks.pop()
    checker.check()
    while eng.scheduler.has_work:
        eng.step()
    assert eng.all_blocks_free()


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Target-only greedy outputs of the prompts used below (large pool, no prefix cache)."""
    prompts = _prompts(12, 24)
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=512, block_size=4, prefix_cache=False))
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert eng.all_blocks_free()
    return prompts, [o.token_ids for o in outs]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_live_requests_never_share_writable_blocks(tiny_target, tiny_draft, reference, prefix_cache):
    prompts, expect = reference
    eng = SpecEngine(tiny_draft, tiny_target, SpecConfig(
        tree="topk:2x2", num_blocks=96, block_size=4, max_batch_size=6, prefix_cache=prefix_cache))
    checker = OwnershipChecker(eng)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts]
    max_running = 0
    while eng.scheduler.has_work:
        eng.step()
        checker.check()
        max_running = max(max_running, len(eng.scheduler.running))
    assert max_running >= 4
    assert checker.checks > 20
    if prefix_cache:
        assert checker.max_shared > 0, "no cached prefix block was ever shared; the test lost its point"
    assert [r.output_ids for r in reqs] == expect
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.all_blocks_free()
    # the engine is reusable and drains again
    outs = eng.generate(prompts[:3], params)
    assert [o.token_ids for o in outs] == expect[:3]
    assert eng.all_blocks_free()


@pytest.mark.parametrize("draft,tree", [(None, "chain:4"), ("model", "chain:4"), ("model", "topk:2x3")])
def test_max_utilization_preempts_and_output_is_unchanged(tiny_target, tiny_draft, reference, draft, tree,
                                                           count_preemptions):
    prompts, expect = reference
    d = tiny_draft if draft == "model" else None
    # each request alone needs at most 20 blocks; all of them at once need far more than 30
    eng = SpecEngine(d, tiny_target, SpecConfig(tree=tree, num_blocks=30, block_size=4,
                                                policy="max_utilization", max_batch_size=12))
    preempted = count_preemptions(eng)
    checker = OwnershipChecker(eng)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert preempted, "the pool was meant to be too small for all requests: expected preemption"
    assert checker.checks > 0
    assert [o.token_ids for o in outs] == expect
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.all_blocks_free()


def test_guaranteed_no_evict_never_preempts(tiny_target, tiny_draft, reference, count_preemptions):
    prompts, expect = reference
    eng = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=30, block_size=4,
                                                         policy="guaranteed_no_evict", max_batch_size=12))
    preempted = count_preemptions(eng)
    OwnershipChecker(eng)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert not preempted
    assert [o.token_ids for o in outs] == expect
    assert eng.all_blocks_free()


def test_abandoned_stream_releases_its_requests(tiny_target, tiny_draft, reference):
    """A consumer that stops iterating a stream aborts its requests: their KV is freed at once."""
    prompts, _ = reference
    eng = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=128, block_size=4))
    stream = eng.stream(prompts[:3], SamplingParams(max_new_tokens=20, ignore_eos=True))
    next(stream)
    stream.close()
    try:
        assert not eng.scheduler.has_work
        assert eng.all_blocks_free()
    finally:
        while eng.scheduler.has_work:  # leave nothing behind for the shared fixtures
            eng.step()
