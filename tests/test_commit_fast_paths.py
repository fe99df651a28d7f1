"""The host step's fast paths after the verify read give what the per-token, per-row rules give: stop and
length rules (``StopChecker.extend``), acceptance counts (``AcceptanceStats.record``), the blocks a committed
row keeps (``commit_accepted`` calls ``Scheduler.shrink`` only when it frees) and block-table rows
(``BlockTables.set_rows``)."""

import random

import numpy as np
from specdec.kvcache.allocator import BlockAllocator
from specdec.kvcache.block_table import BlockTables
from specdec.scheduler.request import Request, RequestStatus
from specdec.scheduler.scheduler import Scheduler, SchedulerConfig, commit_accepted
from specdec.scheduler.stop import StopChecker

from specdec.outputs import AcceptanceStats
from specdec.sampling_params import SamplingParams
from specdec.verifier import VerifyResult


def _appended_one_by_one(checker: StopChecker, req: Request, tokens: list[int]) -> tuple[str | None, int]:
    """The per-token rule: ``append`` until a token ends the request."""
    for i, tok in enumerate(tokens):
        reason = checker.append(req, tok)
        if reason:
            return reason, i + 1
    return None, len(tokens)


def test_extend_equals_appending_one_by_one_at_and_past_the_length_limit():
    """Random token streams with several EOS ids, stop ids and outputs already at (or past) max_new_tokens."""
    checker, rng = StopChecker(None), random.Random(1)
    for _ in range(2000):
        params = SamplingParams(max_new_tokens=rng.randrange(1, 6), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(8), rng.randrange(0, 3)))
        eos = tuple(rng.sample(range(8), rng.randrange(0, 3)))
        done = [9] * rng.randrange(0, params.max_new_tokens + 2)
        tokens = [rng.randrange(8) for _ in range(rng.randrange(1, 9))]
        one, many = Request("r", [9, 9], params, eos, [9, 9, *done]), Request("r", [9, 9], params, eos, [9, 9, *done])
        assert checker.extend(many, tokens) == _appended_one_by_one(checker, one, tokens), (params, eos, done, tokens)
        assert many.tokens == one.tokens


def _reference_stats(records) -> AcceptanceStats:
    """Counts straight from their definitions: depth d counts the forwards whose tree reached below d and
    those that accepted a token there."""
    ref = AcceptanceStats()
    width = max((depth for _, depth, _, _ in records), default=0)
    ref.target_forwards = len(records)
    ref.drafted = sum(d for d, _, _, _ in records)
    ref.accepted = sum(a for _, _, a, _ in records)
    ref.committed = sum(a + 1 if c is None else c for _, _, a, c in records)
    ref.depth_steps = [sum(depth > d for _, depth, _, _ in records) for d in range(width)]
    ref.depth_accepted = [sum(min(a, depth) > d for _, depth, a, _ in records) for d in range(width)]
    return ref


def test_record_counts_equal_their_definition_over_many_steps():
    rng = random.Random(2)
    for trial in range(50):
        records = []
        for _ in range(rng.randrange(0, 60)):
            depth = rng.choice([0, 0, 1, 3, 8, rng.randrange(0, 12)])  # 0: an empty tree (target-only step)
            accepted = rng.randrange(0, depth + 1)
            committed = rng.choice([None, accepted + 1, rng.randrange(1, accepted + 2)])
            records.append((rng.randrange(0, 32), depth, accepted, committed))
        stats = AcceptanceStats()
        for drafted, depth, accepted, committed in records:
            stats.record(drafted, depth, accepted, committed)
        assert stats == _reference_stats(records), trial
        total = AcceptanceStats()
        total.merge(stats)
        total.merge(stats)
        assert total == _reference_stats(records + records)


def _setup(lookahead: int, block_size: int, rows, seed: int):
    """A scheduler whose running rows hold random surplus blocks (as rejected tree slots leave them)."""
    alloc = BlockAllocator(512)
    sched = Scheduler(SchedulerConfig(max_batch_size=8), alloc, BlockTables(8, 64), block_size, lookahead)
    rng, reqs = random.Random(seed), []
    for i, (prompt, extra) in enumerate(rows):
        req = Request(str(i), list(range(1, prompt + 1)), SamplingParams(max_new_tokens=40, ignore_eos=True))
        req.bt_row, req.status = sched.tables.acquire_row(), RequestStatus.RUNNING
        req.blocks = alloc.allocate(sched.blocks_for(prompt + lookahead) + extra)
        sched.tables.set_row(req.bt_row, req.blocks)
        req.num_computed = prompt - 1
        sched.running.append(req)
        reqs.append(req)
    results = [VerifyResult(list(range(m)), [7] * m, 5, lookahead, lookahead, None)  # an in-place path: no KV moves
               for m in (rng.randrange(0, lookahead + 1) for _ in rows)]
    return sched, reqs, results


