"""The n-gram drafter's table of n-grams shared across requests (``SharedNgrams``)."""

import random

import pytest
from specdec.scheduler.request import Request

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.drafters.ngram import NgramDrafter, NgramIndex, SharedNgrams, ngram_lookup


def test_a_request_continues_text_another_request_wrote():
    """A suffix found only in another request's text is continued from there; without the table, nothing."""
    shared = SharedNgrams()
    first = [1, 2, 3, 4, 5, 6, 7]
    NgramIndex(4, 1, shared).update(first, len(first))
    second = [9, 3, 4]
    assert NgramIndex(4, 1, shared).lookup(second, 3) == [5, 6, 7]
    assert NgramIndex(4, 1).lookup(second, 3) == []
    assert NgramIndex(4, 1, shared).lookup(second, 3, use_shared=False) == []  # how sampled rows look up
    assert NgramIndex(4, 1, shared).lookup([9, 8, 4], 3) == []  # 1-token matches stay within a request


def _with_other(other: list[int]) -> SharedNgrams:
    shared = SharedNgrams()
    NgramIndex(4, 1, shared).update(other, len(other))
    return shared


def test_own_match_wins_unless_the_shared_one_is_longer():
    other = [1, 2, 3, 50, 51, 52, 60]
    own = [2, 3, 70, 71, 9, 2, 3]  # own match (2, 3) -> 70; the other request has (2, 3) -> 50 as well
    assert NgramIndex(4, 1, _with_other(other)).lookup(own, 2) == [70, 71]
    same = [1, 2, 3, 70, 8, 1, 2, 3]  # own (1, 2, 3) -> 70 is as long as the other's: own wins
    assert NgramIndex(4, 1, _with_other(other)).lookup(same, 1) == [70]
    shorter = [2, 3, 70, 9, 1, 2, 3]  # own match only (2, 3); the other request has (1, 2, 3)
    assert NgramIndex(4, 1, _with_other(other)).lookup(shorter, 3) == [50, 51, 52]


def test_the_table_keeps_two_generations():
    """Past ``capacity`` n-grams the newest generation becomes the old one; the one before is dropped."""
    shared = SharedNgrams(min_n=2, capacity=4)
    a = [1, 2, 3]  # n-grams followed by a token: (1, 2) only
    NgramIndex(2, 2, shared).update(a, 3)
    b = [10, 11, 12, 13, 14, 15]  # (10, 11) ... (13, 14): 4 more, the table turns over
    NgramIndex(2, 2, shared).update(b, 6)
    assert shared.get((1, 2)) == (a, 0) and shared.get((13, 14)) == (b, 3)
    # a lookup reads both generations: (1, 2) from the old one, (12, 13) from the new one
    assert NgramIndex(2, 1, shared).lookup([7, 1, 2], 2) == [3]
    assert NgramIndex(2, 1, shared).lookup([7, 12, 13], 2) == [14, 15]
    c = [20, 21, 22, 23, 24, 25]  # 4 more: a's and b's generation is dropped
    NgramIndex(2, 2, shared).update(c, 6)
    assert shared.get((1, 2)) is None and shared.get((13, 14)) is None
    d = [30, 31, 32]
    NgramIndex(2, 2, shared).update(d, 3)
    assert shared.get((23, 24)) == (c, 3) and shared.get((30, 31)) == (d, 0)
    with pytest.raises(ValueError, match="capacity"):
        SharedNgrams(capacity=0)


def test_repeated_prompt_accepts_from_the_first_reply_and_stays_lossless(tiny_target):
    """The second of two identical requests drafts from the first one's reply: far more tokens per target
    forward than without the shared table, and the output is still target-only's."""
    prompt = [5, 17, 99, 23, 4, 42, 8, 77]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = SpecEngine(None, tiny_target, SpecConfig(num_blocks=64, block_size=8)).generate([prompt], params)[0]
    second, forgot = {}, {}
    for shared in (True, False):
        eng = SpecEngine("ngram", tiny_target, SpecConfig(tree="chain:4", num_blocks=64, block_size=8,
                                                          ngram_shared=shared, prefix_cache=False))
        assert eng.generate([prompt], params)[0].token_ids == ref.token_ids
        out = eng.generate([prompt], params)[0]
        assert out.token_ids == ref.token_ids
        second[shared] = out.stats.mean_accepted_length
        eng.forget_drafts()  # what benchmarks do before a timed run: the first reply is no longer drafted from
        out = eng.generate([prompt], params)[0]
        assert out.token_ids == ref.token_ids
        forgot[shared] = out.stats.mean_accepted_length
    assert second[True] >= 4.0 > second[False]
    assert forgot[True] == forgot[False] == second[False]


def test_ngram_shared_must_be_a_bool():
    from specdec.errors import FieldError

    with pytest.raises(FieldError, match="ngram_shared"):
        SpecConfig(ngram_shared="yes")


@pytest.mark.parametrize("max_n,min_n,shared_n", [(4, 1, 2), (3, 1, 2), (4, 2, 2), (5, 1, 2), (4, 1, 1),
                                                   (4, 1, 3), (4, 1, 4), (4, 1, 5)])
