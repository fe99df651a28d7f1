"""Seeded speculative sampling is reproducible: across batch composition, engines, preemption and prefix-cache
hits, for every proposer (none, n-gram, a draft model, an EAGLE draft).

The distribution tests (chi-square against the exact target) live in tests/test_sampling_power.py;
the exact accept-rule checks in tests/test_acceptance.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import LoadedModel
from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROPOSERS = ["none", "ngram", "model", "eagle"]


@pytest.fixture(scope="module")
def tiny_eagle(tiny_target):
    """An untrained EAGLE draft on the tiny target (its last layer, a random fusion of its features)."""
    shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 256)
    model = eagle_from_target(tiny_target.model, shape, torch.arange(256), seed=2).eval().requires_grad_(False)
    return LoadedModel("eagle", model, None, model.config)


@pytest.fixture
def proposer(request, tiny_draft, tiny_eagle):
    """The ``draft`` argument of ``SpecEngine`` for a name in ``PROPOSERS``."""
    return {"none": None, "ngram": "ngram", "model": tiny_draft, "eagle": tiny_eagle}[request.param]


def _random_prompts(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------- seeded reproducibility


@pytest.mark.parametrize("tree", ["chain:2", "topk:2x2", "dynamic:8"])
def test_seed_reproducible_across_batch_composition(tiny_target, tiny_draft, tree):
    prompt = [17, 4, 99, 23, 5, 61, 8]
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_new_tokens=20, ignore_eos=True)

    def engine(**kw):
        return SpecEngine(tiny_draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8, **kw))

    alone = engine().generate([prompt], mine)[0].token_ids
    assert len(alone) == 20
    others = [[3, 4, 5], prompt, list(range(40, 80)), prompt, [9] * 12]
    params = [SamplingParams(temperature=0.8, seed=1, max_new_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.95, seed=43, max_new_tokens=20, ignore_eos=True),
              SamplingParams(max_new_tokens=15),
              mine,
              SamplingParams(temperature=1.3, top_k=20, seed=7, max_new_tokens=30, ignore_eos=True)]
    eng = engine()
    batch = eng.generate(others, params)
    assert batch[3].token_ids == alone
    assert batch[1].token_ids != alone  # another seed gives another sample
    one_by_one = engine(max_batch_size=1).generate(others, params)
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in batch]
    again = eng.generate([prompt], mine)[0]  # same engine, prefix now cached
    assert again.token_ids == alone
    assert eng.stats.accepted > 0
    assert eng.all_blocks_free()


@pytest.mark.parametrize("proposer", PROPOSERS, indirect=True)
def test_seeded_sampling_unchanged_by_batch_and_preemption(tiny_target, proposer, count_preemptions):
    """A seeded request gives the same tokens alone, in a batch, and when preemption recomputes its KV from its
    tokens (its random streams continue unchanged; a restart finds its own prompt in the prefix cache)."""
    prompts = _random_prompts([15 + 3 * i for i in range(8)], seed=9)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_new_tokens=20, ignore_eos=True)
              for i in range(8)]

    def engine(**kw):
        return SpecEngine(proposer, tiny_target, SpecConfig(tree="chain:4", block_size=4, adaptive=False, **kw))

    alone = engine(num_blocks=64, max_batch_size=1, prefix_cache=False).generate(prompts, params)
    batch = engine(num_blocks=512).generate(prompts, params)
    tight = engine(num_blocks=26, policy="max_utilization")
    preempted = count_preemptions(tight)
    outs = tight.generate(prompts, params)
    assert preempted and tight.scheduler.prefix_cache.stats.hits > 0  # (the prompts differ: restarts' hits)
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)
    assert tight.all_blocks_free()


@pytest.mark.parametrize("proposer", PROPOSERS, indirect=True)
def test_seeded_request_repeats_after_a_prefix_hit(tiny_target, proposer):
    """Two identical generate calls: the second finds the prompt in the prefix cache, and the draft sees the
    cached prefix as it saw it when it computed it, so the sampled tokens are the same."""
    prompt = _random_prompts([29], seed=4)[0]  # 3 full blocks of 8 before the last token
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_new_tokens=24, ignore_eos=True)
    eng = SpecEngine(proposer, tiny_target, SpecConfig(tree="chain:3", num_blocks=128, block_size=8, adaptive=False))
    first, again = (eng.generate([prompt], params)[0].token_ids for _ in range(2))
    assert eng.scheduler.prefix_cache.stats.hit_tokens == 24
    assert again == first
    assert eng.all_blocks_free()


def _record_trees(eng: SpecEngine) -> list:
    """From now on, (row tokens, tree tokens, tree parents) of every tree ``eng``'s drafter proposes."""
    seen, propose = [], eng.drafter.propose

    def spy(rows):
        out = propose(rows)
        seen.extend((tuple(r.tokens), t.tokens.tolist(), t.parents.tolist()) for r, t in zip(rows, out.trees))
        return out

    eng.drafter.propose = spy
    return seen


def test_eagle_trees_after_prefix_hits_equal_those_without_the_cache(tiny_target, tiny_eagle):
    """Greedy, float32: the EAGLE draft proposes the same trees whether the prefix cache served part of a prompt
    (a repeated prompt, a longer one after it, chunked) or a request adopted the blocks another request's chunk
    had just computed; the output still equals target-only decoding."""
    a, extra, c = _random_prompts([21, 10, 19], seed=6)
    calls = [[a], [a, a + extra, c, c]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    cfg = dict(tree="topk:2x2", num_blocks=256, block_size=4, max_num_tokens=8, adaptive=False)
    trees, outs = {}, {}
    for cached in (False, True):
        eng = SpecEngine(tiny_eagle, tiny_target, SpecConfig(prefix_cache=cached, **cfg))
        seen = _record_trees(eng)
        outs[cached] = [o.token_ids for prompts in calls for o in eng.generate(prompts, params)]
        trees[cached] = sorted(seen)
        assert eng.all_blocks_free()
    stats = eng.scheduler.prefix_cache.stats
    assert stats.hits == 2 and stats.hit_tokens > 2 * 20  # a, a + extra at attach; c at adopt
    assert trees[True] == trees[False]
    plain = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=4, prefix_cache=False))
    assert outs[True] == outs[False] == [o.token_ids for o in plain.generate(calls[0] + calls[1], params)]


@pytest.mark.slow
def test_smollm2_shipped_draft_repeats_a_seeded_request_after_a_prefix_hit(smollm2, chat_prompt_ids):
    """The shipped EAGLE draft on SmolLM2-135M: a seeded T=0.7 request whose prompt is cached but for its last
    token proposes the same trees, hence samples the same tokens, as the call that computed the prefix."""
    eng = SpecEngine("smollm2-135m-draft", smollm2, SpecConfig(adaptive=False))
    prompt = chat_prompt_ids[2][:33]  # 2 full blocks of 16 before the last token
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_new_tokens=12, ignore_eos=True)
    trees, runs = _record_trees(eng), []
    for _ in range(2):
        runs.append((eng.generate([prompt], params)[0].token_ids, list(trees)))
        trees.clear()
    assert eng.scheduler.prefix_cache.stats.hit_tokens == 32
    assert runs[1] == runs[0]