def test_commit_keeps_the_blocks_shrink_keeps():
    """``commit_accepted`` skips ``Scheduler.shrink`` for a row that has nothing to free: every row ends with
    the blocks, block-table row and pool count that calling ``shrink`` on each row gives."""
    rng, checker = random.Random(3), StopChecker(None)
    for seed in range(40):
        lookahead, block_size = rng.randrange(0, 12), rng.choice([1, 2, 4, 16])
        rows = [(rng.randrange(2, 40), rng.randrange(0, 3)) for _ in range(rng.randrange(1, 8))]
        fast, fast_reqs, results = _setup(lookahead, block_size, rows, seed)
        commit_accepted(fast, checker, None, fast_reqs, results)
        slow, slow_reqs, _ = _setup(lookahead, block_size, rows, seed)
        for req, res in zip(slow_reqs, results):
            checker.extend(req, [*res.accepted_tokens, res.bonus_token])
            slow.shrink(req)
        assert [r.blocks for r in fast_reqs] == [r.blocks for r in slow_reqs]
        assert fast.allocator.num_free == slow.allocator.num_free
        assert np.array_equal(fast.tables.host.numpy(), slow.tables.host.numpy())


def test_set_rows_writes_what_set_row_writes():
    """Grown, shrunk, rewritten and unchanged rows (a changed middle block at an equal length included)."""
    rng = random.Random(4)
    one, many = BlockTables(6, 12), BlockTables(6, 12)
    reqs = [Request(str(i), [1], SamplingParams()) for i in range(6)]
    for req in reqs:
        req.bt_row = one.acquire_row()
        many.acquire_row()
    for _ in range(300):
        for req in rng.sample(reqs, rng.randrange(0, len(reqs) + 1)):
            edit = rng.randrange(4)
            if edit == 0:
                req.blocks = req.blocks + [rng.randrange(100) for _ in range(rng.randrange(1, 3))]
            elif edit == 1:
                req.blocks = req.blocks[:rng.randrange(0, len(req.blocks) + 1)]
            elif edit == 2 and req.blocks:
                req.blocks = list(req.blocks)
                req.blocks[rng.randrange(len(req.blocks))] = rng.randrange(100)
            req.blocks = req.blocks[:12]
        for req in reqs:
            one.set_row(req.bt_row, req.blocks)
        many.set_rows(reqs)
        assert np.array_equal(one.host.numpy(), many.host.numpy())
        assert [many.host_rows([r.bt_row])[0, :len(r.blocks)].tolist() for r in reqs] == [r.blocks for r in reqs]


def _reference_running_text(tok, state: list, out: list[int]) -> str:
    """The incremental rule decoding both context windows every call (``state``: prefix/read offsets, text)."""
    prefix = tok.decode(out[state[0]:state[1]], skip_special_tokens=True)
    new = tok.decode(out[state[0]:], skip_special_tokens=True)
    if len(new) > len(prefix) and not new.endswith("\ufffd"):
        state[2] += new[len(prefix):]
        state[0], state[1] = state[1], len(out)
    return state[2]


def test_running_text_with_remembered_one_token_windows_equals_decoding_both_windows(smollm2):
    """One checker streams many requests (its one-token decodes remembered across them) in steps of 1-3
    tokens: multi-byte characters split over tokens, special tokens and random ids included."""
    tok, rng = smollm2.tokenizer, random.Random(5)
    checker = StopChecker(tok)
    texts = ["Héllo wörld! 你好，世界。 😀👍🏽 def f(x):\n    return x**2", "a a a a ☃☃ «guillemets» ‘q’"]
    streams = [tok.encode(t, add_special_tokens=False) for t in texts]
    streams += [[rng.choice([0, 1, 2, rng.randrange(len(tok))]) for _ in range(30)] for _ in range(6)]
    for ids in streams * 2:
        req, state, n = Request("r", [1], SamplingParams()), [0, 0, ""], 0
        while n < len(ids):
            n = min(len(ids), n + rng.choice([1, 1, 1, 2, 3]))
            req.tokens[1:] = ids[:n]
            assert checker.running_text(req) == _reference_running_text(tok, state, ids[:n])
        assert req.detok == state
