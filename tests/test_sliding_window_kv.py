"""Sliding-window block release, piece by piece: the window arithmetic, the scheduler's release
with shared (prefix-cached) blocks, the radix cache around released entries, and attention that
never reads a released block (torch reference and Triton kernel)."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from kernel_inputs import parents_topk, random_paged_batch  # noqa: E402
from specdec.kernels.arg_checks import is_interpreted  # noqa: E402
from specdec.kernels.paged_attention import _paged_attn_kernel, paged_attention_triton  # noqa: E402
from specdec.kvcache.allocator import BlockAllocator  # noqa: E402
from specdec.kvcache.block_table import BlockTables  # noqa: E402
from specdec.kvcache.radix_cache import RadixPrefixCache  # noqa: E402
from specdec.kvcache.sliding_window import RELEASED, WindowReuse, blocks_spanning, window_reuse_for  # noqa: E402
from specdec.scheduler.request import Request  # noqa: E402
from specdec.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402

from specdec.attention.torch_backend import gather_kv, paged_attention, paged_attention_padded  # noqa: E402
from specdec.config import ModelConfig  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402

# ---------------------------------------------------------------- arithmetic


def test_blocks_spanning_is_the_worst_alignment():
    for bs in (1, 4, 8):
        for n in range(0, 40):
            worst = max((len({p // bs for p in range(s, s + n)}) for s in range(bs)), default=0)
            assert blocks_spanning(n, bs) == worst, (n, bs)


def test_first_needed_position_takes_every_model():
    w = WindowReuse((16, 24), block_size=4, lookahead=4, draft_lag=1)
    assert w.first_needed_position(100, 99) == min(100 - 15, 99 - 23) == 76
    assert w.num_dead_blocks(100, 99) == 19
    assert w.first_needed_position(10, 10) == 0
    target_only = WindowReuse((16,), 4, 0)
    assert target_only.first_needed_position(100, 3) == 85  # no draft KV: its count is ignored
    # decode: window + lagging draft query + pending token + tree, at any alignment
    assert w.decode_peak() == blocks_spanning(24 + 1 + 4 + 1, 4) <= -(-(24 + 4) // 4) + 2


@pytest.mark.parametrize("kw,field", [
    (dict(windows=()), "windows"), (dict(windows=(0,)), "windows"), (dict(windows=(4, 4, 4)), "windows"),
    (dict(windows=(4,), block_size=0), "block_size"), (dict(windows=(4,), lookahead=-1), "lookahead"),
    (dict(windows=(4,), draft_lag=-1), "draft_lag")])
def test_window_reuse_rejects_bad_fields(kw, field):
    args = dict(windows=(4,), block_size=4, lookahead=0) | kw
    with pytest.raises(ValueError, match=field):
        WindowReuse(**args)


def test_spec_config_window_reuse_must_be_a_bool():
    from specdec.engine import SpecConfig

    with pytest.raises(ValueError, match="window_reuse"):
        SpecConfig(window_reuse="yes")


def _cfg(window):
    return ModelConfig("MistralForCausalLM", 32, 8, 8, 1, 1, 1, 8, sliding_window=window)


def test_reuse_only_when_every_model_with_kv_is_windowed():
    assert window_reuse_for(_cfg(8), None, False, 4, 2) == WindowReuse((8,), 4, 2, 0)
    assert window_reuse_for(_cfg(8), _cfg(12), True, 4, 2) == WindowReuse((8, 12), 4, 2, 1)
    assert window_reuse_for(_cfg(8), _cfg(None), True, 4, 2) is None
    assert window_reuse_for(_cfg(None), _cfg(8), True, 4, 2) is None
    assert window_reuse_for(_cfg(8), _cfg(None), False, 4, 2) == WindowReuse((8,), 4, 2, 0)  # n-gram


# ---------------------------------------------------------------- release with shared blocks


def _sched(num_blocks=32, window=8, cache=True):
    alloc = BlockAllocator(num_blocks)
    pc = RadixPrefixCache(alloc, 4) if cache else None
    sched = Scheduler(SchedulerConfig(max_num_tokens=64), alloc, BlockTables(4, 64), 4, 0, pc,
                      WindowReuse((window,), 4, 0))
    return sched, alloc, pc


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_new_tokens=4))


def test_release_drops_only_this_requests_reference():
    sched, alloc, pc = _sched()
    a = _req("a", range(3, 27))  # 24 tokens: 5 full cacheable blocks of tokens[:-1]
    sched.add(a)
    batch = sched.schedule()
    assert [c.end for c in batch.prefill] == [23]
    a.num_computed = a.num_computed_draft = 23
    pc.insert(a)
    b = _req("b", list(range(3, 27)) + [5, 6])  # same 24-token prefix
    sched.add(b)
    sched.schedule()  # releases a's dead blocks, admits b (attaches 5 cached blocks, drops the dead ones)
    dead = 23 - 8 + 1  # first position a future query of a reads
    assert a.blocks[:dead // 4] == [RELEASED] * (dead // 4) and RELEASED not in a.blocks[dead // 4:]
    assert b.num_cached_tokens == 20 and b.blocks[:3] == [RELEASED] * 3  # 20 - 8 + 1 = 13 -> 3 dead
    cached = [n.block for n in pc._nodes()]
    assert all(alloc.refcount(x) >= 1 for x in cached)  # the cache keeps what both requests dropped
    assert alloc.refcount(cached[-1]) == 3  # cache + a + b still read the last cached block
    sched.finish(a, "stop")
    sched.finish(b, "stop")
    pc.evict_all()
    assert alloc.all_free()


def test_insert_stops_at_a_block_released_before_caching():
    sched, alloc, pc = _sched(cache=True)
    a = _req("a", range(3, 40))
    sched.add(a)
    sched.schedule()
    a.num_computed = a.num_computed_draft = 36
    sched.release_outside_window(a)  # blocks 0..6 dropped before anything was cached
    assert a.blocks[:7] == [RELEASED] * 7
    assert pc.insert(a) == 0 and len(pc) == 0
    sched.finish(a, "stop")
    assert alloc.all_free()


def test_windowed_prefill_allocates_chunk_by_chunk():
    sched, alloc, _ = _sched(cache=False)
    sched.cfg = SchedulerConfig(max_num_tokens=8)
    a = _req("a", range(3, 60))
    sched.add(a)
    for start in range(0, 56, 8):
        batch = sched.schedule()
        (chunk,) = batch.prefill
        assert (chunk.start, chunk.end) == (start, min(start + 8, 56))
        live = [x for x in a.blocks if x != RELEASED]
        assert len(live) <= sched.window.prefill_peak(8)  # never the whole prompt
        assert len(a.blocks) == -(-chunk.end // 4)
        a.num_computed = a.num_computed_draft = chunk.end
    sched.finish(a, "stop")
    assert alloc.all_free()


# ---------------------------------------------------------------- attention never reads released blocks


def test_gather_kv_refuses_a_released_block():
    cache = torch.randn(6, 4, 1, 2)
    row = torch.tensor([RELEASED, RELEASED, 3, 5], dtype=torch.int32)
    assert torch.equal(gather_kv(cache, row, 14, start=8), cache[[3, 3, 3, 3, 5, 5], [0, 1, 2, 3, 0, 1]])
    with pytest.raises(RuntimeError, match="position 7 lies in a released KV block"):
        gather_kv(cache, row, 14, start=7)


def _windowed_batch(partial: bool = False):
    """Causal decode/prefill rows and tree rows with prefixes far longer than the window
    (``partial``: only the last queries of each region are new, as in a draft's tree levels)."""
    tree = parents_topk(2, 2)
    causal = random_paged_batch([37, 22, 0], [1, 6, 9], 4, 2, 16, 4, seed=1,
                                query_lens=[1, 2, 4] if partial else None)
    trees = random_paged_batch([29, 41], [len(tree)] * 2, 4, 2, 16, 4, tree_parents=[tree, tree], seed=2,
                               query_lens=[4, 2] if partial else None)
    return causal, trees


def _kill_dead_blocks(batch, window, value):
    """A copy of the block tables whose blocks below each row's window point at ``value``."""
    tables = batch.meta.block_tables.clone()
    for b, pre in enumerate(batch.meta.prefix_lens.tolist()):
        tables[b, :max(0, pre - window + 1) // 4] = value
    return tables


def _args(batch, tables):
    m = batch.meta
    return (batch.q, batch.pool.k_cache, batch.pool.v_cache, tables, m.query_start_loc, m.prefix_lens,
            m.seq_lens, m.tree_mask, 0.25)


@pytest.mark.parametrize("window", [1, 3, 5, 8])
@pytest.mark.parametrize("partial", [False, True])
def test_torch_attention_reads_only_the_window(window, partial):
    """The per-row reference and the batched CPU path agree, and neither reads a released block."""
    for batch in _windowed_batch(partial):
        dead = _kill_dead_blocks(batch, window, RELEASED)
        want = paged_attention(*_args(batch, batch.meta.block_tables), window)
        assert torch.equal(paged_attention(*_args(batch, dead), window), want)
        got = paged_attention_padded(*_args(batch, dead), window)
        assert (got - want).abs().max().item() < 1e-5
        for attend in (paged_attention, paged_attention_padded):  # without the window every key is read
            with pytest.raises(RuntimeError, match="released"):
                attend(*_args(batch, dead), None)


@pytest.mark.skipif(not is_interpreted(_paged_attn_kernel), reason="needs TRITON_INTERPRET=1 (CPU)")
@pytest.mark.parametrize("window,partial", [(5, False), (8, True)])
def test_triton_kernel_reads_only_the_window(window, partial):
    """Dead entries point at a NaN block (any read would poison the output) or are RELEASED."""
    for batch in _windowed_batch(partial):
        want = paged_attention(*_args(batch, batch.meta.block_tables), window)
        used = set(batch.meta.block_tables.flatten().tolist())
        spare = next(b for b in range(batch.pool.storage.shape[0]) if b not in used)
        batch.pool.storage[spare] = float("nan")
        for value in (spare, RELEASED):
            got = paged_attention_triton(*_args(batch, _kill_dead_blocks(batch, window, value)), window,
                                         num_splits=2)
            assert not got.isnan().any()
            assert (got - want).abs().max().item() < 1e-4