def test_incremental_index_equals_the_scan(max_n, min_n, shared_n):
    """``NgramIndex`` fed in random pieces (the default 4/1 shape takes an unrolled path, one loop per shared
    table shape) proposes what ``ngram_lookup``'s scan finds, and its own and shared-table entries are each
    n-gram's latest start."""
    rng = random.Random(max_n * 10 + min_n)
    tokens = [rng.randrange(5) for _ in range(7)]
    table = SharedNgrams(min_n=shared_n)
    index = NgramIndex(max_n, min_n, table)
    index.update(tokens, len(tokens))
    while len(tokens) < 400:
        tokens += [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
        assert index.lookup(tokens, 6, use_shared=False) == ngram_lookup(tokens, 6, max_n, min_n)
    latest = {}
    for end in range(len(tokens)):  # n-grams followed by a token, as the index keeps them
        for n in range(min_n, max_n + 1):
            if end - n >= 0:
                latest[tuple(tokens[end - n:end])] = end - n
    assert index.latest == latest
    shared = {g: start for g, start in latest.items() if len(g) >= shared_n}
    assert {g: e & 0xFFFFFFFF for g, e in table.new.items()} == shared
    assert {e >> 32 for e in table.new.values()} <= {index.owner}


@pytest.mark.parametrize("shared_table", [True, False])
def test_unrolled_lookup_equals_lookup(shared_table):
    """``NgramIndex.lookup_unrolled`` (update inlined) gives ``lookup``'s continuation at every step and leaves
    the same own and shared entries, for rows that share a table which turns over, from their first tokens on,
    also when a list is indexed apart from a lookup or cut."""
    rng = random.Random(7)
    twins = []
    for _ in range(2):
        table = SharedNgrams(min_n=2, capacity=300) if shared_table else None
        twins.append((table, [NgramIndex(4, 1, table) for _ in range(5)]))
    assert all(index.unrolled for _, indexes in twins for index in indexes)
    streams = [[rng.randrange(6)] for _ in range(5)]
    hits = 0
    for _ in range(150):
        for row, tokens in enumerate(streams):
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            if rng.random() < 0.2:  # indexed apart from a lookup (as a prefill chunk is), then more tokens
                for _, indexes in twins:
                    indexes[row].update(tokens, len(tokens))
                tokens += [rng.randrange(6) for _ in range(rng.randrange(0, 3))]
            elif rng.random() < 0.05:  # a list cut below what its index holds (a restored snapshot's)
                del tokens[max(1, len(tokens) - 3):]
            k, use_shared = rng.randrange(0, 9), rng.random() < 0.8
            fast = twins[0][1][row].lookup_unrolled(tokens, k, use_shared)
            assert fast == twins[1][1][row].lookup(tokens, k, use_shared)
            hits += bool(fast)
    assert hits > 300
    (fast_table, fast), (ref_table, ref) = twins
    assert [i.latest for i in fast] == [i.latest for i in ref] and [i.indexed for i in fast] == [i.indexed for i in ref]
    if shared_table:
        assert (fast_table.new, fast_table.old) == (ref_table.new, ref_table.old) and fast_table.old
        assert fast_table.new_owners.keys() == ref_table.new_owners.keys()


def test_unrolled_only_for_its_shape():
    assert NgramIndex(4, 1).unrolled and NgramIndex(4, 1, SharedNgrams(min_n=2)).unrolled
    assert not any(i.unrolled for i in (NgramIndex(3, 1), NgramIndex(4, 2), NgramIndex(4, 1, SharedNgrams(min_n=3))))
    assert NgramDrafter().unrolled and NgramDrafter(shared=False).unrolled and not NgramDrafter(max_n=3).unrolled


def test_drafter_proposes_the_same_chains_unrolled():
    """``NgramDrafter.propose`` through ``lookup_unrolled`` equals it through ``lookup``: greedy and sampled
    rows, rows near their token limit, rows joining late."""
    rng = random.Random(3)
    drafters = [NgramDrafter(k=6), NgramDrafter(k=6)]
    drafters[1].unrolled = False
    assert drafters[0].unrolled
    prompts = [[rng.randrange(8) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    params = [SamplingParams(max_new_tokens=rng.randrange(3, 200), temperature=float(i % 3 == 0)) for i in range(6)]
    rows = [[Request(str(i), list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))] for _ in drafters]
    drafted = 0
    for step in range(120):
        live = [i for i in range(min(6, 2 + step // 10)) if rows[0][i].num_output < rows[0][i].params.max_new_tokens]
        trees = [d.propose([r[i] for i in live]).trees for d, r in zip(drafters, rows)]
        assert [t.host for t in trees[0]] == [t.host for t in trees[1]]
        drafted += sum(t.num_nodes for t in trees[0])
        for i in live:
            new = [rng.randrange(8) for _ in range(rng.randrange(1, 4))]
            for r in rows:
                r[i].tokens += new
    assert drafted > 500
