"""Speculative greedy decoding == target-only greedy decoding, token for token.

Tiny random pair (conftest: ``tiny_target`` 3 layers, ``tiny_draft`` a noisy copy of its first two
layers, same 256-token vocabulary) under every drafter and tree shape, batch 1 and a batch of 10
mixed-length requests, with and without prefix cache, and under preemption; then SmolLM2-135M
with its first 4 layers as the draft.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import truncate_layers
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

NEW = 24
LENGTHS = [3, 7, 12, 18, 25, 33, 41, 50, 9, 60]


def _random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _params(n: int) -> list[SamplingParams]:
    # half of the requests may stop at EOS (conftest.PAIR_EOS), the other half run to max_new_tokens
    return [SamplingParams(max_new_tokens=NEW, ignore_eos=bool(i % 2)) for i in range(n)]


@pytest.fixture(scope="module")
def mixed():
    """(prompts, params) of a batch of mixed-length requests."""
    return _random_prompts(LENGTHS, seed=3), _params(len(LENGTHS))


@pytest.fixture(scope="module")
def reference(tiny_target, mixed):
    prompts, params = mixed
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=512, block_size=8, prefix_cache=False))
    outs = eng.generate(prompts, params)
    assert eng.all_blocks_free()
    # both stop rules occur: some requests end at EOS, the others at max_new_tokens
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    return [o.token_ids for o in outs]


def _engine(draft_kind, tiny_draft, tiny_target, tree, **cfg):
    draft = {"model": tiny_draft, "ngram": "ngram", "self": tiny_target}[draft_kind]
    cfg = {"num_blocks": 512, "block_size": 8, **cfg}
    return SpecEngine(draft, tiny_target, SpecConfig(tree=tree, **cfg))


DRAFTERS = [("model", "chain:1"), ("model", "chain:4"), ("model", "chain:8"), ("model", "topk:2x3"),
            ("model", "dynamic:16"), ("ngram", "chain:4")]


@pytest.mark.parametrize("batch", [1, len(LENGTHS)])
@pytest.mark.parametrize("draft,tree", DRAFTERS)
def test_spec_greedy_equals_target_only(tiny_target, tiny_draft, mixed, reference, draft, tree, batch):
    prompts, params = mixed
    eng = _engine(draft, tiny_draft, tiny_target, tree, max_batch_size=batch)
    outs = eng.generate(prompts, params)
    for i, (out, ref) in enumerate(zip(outs, reference, strict=True)):
        assert out.token_ids == ref, f"request {i} (prompt length {len(prompts[i])})"
        assert out.finish_reason == ("length" if len(ref) == NEW else "stop")
    assert eng.all_blocks_free()
    # the speculative path really ran: trees were drafted, some accepted and some rejected
    st = eng.stats
    assert st.drafted > 0 and st.accepted > 0
    if draft == "model":
        assert st.accepted < st.drafted
        assert st.target_forwards < sum(len(r) for r in reference)


@pytest.mark.parametrize("tree,max_num_tokens", [("chain:4", 2048), ("topk:2x3", 2048), ("dynamic:16", 2048),
                                                 ("chain:4", 5)])  # 5: long prompts prefill in chunks
def test_spec_greedy_with_shared_prefix(tiny_target, tiny_draft, tree, max_num_tokens):
    common = _random_prompts([45], seed=11)[0]
    tails = _random_prompts([1, 4, 9, 2, 13, 6, 20, 3], seed=12)
    prompts = [common + t for t in tails] + [common[:17], common[:40]]
    params = _params(len(prompts))
    ref_eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=512, block_size=8, prefix_cache=False))
    ref = [o.token_ids for o in ref_eng.generate(prompts, params)]
    for prefix_cache in (True, False):
        eng = _engine("model", tiny_draft, tiny_target, tree, prefix_cache=prefix_cache,
                      max_num_tokens=max_num_tokens)
        for _ in range(2):  # the second round finds the whole shared prefix cached
            outs = eng.generate(prompts, params)
            assert [o.token_ids for o in outs] == ref, f"prefix_cache={prefix_cache}"
            assert eng.all_blocks_free()
        if prefix_cache:
            assert eng.scheduler.prefix_cache.stats.hit_tokens >= 5 * 8 * len(tails)


@pytest.mark.parametrize("draft,tree,prefix_cache", [
    ("model", "chain:4", False), ("model", "chain:4", True), ("ngram", "chain:4", True),
    ("model", "dynamic:16", False), ("model", "topk:2x3", True),
])
def test_spec_greedy_under_preemption(tiny_target, tiny_draft, mixed, reference, draft, tree, prefix_cache,
                                      count_preemptions):
    prompts, params = mixed
    # the longest request alone needs 60 + 24 + 16 + 1 positions = 13 blocks; together far more than 24
    eng = _engine(draft, tiny_draft, tiny_target, tree, num_blocks=24, policy="max_utilization",
                  prefix_cache=prefix_cache)
    preempted = count_preemptions(eng)
    outs = eng.generate(prompts, params)
    assert preempted, "expected the tiny pool to force preemption"
    assert [o.token_ids for o in outs] == reference
    assert eng.all_blocks_free()


# ---------------------------------------------------------------- draft == target


@pytest.mark.parametrize("k", [1, 4, 8])
def test_self_draft_accepts_everything(tiny_target, k):
    """With the target as its own draft every drafted token is accepted: K+1 tokens per forward.

    max_new_tokens is a multiple of K+1 so no step is cut short by the length limit."""
    prompts = _random_prompts([5, 22, 37], seed=5)
    eng = _engine("self", None, tiny_target, f"chain:{k}")
    n = 3 * (k + 1)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    ref = SpecEngine(None, tiny_target, SpecConfig(num_blocks=64, block_size=8)).generate(
        prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    for out, r in zip(outs, ref, strict=True):
        assert out.token_ids == r.token_ids
        assert out.stats.target_forwards == 3
        assert out.stats.drafted == out.stats.accepted == 3 * k
        assert out.stats.mean_accepted_length == k + 1
        assert out.stats.acceptance_by_depth == [1.0] * k
    assert eng.stats.mean_accepted_length == k + 1
    assert eng.all_blocks_free()


def test_stats_count_only_committed_tokens(tiny_target, mixed, reference):
    """A step cut short by max_new_tokens or a stop token counts only the tokens it appended."""
    eng = _engine("self", None, tiny_target, "chain:4")
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7
    assert out.stats.target_forwards == 2
    assert out.stats.committed == 7 and out.stats.accepted == 6
    prompts, params = mixed
    outs = eng.generate(prompts, params)  # some stop at EOS inside a step
    assert [o.token_ids for o in outs] == reference
    for o in outs:
        assert o.stats.committed == len(o.token_ids)
        # every forward appends its accepted tokens plus a bonus, except that a stop may cut either
        assert o.stats.committed - o.stats.target_forwards <= o.stats.accepted <= o.stats.committed
    assert eng.stats.committed == sum(len(r) for r in reference) + 7


@pytest.mark.parametrize("draft,tree", [("self", "chain:4"), ("model", "topk:2x3"), ("ngram", "chain:4")])
def test_stop_token_inside_an_accepted_run(tiny_target, tiny_draft, mixed, reference, draft, tree):
    """A stop token in the middle of a step's accepted tokens ends the request right there."""
    prompts, _ = mixed
    i = next(i for i, r in enumerate(reference) if len(r) == NEW)
    ref = reference[i]
    for j in (0, 2, 6, 13):
        stop_tok = ref[j]
        first = ref.index(stop_tok)
        eng = _engine(draft, tiny_draft, tiny_target, tree)
        out = eng.generate([prompts[i]], SamplingParams(max_new_tokens=NEW, ignore_eos=True,
                                                        stop_token_ids=[stop_tok]))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == ref[:first + 1]
        assert eng.all_blocks_free()
    for n in (1, 3, 7):  # max_new_tokens cutting a step short
        out = _engine(draft, tiny_draft, tiny_target, tree).generate(
            [prompts[i]], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
        assert out.finish_reason == "length" and out.token_ids == ref[:n]


def test_spec_stream_increments(tiny_target, tiny_draft, mixed, reference):
    prompts, params = mixed
    eng = _engine("self", tiny_draft, tiny_target, "chain:4")
    got: dict[str, list[int]] = {}
    final = {}
    multi = 0
    for out in eng.stream(prompts, params):
        assert out.request_id not in final
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.token_ids == got[out.request_id]
        multi += len(out.new_token_ids) > 1
        if out.finished:
            final[out.request_id] = out
    assert multi > 0  # speculation emits several tokens per step
    assert [final[k].token_ids for k in sorted(final, key=int)] == reference
    assert eng.all_blocks_free()


@pytest.mark.parametrize("arch,draft,tree", [
    ("mistral", "ngram", "chain:4"), ("mistral", "model", "chain:4"), ("mistral", "model", "topk:2x3"),
    ("mistral", "model", "dynamic:16"), ("qwen2", "model", "chain:4"), ("qwen2", "model", "topk:2x3")])
def test_spec_greedy_other_architectures(tiny_factory, mixed, arch, draft, tree):
    """Mistral with a sliding window (8) shorter than the prompts and than some trees' reach, and
    Qwen2 (q/k/v bias): speculation stays lossless. The draft is the target's first 2 layers."""
    from specdec.loading.registry import load_model

    prompts, params = mixed
    target = load_model(tiny_factory(f"{arch}_3l", arch, seed=21, num_hidden_layers=3))
    assert target.config.sliding_window == (8 if arch == "mistral" else None)
    ref = SpecEngine(None, target, SpecConfig(num_blocks=512, block_size=8)).generate(prompts, params)
    d = "ngram" if draft == "ngram" else truncate_layers(target, 2)
    eng = SpecEngine(d, target, SpecConfig(tree=tree, num_blocks=512, block_size=8, max_num_tokens=16))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.stats.accepted > 0
    assert eng.all_blocks_free()


# ---------------------------------------------------------------- SmolLM2-135M


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["dynamic:16"])  # (chain trees of the real model: test_engine_triton, tiny models)
def test_smollm2_spec_greedy_equals_target_only(smollm2, smollm2_target_only, chat_prompt_ids,
                                                smollm2_new_tokens, tree):
    draft = truncate_layers(smollm2, 4)
    eng = SpecEngine(draft, smollm2, SpecConfig(tree=tree, num_blocks=256))
    half = len(chat_prompt_ids) // 2  # (the first four questions; the shipped draft's tests take all eight)
    prompts, refs = chat_prompt_ids[:half], smollm2_target_only[:half]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=smollm2_new_tokens))
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.token_ids == ref.token_ids, f"prompt {i}"
        assert out.finish_reason == ref.finish_reason
    assert eng.stats.drafted > 0 and eng.stats.accepted > 0
    assert eng.all_blocks_free()
