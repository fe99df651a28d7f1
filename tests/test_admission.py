"""Grouped admission (``SchedulerConfig.admit_min_free``): while rows run, waiting requests join once enough rows
are free or the queue's head has waited ``admit_max_wait`` steps; a pipelined engine admits in groups by default
(``EnginePlan.admit_min_free``), and outputs do not depend on when a request was admitted."""

import pytest
from specdec.kvcache.allocator import BlockAllocator
from specdec.kvcache.block_table import BlockTables
from specdec.scheduler.request import Request
from specdec.scheduler.scheduler import Scheduler, SchedulerConfig

from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import FieldError
from specdec.plan import admit_group
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


def _scheduler(min_free: int, max_wait: int) -> Scheduler:
    cfg = SchedulerConfig(max_batch_size=8, admit_min_free=min_free, admit_max_wait=max_wait)
    return Scheduler(cfg, BlockAllocator(512), BlockTables(8, 64), 4, 0)


def _requests(n: int) -> list[Request]:
    return [Request(str(i), [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(n)]


def _full_batch(min_free: int, max_wait: int, requests: int, finished: int) -> Scheduler:
    """A scheduler of 8 rows after ``requests`` requests came and 8 were admitted, then ``finished`` of them
    ended (nothing scheduled since)."""
    sched = _scheduler(min_free, max_wait)
    for req in _requests(requests):
        sched.add(req)
    sched.schedule()
    for _ in range(finished):
        sched.finish(sched.running[0], "length")
    return sched


def test_waiting_requests_join_once_enough_rows_are_free():
    sched = _scheduler(min_free=3, max_wait=100)
    for req in _requests(12):
        sched.add(req)
    sched.schedule()
    assert len(sched.running) == 8  # nothing runs yet: everything that fits is admitted
    sched.finish(sched.running[0], "length")
    sched.schedule()
    sched.finish(sched.running[0], "length")
    sched.schedule()
    assert len(sched.running) == 6 and len(sched.waiting) == 4  # two free rows: held back
    sched.finish(sched.running[0], "length")
    sched.schedule()
    assert len(sched.running) == 8 and len(sched.waiting) == 1  # three free: all of them filled at once
    for req in list(sched.running):
        sched.finish(req, "length")
    sched.schedule()
    assert sched.running and not sched.waiting  # nothing running: the last waiting request goes in


def test_a_request_is_held_back_at_most_admit_max_wait_steps():
    sched = _full_batch(min_free=4, max_wait=3, requests=12, finished=1)
    steps = 0
    while len(sched.waiting) == 4:
        sched.schedule()
        steps += 1
    assert steps == 4 and len(sched.running) == 8  # three steps held back, one admitted at the fourth


def test_fewer_waiting_than_the_group_size_join_as_soon_as_they_fit():
    sched = _full_batch(min_free=4, max_wait=100, requests=10, finished=2)
    sched.schedule()
    assert not sched.waiting  # two wait, two rows free


def test_plan_groups_admission_for_pipelined_engines(tiny_target):
    pipelined = SpecEngine(None, tiny_target, SpecConfig(max_batch_size=32, cuda_graphs=True, pipeline=True))
    assert pipelined.plan.admit_min_free == 8 and pipelined.scheduler.cfg.admit_min_free == 8  # (admit_group)
    # an eighth of the batch, and at least 8 rows from 16 on
    assert [admit_group(b) for b in (1, 2, 4, 8, 15, 16, 32, 64, 128, 256)] == [1, 1, 1, 1, 1, 8, 8, 8, 16, 32]
    assert SpecEngine(None, tiny_target, SpecConfig(max_batch_size=32)).plan.admit_min_free == 1
    assert SpecEngine(None, tiny_target, SpecConfig(max_batch_size=32, admit_min_free=2)).plan.admit_min_free == 2
    with pytest.raises(FieldError, match="admit_min_free"):
        SpecConfig(max_batch_size=8, admit_min_free=9)
    assert pipelined.plan.admit_ahead == 8 and pipelined.scheduler.cfg.max_running == 40
    assert "prefills 8 ahead" in pipelined.plan.describe()
    assert SpecEngine(None, tiny_target, SpecConfig(max_batch_size=32)).plan.admit_ahead == 0  # (unpipelined)
    for bad in (-1, 9, True, 2.0):
        with pytest.raises(FieldError, match="admit_ahead"):
            SpecConfig(max_batch_size=8, admit_ahead=bad)


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_outputs_do_not_depend_on_grouped_admission(tiny_target, draft):
    """Greedy and seeded sampled requests of different lengths through 4 rows: the same tokens whether waiting
    requests join one by one or in groups of 3 (pipelined padded steps, run eagerly on the CPU)."""
    prompts = [[3 + (7 * i + j) % 200 for j in range(4 + i % 5)] for i in range(10)]
    params = [SamplingParams(max_new_tokens=6 + 3 * (i % 4), ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                             seed=i) for i in range(10)]
    outs = []
    for min_free in (1, 3):
        cfg = SpecConfig(max_batch_size=4, cuda_graphs=True, pipeline=True, admit_min_free=min_free,
                         num_blocks=200, block_size=8)
        outs.append([o.token_ids for o in SpecEngine(draft, tiny_target, cfg).generate(prompts, params)])
    assert outs[0] == outs[1]


def _cached_prefix_scheduler(num_blocks: int):
    """A scheduler of ``num_blocks`` blocks with a prefix cache (block size 4) holding one finished request's
    2 prompt blocks, so that only eviction frees them."""
    from specdec.kvcache.radix_cache import RadixPrefixCache

    alloc = BlockAllocator(num_blocks)
    sched = Scheduler(SchedulerConfig(max_batch_size=8), alloc, BlockTables(8, 64), 4, 0,
                      RadixPrefixCache(alloc, 4))
    first = Request("a", list(range(10, 19)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    sched.add(first)
    sched.schedule()
    first.num_computed = first.num_computed_draft = len(first.tokens) - 1
    sched.prefix_cache.insert(first)
    sched.finish(first, "length")
    assert sched.prefix_cache.num_evictable() == 2 and alloc.num_free == num_blocks - 2
    return sched, alloc


@pytest.mark.parametrize("num_blocks, admitted", [(5, True), (4, False)])
def test_admission_counts_cached_blocks_it_can_evict(num_blocks, admitted, monkeypatch):
    """A request needing 5 blocks (16 prompt + 3 new tokens, block size 4) is admitted when the free list and the
    evictable cached prefix together hold them, and waits when they do not; while the free list alone suffices,
    the cache is not walked."""
    sched, alloc = _cached_prefix_scheduler(num_blocks)
    walks = []
    count = sched.prefix_cache.num_evictable
    monkeypatch.setattr(sched.prefix_cache, "num_evictable", lambda: walks.append(1) or count())
    small = Request("s", [1, 2, 3], SamplingParams(max_new_tokens=1, ignore_eos=True))  # 1 block: the free list has it
    sched.add(small)
    sched.schedule()
    assert small in sched.running and not walks
    sched.finish(small, "length")
    big = Request("b", list(range(40, 56)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    sched.add(big)
    sched.schedule()
    assert (big in sched.running) == admitted and walks
    if admitted:
        assert len(big.blocks) == 4 and len(sched.prefix_cache) < 2  # prefill blocks taken by evicting


def test_a_pool_full_of_cached_prefixes_is_not_walked_per_admission(monkeypatch):
    """600 finished requests leave 600 cached blocks in a pool of 700; admitting 300 more (2 blocks each) needs
    eviction, but the cache is walked once per ~10 requests, not twice per request: each eviction frees a slack
    (``EVICT_SLACK``). While nothing is released, a count that fell short is not repeated."""
    from specdec.kvcache.radix_cache import RadixPrefixCache

    alloc = BlockAllocator(700)
    sched = Scheduler(SchedulerConfig(max_batch_size=8), alloc, BlockTables(8, 128), 4, 0, RadixPrefixCache(alloc, 4))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for i in range(600):
        req = Request(f"c{i}", [1000 + i, 1, 2, 3, 4], params)  # its first block is its own
        sched.add(req)
        sched.schedule()
        req.num_computed = req.num_computed_draft = 4
        sched.prefix_cache.insert(req)
        sched.finish(req, "length")
    assert len(sched.prefix_cache) == 600 and alloc.num_free == 100
    walks = []
    nodes = sched.prefix_cache._nodes
    monkeypatch.setattr(sched.prefix_cache, "_nodes", lambda: walks.append(1) or nodes())
    for i in range(300):
        req = Request(f"n{i}", [5000 + i, 7, 7, 7, 7, 7, 7, 7, 7], params)  # 3 blocks at most, 2 cached after
        sched.add(req)
        sched.schedule()
        assert req in sched.running
        req.num_computed = req.num_computed_draft = 8
        sched.prefix_cache.insert(req)
        sched.finish(req, "length")
    assert len(walks) <= 80  # (without the slack, a count and an eviction per request: ~500)
    assert alloc.num_free + sched.prefix_cache.num_evictable() == 700  # nothing lost

    # a count that fell short for a big request does not refuse a smaller one behind it (no block freed between)
    huge = Request("huge", list(range(20000, 20000 + 3000)), params)  # 751 blocks: more than the pool
    sched.add(huge)
    sched.schedule()
    assert huge in sched.waiting
    sched.abort(huge)
    need = alloc.num_free + 5  # more than the free list holds, fewer than eviction frees
    fits = Request("fits", list(range(30000, 30000 + 4 * need - 2)), params)
    sched.add(fits)
    sched.schedule()
    assert fits in sched.running
    sched.finish(fits, "length")

    # a pool held by running requests: a waiting request is counted short once, then not again until a release
    for i in range(8):  # 91 blocks each: 7 fit in the pool, the 8th waits
        sched.add(Request(f"r{i}", list(range(10000 + 400 * i, 10000 + 400 * i + 360)), params))
    sched.schedule()
    assert len(sched.running) == 7 and len(sched.waiting) == 1
    walks.clear()
    for _ in range(5):
        sched.schedule()
    assert not walks and len(sched.waiting) == 1
    sched.finish(sched.running[0], "length")  # a release: checked again, and now it fits
    sched.schedule()
    assert not sched.waiting


def test_requests_prefilled_ahead_take_freed_rows_at_the_next_step():
    """``admit_ahead``: 2 requests beyond the 4 decode rows are admitted and prefilled at once; when a row ends, the
    next schedule gives it to the oldest of them (a joining row: it decodes from the step after, as a row whose
    prefill just ended does), no more than 4 rows ever decode, and a new group is admitted only once
    ``admit_min_free`` places are free among the 6."""
    cfg = SchedulerConfig(max_batch_size=4, admit_min_free=2, admit_ahead=2, admit_max_wait=100)
    sched = Scheduler(cfg, BlockAllocator(512), BlockTables(6, 64), 4, 0)
    reqs = _requests(10)
    for req in reqs:
        sched.add(req)
    batch = sched.schedule()
    assert sched.running == reqs[:6] and [c.req for c in batch.prefill] == reqs[:6]
    assert batch.joining == reqs[:4] and not batch.decode  # decode from the next step; 4 and 5 wait, prefilled
    for c in batch.prefill:
        c.req.num_computed = c.end
    batch = sched.schedule()
    assert batch.decode == reqs[:4] and not batch.joining and not batch.prefill
    sched.finish(reqs[1], "length")
    batch = sched.schedule()
    assert batch.joining == [reqs[4]] and batch.decode == [reqs[0], reqs[2], reqs[3]]
    assert len(sched.running) == 5 and not batch.prefill  # one place free of the 6: the group waits
    sched.finish(reqs[2], "length")
    batch = sched.schedule()
    assert batch.joining == [reqs[5]] and batch.decode == [reqs[0], reqs[3], reqs[4]]
    assert [c.req for c in batch.prefill] == reqs[6:8]  # two places free: the next group, prefilled ahead
    for c in batch.prefill:
        c.req.num_computed = c.end
    batch = sched.schedule()
    assert batch.decode == [reqs[0], reqs[3], reqs[4], reqs[5]] and not batch.joining
    assert sum(r.decoding for r in sched.running) == 4 and len(sched.running) == 6


def _prefilled_ahead(rows: int, ahead: int) -> tuple[Scheduler, list[Request]]:
    """A scheduler of ``rows`` decode rows that admitted and prefilled ``rows + ahead`` requests (nothing decoded)."""
    cfg = SchedulerConfig(max_batch_size=rows, admit_min_free=1, admit_ahead=ahead)
    sched = Scheduler(cfg, BlockAllocator(512), BlockTables(rows + ahead, 64), 4, 0)
    reqs = _requests(rows + ahead)
    for req in reqs:
        sched.add(req)
    for c in sched.schedule().prefill:
        c.req.num_computed = c.end
    return sched, reqs


def test_a_request_prefilled_ahead_decodes_at_once_when_no_row_decodes():
    """Every decode row ended in one step: the requests prefilled ahead decode in the next step itself (there is
    no running step for them to join)."""
    sched, reqs = _prefilled_ahead(rows=2, ahead=2)
    sched.finish(reqs[0], "length")
    sched.finish(reqs[1], "length")
    batch = sched.schedule()
    assert batch.decode == reqs[2:] and not batch.joining


def test_preempted_request_loses_its_decode_row():
    sched, reqs = _prefilled_ahead(rows=2, ahead=1)
    sched.preempt(reqs[0])
    assert not reqs[0].decoding
    batch = sched.schedule()
    assert batch.joining == [reqs[2]] and batch.decode == [reqs[1]]


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_no_row_idles_while_a_request_waits_prefilled(tiny_target, draft):
    """A pipelined engine (padded steps run eagerly on the CPU) of 4 rows, admitting in pairs, over requests that
    end at different steps: prefilling 2 ahead (the plan's default there), every step after the first decodes or
    joins all 4 rows while requests remain, where admitting only into free rows leaves rows idle while a pair
    gathers; the tokens are the same both ways (greedy and seeded sampled rows), and no block leaks."""
    prompts = [[3 + (7 * i + j) % 200 for j in range(4 + i % 5)] for i in range(12)]
    params = [SamplingParams(max_new_tokens=5 + 4 * (i % 4), ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                             seed=i) for i in range(12)]
    outs, idle = {}, {}
    for ahead in (None, 0):
        cfg = SpecConfig(max_batch_size=4, cuda_graphs=True, pipeline=True, admit_min_free=2, admit_ahead=ahead,
                         num_blocks=300, block_size=8, ngram_device=draft == "ngram" or None)
        eng = SpecEngine(draft, tiny_target, cfg)
        assert eng.plan.admit_ahead == (2 if ahead is None else 0)
        schedule, idle[ahead] = eng.scheduler.schedule, 0

        def counted(schedule=schedule, eng=eng, ahead=ahead):
            batch = schedule()
            busy = len(batch.decode) + len(batch.joining)
            if busy < 4 and eng.scheduler.waiting:
                idle[ahead] += 1
            return batch

        eng.scheduler.schedule = counted
        outs[ahead] = [o.token_ids for o in eng.generate(prompts, params)]
        assert eng.all_blocks_free()
    assert outs[None] == outs[0]
    assert idle[None] <= 1 < idle[0], idle  # (the first step: every row prefills, nothing decodes or joins yet)


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_aborting_a_request_prefilled_ahead(tiny_target, draft):
    """A request prefilled ahead (its KV computed, no decode row yet) aborted between steps, as the server does when
    its client goes away: its blocks come back, it never decodes, and every other request's tokens are those of a
    run without it (greedy and seeded sampled rows, pipelined padded steps run eagerly on the CPU)."""
    prompts = [[3 + (5 * i + j) % 150 for j in range(5 + i % 3)] for i in range(8)]
    params = [SamplingParams(max_new_tokens=6 + 3 * (i % 3), ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                             seed=i) for i in range(8)]
    cfg = SpecConfig(max_batch_size=3, cuda_graphs=True, pipeline=True, admit_min_free=2, num_blocks=300,
                     block_size=8, ngram_device=draft == "ngram" or None)
    eng = SpecEngine(draft, tiny_target, cfg)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    eng.step()
    ready = [r for r in eng.scheduler.running if r.prefill_done and not r.decoding]
    assert len(ready) == 2  # 3 decode rows, 2 prefilled ahead
    victim = ready[0]
    eng.scheduler.abort(victim)
    while eng.scheduler.has_work:
        eng.step()
    assert victim.finish_reason == "abort" and victim.num_output == 0 and eng.all_blocks_free()
    kept = [i for i, r in enumerate(reqs) if r is not victim]
    alone = SpecEngine(draft, tiny_target, cfg).generate([prompts[i] for i in kept], [params[i] for i in kept])
    assert [reqs[i].output_ids for i in kept] == [o.token_ids for o in alone]
